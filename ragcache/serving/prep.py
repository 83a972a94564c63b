"""The scheduler's prep thread: what is not model work, so that it overlaps decoding; tenants in turn
(`fair.Inbox`), each tenant's requests in arrival order, so that one tenant's flood is prepared after the
others' next request, not before it.

    prep = PrepThread(service, cond, hand_over, leave_line, side)  # the Scheduler owns one, and shares its lock
    prep.put(ticket)    # a request: tokenize, retrieve (FAISS), load chunk KV

A request whose custom system prompt's KV is not cached goes to the side worker first (`side.SideWorker`:
that prefill is seconds of model work on a CPU) and comes back here once it is done. A request that is
prepared goes to `hand_over(ticket, prepared)` (the model thread's line); one that fails or is cancelled
first calls `leave_line(ticket.tenant)`. Both are called holding `cond`, the lock that also guards the
model thread's lines.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from blend.cores import one_core

from ..errors import UserError
from .fair import Inbox
from .sequence import Prepared
from .side import SideWorker
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class PrepThread:
    def __init__(self, service, cond: threading.Condition, hand_over: Callable[[Ticket, Prepared], None],
                 leave_line: Callable[[str | None], None], side: SideWorker):
        self.service, self._cond, self._side = service, cond, side
        self._hand_over, self._leave_line = hand_over, leave_line
        self._inbox = Inbox()  # tickets per tenant
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ragcache-prep", daemon=True)
        self._thread.start()

    def put(self, ticket: Ticket) -> None:
        self._inbox.put(ticket.tenant, ticket)

    def stop(self) -> None:
        """Tickets taken from now on are cancelled, not prepared."""
        self._stop = True

    def close(self) -> None:
        """Cancel every ticket still in the inbox (each gets its "cancelled"), then end the thread."""
        for ticket in self._inbox.close():
            ticket.emit("cancelled", None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        one_core()
        while (ticket := self._inbox.get()) is not None:
            if ticket.cancelled.is_set() or self._stop:
                self._fail(ticket, None)
            else:
                self._prepare(ticket)

    def _fail(self, ticket: Ticket, error: Exception | None) -> None:
        """It leaves the line and hears why (None: it was cancelled)."""
        with self._cond:
            self._leave_line(ticket.tenant)
        if error is None:
            ticket.emit("cancelled", None)
        else:
            ticket.emit("error", error)

    def _prepare(self, ticket: Ticket) -> None:
        gen = self.service.generation
        try:
            if ticket.prefix is None and gen.needs_prefix(ticket.ask):
                self._side.put(Ticket(lambda kind, payload: self._prefixed(ticket, kind, payload),
                                      work=lambda _t: gen.make_prefix(ticket.ask), ask=ticket.ask), counted=False)
                return
            prepared = gen.prepare(ticket.ask, start=ticket.submitted, prefix=ticket.prefix)
        except Exception as e:  # noqa: BLE001 — a UserError names bad input; anything else is this request's
            if not isinstance(e, UserError):
                log.exception("request failed before its model work")
            self._fail(ticket, e)
            return
        with self._cond:
            self._hand_over(ticket, prepared)

    def _prefixed(self, ticket: Ticket, kind: str, payload) -> None:
        """From the side worker: the request's prompt head is computed (back in line here), or it failed."""
        if kind == "done":
            ticket.prefix = payload
            self.put(ticket)
        else:
            self._fail(ticket, payload if kind == "error" else None)
