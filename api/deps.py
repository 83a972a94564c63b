"""What routes share: the app's service, and a generation queued on the scheduler."""
from __future__ import annotations

import time

from fastapi import Request

from ragcache.serving.generation import Ask

from .errors import from_exception
from .streaming import TicketStream


def service(request: Request):
    return request.app.state.service


async def start_generation(request: Request, ask: Ask) -> tuple[TicketStream, tuple]:
    """Queue `ask` on the model thread and wait for its first event (text, or the end).

    Errors found before the first token (a bad mode, an empty namespace, a prompt over the
    context) are raised here, so the client gets a proper 4xx, not a stream that fails.
    """
    scheduler = request.app.state.scheduler
    stream = TicketStream(lambda on_event: scheduler.submit_generation(ask, on_event))
    first = await stream.next(request)
    if first[0] == "error":
        raise from_exception(first[1])
    return stream, first


def record(request: Request, route: str, ask: Ask, result: dict) -> None:
    """A finished generation: into the recent-requests log and the histograms."""
    request.app.state.metrics.observe(result)
    request.app.state.service.requests.add({
        "id": result["request_id"], "time": time.time(), "route": route, "namespace": ask.namespace,
        "mode": result["mode"], "status": 200, **result["usage"], "timings_ms": result["timings_ms"],
        "finish_reason": result["finish_reason"]})


async def on_side_worker(request: Request, work):
    """Run `work()` on the scheduler's side worker (an ingest), never in the way of requests' retrieval; it
    counts as a waiting request (RAGCACHE_MAX_QUEUE) until it starts."""
    scheduler = request.app.state.scheduler
    return await TicketStream(lambda on_event: scheduler.submit(lambda _t: work(), on_event)).result(request)
