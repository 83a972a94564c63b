"""Every error is JSON: {"error": {"message", "type", "param"}} (the OpenAI shape), never a traceback.

ragcache's errors map to statuses here, in one place: UserError 400 (503 when it is the
environment's fault), NotFound 404, Conflict 409, Busy 429 with Retry-After, a database that cannot be
reached (or dropped the connection mid-query) 503 with Retry-After; validation 422 naming the field;
unknown routes 404; anything unexpected 500 with a generic message (logged).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragcache.corpus.body import json_problem
from ragcache.errors import Busy, Conflict, Invalid, NotFound, UserError

from .schemas import ErrorBody
from .streaming import ClientGone

log = logging.getLogger("ragcache.api")

DATABASE_RETRY_S = 5  # Retry-After while the database is unreachable: a restart or a failover, not a queue
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


def documented(*codes: int) -> dict:
    """OpenAPI `responses` for a router: these statuses, each with the error body."""
    words = {400: "bad input (the message says what)", 401: "no key, or an unknown one", 403: "outside this key's "
             "namespaces, or an admin route", 404: "an unknown id, or a namespace with nothing precomputed",
             409: "collides with work under way", 413: "body over RAGCACHE_MAX_BODY_BYTES",
             422: "a field fails validation (named in param)", 429: "queue full: see Retry-After",
             503: "the database is unavailable: see Retry-After"}
    return {c: {"model": ErrorBody, "description": words[c]} for c in codes}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param}}


def response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body(status, message, param), status_code=status, headers=headers)


def from_exception(e: Exception) -> ApiError:
    """The HTTP status of an error raised by ragcache (or a bug: 500)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ClientGone):
        return ApiError(499, "the client closed the request")  # nobody reads it: for the logs and metrics
    if isinstance(e, Busy):
        return ApiError(429, str(e), headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, NotFound):
        return ApiError(404, str(e))
    if isinstance(e, Invalid):
        return ApiError(422, str(e), e.field)
    if isinstance(e, Conflict):
        return ApiError(409, str(e))
    if isinstance(e, UserError):
        return ApiError(400 if e.usage else 503, str(e))
    if isinstance(e, OperationalError):  # the database is down, restarting, or cut this connection
        log.warning("database unavailable: %s", str(e.orig).splitlines()[0] if e.orig else e)
        return ApiError(503, "the database is unavailable (RAGCACHE_DATABASE_URL); the request was not served, "
                             f"retry in {DATABASE_RETRY_S} s", headers={"Retry-After": str(DATABASE_RETRY_S)})
    if isinstance(e, DataError):  # a value the schema let through but SQL cannot store: still the input's fault
        return ApiError(422, "a value in the request cannot be stored (too long, or holding a NUL character)")
    log.error("unexpected error", exc_info=e)
    return ApiError(500, f"internal error ({type(e).__name__}); the server log has the details")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_r: Request, e: ApiError):
        return response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(UserError)
    async def _user(_r: Request, e: UserError):
        err = from_exception(e)
        return response(err.status, err.message, err.param, err.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_r: Request, e: ClientGone):
        return response(499, "the client closed the request")  # nobody reads it: for the metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            where = first["loc"][-1] if first.get("loc") else 0
            return response(422, f"the body is not valid JSON (at character {where}): "
                                 f"{first.get('ctx', {}).get('error', 'malformed')}", "body")
        loc = list(first.get("loc", ()))
        loc = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)]
        param = ".".join(loc) or None
        why = first.get("msg", "invalid").removeprefix("Value error, ")  # pydantic's prefix for our ValueErrors
        return response(422, f"{param or 'request'}: {why}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException):
        if (problem := json_problem(e.__cause__)) is not None:  # FastAPI's "error parsing the body"
            return response(422, f"the body is not usable JSON: {problem}", "body")
        return response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_r: Request, e: Exception):
        err = from_exception(e)
        return response(err.status, err.message)
