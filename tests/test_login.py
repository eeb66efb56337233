"""The pages' login session: a signed, expiring cookie that never holds the API token."""

from __future__ import annotations

import time
from http.cookies import Morsel, SimpleCookie
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.web.auth import COOKIE, LEGACY_COOKIE, SESSION_MAX_AGE_S, session_signer
from tests.conftest import API_TOKEN, ServedTestClient, make_settings


@pytest.fixture
def client(shared_client: TestClient) -> TestClient:
    """A client of its own on the module's one service: a session lives in the client's
    cookies, so no test here leaves anything on the service."""
    return shared_client


def _set_cookies(response: httpx.Response) -> dict[str, Morsel[str]]:
    """The cookies a response sets, by name, with their attributes."""
    jar: SimpleCookie = SimpleCookie()
    for header in response.headers.get_list("set-cookie"):
        jar.load(header)
    return dict(jar)


def _login(client: TestClient) -> httpx.Response:
    client.headers.pop("Authorization", None)
    return client.post("/login", data={"token": API_TOKEN, "next": "/"}, follow_redirects=False)


def _signed(api_token: str = API_TOKEN, age_s: int = 0, monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    """A session cookie value signed with ``api_token``'s key, ``age_s`` seconds old."""
    signer = session_signer(api_token)
    if age_s:
        assert monkeypatch is not None
        monkeypatch.setattr(signer, "get_timestamp", lambda: int(time.time()) - age_s)
    return signer.sign(b"admin").decode()


def _with_cookie(client: TestClient, name: str, value: str) -> TestClient:
    client.headers.pop("Authorization", None)
    client.cookies.set(name, value)
    return client


def _refused(client: TestClient) -> str:
    """Assert the page sends the browser to log in and the API says 401; the API's message."""
    page = client.get("/", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
    api = client.get("/api/runs")
    assert api.status_code == 401
    detail: str = api.json()["detail"]
    return detail


def test_login_sets_a_signed_http_only_strict_cookie_without_the_token(client: TestClient) -> None:
    response = _login(client)
    assert response.status_code == 303
    cookie = _set_cookies(response)[COOKIE]
    assert API_TOKEN not in cookie.value and API_TOKEN not in response.headers["set-cookie"]
    assert session_signer(API_TOKEN).unsign(cookie.value, max_age=SESSION_MAX_AGE_S) == b"admin"
    assert cookie["httponly"] and cookie["samesite"].lower() == "strict" and cookie["path"] == "/"
    assert int(cookie["max-age"]) == SESSION_MAX_AGE_S
    assert not cookie["secure"]  # plain http: a Secure cookie would never come back


def test_login_over_https_marks_the_cookie_secure(tmp_path: Path) -> None:
    with ServedTestClient(make_settings(tmp_path), base_url="https://testserver") as client:
        response = client.post("/login", data={"token": API_TOKEN}, follow_redirects=False)
        assert _set_cookies(response)[COOKIE]["secure"]


def test_wrong_token_sets_no_cookie(client: TestClient) -> None:
    client.headers.pop("Authorization")
    response = client.post("/login", data={"token": "nope"}, follow_redirects=False)
    assert response.status_code == 401 and COOKIE not in _set_cookies(response)


def test_session_opens_pages_api_reads_and_writes(client: TestClient) -> None:
    _login(client)
    page = client.get("/", follow_redirects=False)
    assert page.status_code == 200 and 'action="/logout"' in page.text
    assert client.get("/api/runs").status_code == 200
    # Past the auth check: the run just does not exist.
    assert client.post("/api/runs/r-none/cancel").status_code == 404


def test_signed_session_alone_opens_the_api(client: TestClient) -> None:
    # No bearer token, no login call: the signed cookie is the only credential.
    _with_cookie(client, COOKIE, _signed())
    assert client.get("/api/runs").status_code == 200


def test_tampered_session_is_refused(client: TestClient) -> None:
    value = _signed()
    # Change the signature's first character: every bit of it counts (the last base64
    # character of a 20-byte HMAC also carries unused bits, so changing it may change nothing).
    cut = value.rindex(".") + 1
    tampered = value[:cut] + ("A" if value[cut] != "A" else "B") + value[cut + 1:]
    assert "not valid" in _refused(_with_cookie(client, COOKIE, tampered))


def test_session_with_a_forged_subject_is_refused(client: TestClient) -> None:
    value = _signed()
    forged = "root" + value[len("admin"):]
    assert "not valid" in _refused(_with_cookie(client, COOKIE, forged))


def test_expired_session_is_refused(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _signed(age_s=SESSION_MAX_AGE_S + 60, monkeypatch=monkeypatch)
    assert "expired" in _refused(_with_cookie(client, COOKIE, old))


def test_session_just_inside_its_age_still_works(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    recent = _signed(age_s=SESSION_MAX_AGE_S - 3600, monkeypatch=monkeypatch)
    assert _with_cookie(client, COOKIE, recent).get("/", follow_redirects=False).status_code == 200


def test_rotating_the_api_token_ends_every_session(client: TestClient) -> None:
    before_rotation = _signed(api_token="the-previous-api-token")
    assert "not valid" in _refused(_with_cookie(client, COOKIE, before_rotation))


@pytest.mark.parametrize("name", [COOKIE, LEGACY_COOKIE])
def test_cookie_holding_the_raw_token_is_refused(client: TestClient, name: str) -> None:
    assert "log in again" in _refused(_with_cookie(client, name, API_TOKEN))


def test_logout_clears_the_session(client: TestClient) -> None:
    _login(client)
    response = client.post("/logout", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/login"
    cleared = _set_cookies(response)[COOKIE]
    assert cleared.value == "" and int(cleared["max-age"]) == 0
    assert COOKIE not in client.cookies
    page = client.get("/", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/login")


def test_login_clears_an_old_token_cookie(client: TestClient) -> None:
    _with_cookie(client, LEGACY_COOKIE, API_TOKEN)
    response = client.post("/login", data={"token": API_TOKEN}, follow_redirects=False)
    assert int(_set_cookies(response)[LEGACY_COOKIE]["max-age"]) == 0
    assert client.get("/", follow_redirects=False).status_code == 200


def test_logout_button_only_with_a_session(tmp_path: Path) -> None:
    with ServedTestClient(make_settings(tmp_path, public_read=True)) as client:
        assert 'action="/logout"' not in client.get("/").text
        client.post("/login", data={"token": API_TOKEN}, follow_redirects=False)
        assert 'action="/logout"' in client.get("/").text
