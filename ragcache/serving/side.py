"""The scheduler's side worker: work that must not hold up the prep thread, which prepares every request.

    side = SideWorker(cond, leave_line)   # the Scheduler owns one, and shares its lock
    side.put(ticket)                      # a work item (an ingest, the warm-up): run it, tenants in turn
    side.put(ticket, counted=False)       # the scheduler's own (a custom system prompt's prefill)

An ingest tokenizing thousands of documents, or a long custom system prompt's prefill, waits here in
line with its kind while other tenants' requests are retrieved and loaded. It is bounded: a submitted
item counts as a waiting request (RAGCACHE_MAX_QUEUE) until it starts, calling `leave_line(tenant)`
holding `cond`; an uncounted one belongs to a request that is already counted.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from blend.cores import one_core

from ..errors import UserError
from .fair import Inbox
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class SideWorker:
    def __init__(self, cond: threading.Condition, leave_line: Callable[[str | None], None]):
        self._cond, self._leave_line = cond, leave_line
        self._inbox = Inbox()  # (ticket, counted) per tenant
        self.busy = 0  # counted items running now (under `cond`)
        self._current: Ticket | None = None  # the item running now, for `stop` to cancel
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ragcache-side", daemon=True)
        self._thread.start()

    def put(self, ticket: Ticket, counted: bool = True) -> None:
        self._inbox.put(ticket.tenant, (ticket, counted))

    def stop(self) -> None:
        """Cancel the running item; items taken from now on are cancelled, not run."""
        with self._cond:
            if self._current is not None:
                self._current.cancel()
            self._stop = True

    def close(self) -> None:
        """Cancel every item still waiting (each gets its "cancelled"), then end the thread."""
        for ticket, _ in self._inbox.close():
            ticket.emit("cancelled", None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        one_core()
        while (item := self._inbox.get()) is not None:
            ticket, counted = item
            with self._cond:
                if counted:
                    self._leave_line(ticket.tenant)
                    self.busy += 1
                self._current = ticket
            try:
                self._run(ticket)
            finally:
                with self._cond:
                    self.busy -= counted
                    self._current = None

    def _run(self, ticket: Ticket) -> None:
        if ticket.cancelled.is_set() or self._stop:
            ticket.emit("cancelled", None)
            return
        try:
            result = ticket.work(ticket)
        except UserError as e:
            ticket.emit("error", e)
        except Exception as e:  # noqa: BLE001 — one item's bug is its own
            log.exception("work item failed")
            ticket.emit("error", e)
        else:
            ticket.emit("done", result)
