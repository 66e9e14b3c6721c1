"""OpenAI-shaped JSON answers: a body with its status (`_json_response`), an `APIError` with the headers its status
calls for (`_error`: Retry-After on 429/503, WWW-Authenticate on 401, Connection: close on 408), and the app's
handlers that give the framework's own errors the same shape (`add_error_handlers`: unknown path 404, wrong method
405, framework validation 422, anything unexpected 500): {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging
from typing import Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dblock.serving.protocol_base import APIError

log = logging.getLogger("dblock.serving")


def _json_response(status: int, body: dict, headers: Optional[dict] = None):
    return JSONResponse(body, status_code=status, headers=headers)


def _error(e: APIError):
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if e.status == 408:                                   # the rest of the body may never come: end the connection
        headers = {"Connection": "close"}
    return _json_response(e.status, e.body(), headers)


def add_error_handlers(app) -> None:
    """The app's handlers for what FastAPI and Starlette raise themselves, answered in OpenAI's error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):                   # unknown path, wrong method, ... in OpenAI shape
        where = f"{request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            e = APIError(404, f"{where}: no such endpoint", None, "unknown_url")
        elif exc.status_code == 405:
            allowed = headers.get("Allow") or headers.get("allow")
            e = APIError(405, f"{where}: method not allowed" + (f" (allowed: {allowed})" if allowed else ""), None,
                         "method_not_allowed")
        else:
            e = APIError(exc.status_code, f"{where}: {exc.detail}", None, None)
        return _json_response(e.status, e.body(), headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):                      # parameters FastAPI itself validated
        errs = exc.errors() or [{}]
        loc = [p for p in errs[0].get("loc", ()) if p not in ("body", "query", "path", "header", "cookie")]
        param = "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + str(p) for i, p in enumerate(loc))
        msg = str(errs[0].get("msg", "invalid"))
        e = APIError(422, f"{param}: {msg}" if param else msg, param or None, "invalid_value")
        return _json_response(422, e.body())

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):                   # one JSON line instead of a bare 500 page
        log.exception("unhandled error on %s", request.url.path)
        return _json_response(500, APIError(500, f"internal error: {type(exc).__name__}").body())
