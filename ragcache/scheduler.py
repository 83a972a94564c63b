"""The one thread that owns the model: a bounded queue of work, run one item at a time.

    ticket = scheduler.submit(lambda t: generation.generate(ask, on_text=lambda d: t.emit("text", d),
                                                            cancelled=t.cancelled.is_set), on_event)

`on_event(kind, payload)` is called from the model thread: "text" deltas while the work streams,
then exactly one of "done" (the result), "error" (the exception) or "cancelled". A ticket
cancelled while it waits never runs; one cancelled while it runs stops at its next token. Past
`max_queue` waiting tickets, `submit` raises Busy with a Retry-After estimate. Before each item
the thread takes its share of the cores: all of them, less what running precompute jobs use.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Any, Callable

import torch

from .errors import Busy, UserError

log = logging.getLogger("ragcache.scheduler")


class Ticket:
    def __init__(self, work: Callable[["Ticket"], Any], on_event: Callable[[str, Any], None]):
        self.work, self.on_event = work, on_event
        self.cancelled = threading.Event()

    def emit(self, kind: str, payload: Any) -> None:
        self.on_event(kind, payload)

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, service, max_queue: int):
        self.service, self.max_queue = service, max_queue
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._waiting = 0
        self._running = 0
        self._lock = threading.Lock()
        self._seconds_per_item = 1.0  # moving average, for Retry-After
        self._threads = 0
        self._current: Ticket | None = None
        self._thread = threading.Thread(target=self._loop, name="ragcache-model", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def submit(self, work: Callable[[Ticket], Any], on_event: Callable[[str, Any], None]) -> Ticket:
        ticket = Ticket(work, on_event)
        with self._lock:
            if self._waiting >= self.max_queue:
                wait = math.ceil(self._seconds_per_item * (self._waiting + self._running))
                raise Busy(f"{self._waiting} requests are waiting (RAGCACHE_MAX_QUEUE={self.max_queue}); "
                           f"retry in {wait} s", retry_after=max(1, wait))
            self._waiting += 1
        self._queue.put(ticket)
        return ticket

    def _loop(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running += 1
                self._current = ticket
            try:
                self._run(ticket)
            except Exception:  # noqa: BLE001 — the thread outlives anything one item does, emits included
                log.exception("the model thread caught an error outside any request")
            finally:
                with self._lock:
                    self._running -= 1
                    self._current = None

    def _run(self, ticket: Ticket) -> None:
        if ticket.cancelled.is_set():
            ticket.emit("cancelled", None)
            return
        t0 = time.perf_counter()
        try:
            self._share_cores()
            result = ticket.work(ticket)
        except UserError as e:
            ticket.emit("error", e)
        except Exception as e:  # noqa: BLE001 — one request's bug is its own
            log.exception("request failed")
            ticket.emit("error", e)
        else:
            ticket.emit("done", result)
        self._seconds_per_item = 0.8 * self._seconds_per_item + 0.2 * (time.perf_counter() - t0)

    def _share_cores(self) -> None:
        n = self.service.settings.thread_count(self.service.jobs.running())
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    def close(self) -> None:
        """Cancel what runs and what waits (each gets its "cancelled" or ends at its next token), then stop."""
        with self._lock:
            if self._current is not None:
                self._current.cancel()
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                break
            if ticket is not None:
                with self._lock:
                    self._waiting -= 1
                ticket.emit("cancelled", None)
        self._queue.put(None)
        self._thread.join(timeout=60)
