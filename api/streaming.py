"""Model work from the event loop: a scheduler ticket's events as an async stream, and SSE framing.

The scheduler calls back from its thread; events cross into the loop with call_soon_threadsafe.
A client that goes away cancels its ticket: a streaming response's generator is cancelled by
Starlette when the client disconnects, and a plain request polls for the disconnect while it
waits; either way the scheduler drops it from the batch at its next step (or never starts it).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

_END = ("done", "error", "cancelled")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class TicketStream:
    def __init__(self, submit: Callable):
        """`submit(on_event)` queues the work (a scheduler's submit or submit_generation) → its ticket."""
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.ticket = submit(self._on_event)  # Busy → 429 before anything starts

    def _on_event(self, kind: str, payload: Any) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))

    async def next(self, request: Request | None = None) -> tuple[str, Any]:
        """The next event; with `request`, a disconnect while waiting cancels the ticket (ClientGone)."""
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), timeout=0.5)
            except (asyncio.TimeoutError, TimeoutError):
                if request is not None and await request.is_disconnected():
                    self.ticket.cancel()
                    raise ClientGone() from None

    async def result(self, request: Request) -> Any:
        """Wait for the end: the result, or the error raised."""
        while True:
            kind, payload = await self.next(request)
            if kind == "done":
                return payload
            if kind == "error":
                raise payload
            if kind == "cancelled":
                raise ClientGone()

    async def events(self, first: tuple[str, Any] | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Every event up to and including the last."""
        if first is not None:
            yield first
            if first[0] in _END:
                return
        while True:
            kind, payload = await self.next()
            yield kind, payload
            if kind in _END:
                return


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (optional) and a JSON (or literal string) `data:` line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def sse_response(stream: TicketStream, body: AsyncIterator[str]) -> StreamingResponse:
    """`body`'s events as text/event-stream. However it ends (the client gone mid-send included), the
    ticket is cancelled: a no-op once it finished, a freed slot otherwise."""

    async def guarded():
        try:
            async for text in body:
                yield text
        finally:
            stream.ticket.cancel()

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
