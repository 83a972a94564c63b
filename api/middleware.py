"""Two plain ASGI middlewares: request bodies over the limit get 413 before any route reads them,
and every response is counted by route template and status for /metrics."""
from __future__ import annotations

from .errors import response


class BodyLimit:
    """413 for a body over `max_bytes`, by its Content-Length or, when chunked, as it arrives."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_big(scope, receive, send)
        chunks, size = [], 0
        while True:  # buffer it (bounded by the limit), then replay it to the app
            message = await receive()
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
        await response(413, f"request body over {self.max_bytes} bytes (RAGCACHE_MAX_BODY_BYTES)")(scope, receive, send)


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
