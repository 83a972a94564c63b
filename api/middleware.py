"""Plain ASGI middlewares: past the limit of requests in flight, a 503; an unknown key is refused before
its body is read; request bodies over the limit get 413, and ones that arrive too slowly 408, before any
route reads them; every response is counted by route template and status for /metrics."""
from __future__ import annotations

import asyncio
import time

from .auth import identify
from .errors import ApiError, response

_CLOSE = {"Connection": "close"}  # the body was not read: the connection cannot carry another request


class InFlight:
    """Past `limit` requests in flight (bodies arriving, streams running), a JSON 503 with Retry-After naming
    RAGCACHE_MAX_CONNECTIONS; the probes and /metrics always answer, for the load balancer that asks."""

    EXEMPT = ("/health", "/ready", "/metrics")

    def __init__(self, app, limit: int):
        self.app, self.limit, self.count = app, limit, 0  # the event loop's: no lock needed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            return await self.app(scope, receive, send)
        if self.count >= self.limit:
            return await response(503, f"{self.count} requests are in flight (RAGCACHE_MAX_CONNECTIONS="
                                       f"{self.limit}); retry in 1 s", headers={"Retry-After": "1", **_CLOSE})(
                scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class KeyFirst:
    """With keys on, a /v1 request without a known key gets its 401 from the headers alone: a stranger's
    upload is never buffered (the route's own check decides what a known key may do)."""

    def __init__(self, app, settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.settings.auth and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            try:
                identify(self.settings, header)
            except ApiError as e:
                return await response(e.status, e.message, e.param, {**(e.headers or {}), **_CLOSE})(
                    scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `max_bytes`, by its Content-Length or, when chunked, as it arrives; 408 for one
    not complete within `timeout_s` (a stalled upload holds its connection no longer than that)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_big(scope, receive, send)
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout_s
        while True:  # buffer it (bounded by the limit), then replay it to the app
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return await response(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                           "(RAGCACHE_BODY_TIMEOUT_S)", headers=_CLOSE)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_big(scope, receive, send)
            if not message.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_big(self, scope, receive, send):
        await response(413, f"request body over {self.max_bytes} bytes (RAGCACHE_MAX_BODY_BYTES)",
                       headers=_CLOSE)(scope, receive, send)


class CountRequests:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def tracked(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            route = scope.get("route")
            metrics = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()
