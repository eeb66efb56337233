"""The service's error hierarchy, mapped to HTTP in one place."""

from __future__ import annotations

import difflib
import types
from typing import Annotated, Any, Union, get_args, get_origin
from urllib.parse import urlencode

from fastapi import FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.core.errors import ECHO_CHARS, LoginRequired, ServiceError, shown


class ErrorBody(BaseModel):
    """The one error shape: a message, or a list of validation errors."""

    detail: str | list[dict[str, Any]]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "The body could not be read"},
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
    403: {"model": ErrorBody, "description": "A token that may not do this"},
    404: {"model": ErrorBody, "description": "No such run, sweep or worker run"},
    409: {"model": ErrorBody, "description": "Conflicts with the current state"},
    413: {"model": ErrorBody, "description": "Request body too large"},
    415: {"model": ErrorBody, "description": "A body that is not sent as JSON"},
    422: {"model": ErrorBody, "description": "Invalid input"},
}


def error_body(detail: Any) -> dict[str, Any]:
    """The one JSON error shape: ``{"detail": ...}``."""
    return {"detail": detail}


# Validation errors listed in one answer; a body with 80,000 unknown keys would
# otherwise get 80,000 errors back (an answer many times the size of the request).
MAX_ERRORS = 20
def _json_safe(errors: Any) -> Any:
    """Pydantic error lists can carry exception objects in ``ctx``; keep them printable.
    At most ``MAX_ERRORS``, then one entry that says how many more there were."""
    safe: list[dict[str, Any]] = []
    for err in errors[:MAX_ERRORS]:
        err = dict(err)
        if "ctx" in err:
            err["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        if "input" in err:
            # Echo what was sent as short text: it may not even be JSON (NaN, huge strings).
            err["input"] = shown(err["input"])
        if "loc" in err:
            # A key can be as long as the body: echo each part of the path short too.
            err["loc"] = [p if not isinstance(p, str) or len(p) <= ECHO_CHARS
                          else p[:ECHO_CHARS] + "..." for p in err["loc"]]
        err.pop("url", None)
        if isinstance(err.get("msg"), str):
            # A validator's own sentence, without pydantic's "Value error, " before it.
            err["msg"] = err["msg"].removeprefix("Value error, ")
        safe.append(err)
    if len(errors) > MAX_ERRORS:
        safe.append({"type": "too_many_errors", "loc": [], "input": None,
                     "msg": f"and {len(errors) - MAX_ERRORS} more errors not listed"})
    return safe


def _unparsable_body(exc: BaseException | None) -> str | None:
    """What made a JSON body unparsable, from the parser's own exception (FastAPI turns
    every failure but a syntax error into one 400 "There was an error parsing the body")."""
    if isinstance(exc, RecursionError):
        return "the JSON body is nested too deeply to parse"
    if isinstance(exc, UnicodeDecodeError):
        return f"the body is not UTF-8: byte {exc.start} is not ({exc.reason})"
    if isinstance(exc, ValueError) and "digits" in str(exc):
        return "the JSON body has a number with more digits than can be parsed (4300)"
    if exc is not None:
        return f"the JSON body could not be parsed: {type(exc).__name__}"
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Map service errors and validation errors to the one error shape."""

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, _exc: LoginRequired) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?{urlencode({'next': target})}", status_code=303)

    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(error_body(exc.detail), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        body_model = _json_body_model(request)
        errors = exc.errors()
        if body_model is not None and (problem := _not_sent_as_json(request, errors)) is not None:
            return JSONResponse(error_body(problem), status_code=415)
        if body_model is not None:
            # Only those listed (``MAX_ERRORS``): a body can carry thousands of unknown keys.
            errors = [_suggest_field(err, body_model) for err in errors[:MAX_ERRORS]] + list(
                errors[MAX_ERRORS:])
        return JSONResponse(error_body(_json_safe(errors)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        detail = exc.detail
        if exc.status_code == 400:
            detail = _unparsable_body(exc.__cause__) or detail
        if exc.status_code == 405:
            # Every method the path answers to, not only those of the first route that matched.
            headers["Allow"] = ", ".join(_methods_for(request))
        return JSONResponse(error_body(detail), status_code=exc.status_code, headers=headers)


# Errors FastAPI gives for a JSON route whose body it did not parse as JSON: it reads a body
# sent as text/plain, a form or with no Content-Type as bytes, which no model accepts.
_NOT_JSON_ERRORS = {"model_attributes_type", "dict_type", "list_type", "missing"}
SEND_JSON = "send the body as JSON with Content-Type: application/json"


def _json_body_model(request: Request) -> Any:
    """The type a route's JSON body is validated as, or None (no body, or a form)."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    if field is None or isinstance(field.field_info, params.Form):
        return None
    return field.field_info.annotation


def _not_sent_as_json(request: Request, errors: Any) -> str | None:
    """Why a body failed as a whole when it was not sent as JSON, or None."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return None
    if not any(tuple(err.get("loc", ())) == ("body",) and err.get("type") in _NOT_JSON_ERRORS
               for err in errors):
        return None
    sent = f"Content-Type: {media}" if media else "no Content-Type"
    return f"{SEND_JSON} (the request had {sent})"


def _suggest_field(err: dict[str, Any], model: Any) -> dict[str, Any]:
    """An unknown field's error with the closest valid name in its message (``extra_forbidden``
    at ``loc``), or the valid names when none is close."""
    loc = list(err.get("loc", ()))
    if err.get("type") != "extra_forbidden" or len(loc) < 2 or loc[0] != "body":
        return err
    names = _field_names(model, loc[1:-1])
    if not names:
        return err
    unknown = str(loc[-1])[:ECHO_CHARS]
    close = difflib.get_close_matches(unknown, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(names)}"
    return {**err, "msg": f"unknown field {unknown!r}; {hint}"}


def _field_names(model: Any, path: list[Any]) -> list[str]:
    """The field names (aliases where set) of the model found by following ``path`` (field
    names, list indices, dict keys) from ``model``; empty when the path leads to no model."""
    current = _model_in(model)
    for part in path:
        if current is None:
            return []
        if isinstance(current, tuple):  # a list or dict of models: this part is an index or key
            current = current[1]
            continue
        field = next((f for name, f in current.model_fields.items()
                      if part in (name, f.alias)), None)
        if field is None:
            return []
        current = _model_in(field.annotation)
    if current is None or isinstance(current, tuple):
        return []
    return [f.alias or name for name, f in current.model_fields.items()]


def _model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (through Optional and Annotated), or
    ``("items", model)`` for a list or dict of models, or None."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _model_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        found = [m for m in (_model_in(a) for a in get_args(annotation)) if m is not None]
        return found[0] if found else None
    if origin in (list, dict):
        inner = _model_in(get_args(annotation)[-1]) if get_args(annotation) else None
        return ("items", inner) if inner is not None and not isinstance(inner, tuple) else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _methods_for(request: Request) -> list[str]:
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, APIRoute) and route.path_regex.match(request.url.path):
            methods |= route.methods - {"HEAD"}
    return sorted(methods)
