"""Logging in to the pages with the API token, and out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from service.web.auth import COOKIE, LEGACY_COOKIE, SESSION_MAX_AGE_S, is_admin, new_session
from service.web.pages.render import templates

# The login page itself is open.
login_router = APIRouter(include_in_schema=False)


def _safe_next(target: str) -> str:
    # Only paths on this site: never an open redirect.
    return target if target.startswith("/") and not target.startswith("//") else "/"


@login_router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: Annotated[str, Query(max_length=2000)] = "/") -> HTMLResponse:
    """Ask for the API token."""
    return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next), "error": ""})


@login_router.post("/login", response_model=None)
def login(
    request: Request,
    token: Annotated[str, Form(max_length=512)],
    next: Annotated[str, Form(max_length=2000)] = "/",
) -> HTMLResponse | RedirectResponse:
    """Check the API token and open a signed, expiring session (the cookie never holds the token)."""
    if not is_admin(request, token):
        return templates.TemplateResponse(
            request, "login.html", {"next": _safe_next(next), "error": "wrong token"}, status_code=401
        )
    response = RedirectResponse(_safe_next(next), status_code=303)
    # SameSite=Strict keeps the cookie off cross-site requests: the CSRF defence of the
    # mutating API calls the pages make with it.
    response.set_cookie(COOKIE, new_session(request), max_age=SESSION_MAX_AGE_S, path="/",
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    if LEGACY_COOKIE in request.cookies:
        _clear_cookie(request, response, LEGACY_COOKIE)
    return response


@login_router.post("/logout")
def logout(request: Request) -> RedirectResponse:
    """End the browser's login session and go to the login page."""
    response = RedirectResponse("/login", status_code=303)
    _clear_cookie(request, response, COOKIE)
    if LEGACY_COOKIE in request.cookies:
        _clear_cookie(request, response, LEGACY_COOKIE)
    return response


def _clear_cookie(request: Request, response: RedirectResponse, name: str) -> None:
    response.delete_cookie(name, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")

