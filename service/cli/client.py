"""The REST API as the command line calls it: where the service is, its token, and errors
turned into one line for the terminal."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    """The service refused a call (4xx/5xx) or could not be reached: one line to show."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def service_url(given: str | None) -> str:
    """``--url``, else ``DECODEBENCH_URL``, else the port a local service listens on."""
    if given:
        return given.rstrip("/")
    if os.environ.get("DECODEBENCH_URL"):
        return os.environ["DECODEBENCH_URL"].rstrip("/")
    port = os.environ.get("DECODEBENCH_PORT")
    return f"http://127.0.0.1:{port}" if port else DEFAULT_URL


def api_token(given: str | None) -> str | None:
    """``--token``, else ``DECODEBENCH_API_TOKEN``, else the token a local service wrote in its
    data folder (``DECODEBENCH_DATA_DIR``, default ``./var``), else none."""
    if given:
        return given
    if os.environ.get("DECODEBENCH_API_TOKEN"):
        return os.environ["DECODEBENCH_API_TOKEN"]
    path = Path(os.environ.get("DECODEBENCH_DATA_DIR", "var")) / "api-token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _message(response: httpx.Response) -> str:
    """The service's own words for a refusal (its error body) with the status after them,
    else the status line."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:300]}"
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("message") or body.get("error")
        if isinstance(detail, list):  # FastAPI's validation errors: where and what, each
            detail = "; ".join(_validation_error(d) for d in detail if isinstance(d, dict))
        if detail:
            return f"{detail} (HTTP {response.status_code})"
    return f"HTTP {response.status_code}: {body}"


def _validation_error(error: dict[str, Any]) -> str:
    """One validation error as ``field.path: what``; a whole-body error as just ``what``."""
    where = ".".join(str(p) for p in error.get("loc", [])[1:])
    what = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {what}" if where else what


class Client:
    """Calls to one service; every failure is an ``ApiError``."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0) -> None:
        self.url = service_url(url)
        headers = {"Authorization": f"Bearer {tok}"} if (tok := api_token(token)) else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ApiError(f"cannot reach the service at {self.url} ({error}); start it with "
                           "`decodebench serve` or point --url / DECODEBENCH_URL at it") from None
        if response.status_code == 401:
            raise ApiError(f"HTTP 401: the service at {self.url} wants its API token: --token, "
                           "DECODEBENCH_API_TOKEN, or var/api-token next to a local service", 401)
        if response.status_code >= 400:
            raise ApiError(_message(response), response.status_code)
        return response

    def get(self, path: str, **params: Any) -> Any:
        return self.call("GET", path, params=params).json()

    def post(self, path: str, body: Any = None, **params: Any) -> Any:
        response = self.call("POST", path, json=body, params=params)
        return response.json() if response.content else None

    def post_anew(self, path: str) -> Any:
        """POST on a client of its own: after Ctrl-C the interrupt may have come in the middle
        of a call of this client's, and its connections are not to be trusted then."""
        http = self.http
        self.http = httpx.Client(base_url=self.url, headers=http.headers, timeout=http.timeout)
        try:
            return self.post(path)
        finally:
            self.http.close()
            self.http = http

    def close(self) -> None:
        self.http.close()
