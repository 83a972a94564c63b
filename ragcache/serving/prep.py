"""The scheduler's prep thread: what is not model work, in arrival order, so that it overlaps decoding.

    prep = PrepThread(service, cond, hand_over, leave_line)  # the Scheduler owns one, and shares its lock
    prep.put(ticket)    # a request: tokenize, retrieve (FAISS), load chunk KV; a work item (ingest, warm): run it

A request that is prepared goes to `hand_over(ticket, prepared)` (the model thread's line); one that
fails or is cancelled first, and every work item as it starts, calls `leave_line()`. Both are called
holding `cond`, the lock that also guards the model thread's lines.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from ..errors import UserError
from .sequence import Prepared
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class PrepThread:
    def __init__(self, service, cond: threading.Condition,
                 hand_over: Callable[[Ticket, Prepared], None], leave_line: Callable[[], None]):
        self.service, self._cond = service, cond
        self._hand_over, self._leave_line = hand_over, leave_line
        self._inbox: queue.Queue[Ticket | None] = queue.Queue()
        self.busy = 0  # work items running now (under `cond`)
        self._current: Ticket | None = None  # the work item running now, for `stop` to cancel
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ragcache-prep", daemon=True)
        self._thread.start()

    def put(self, ticket: Ticket) -> None:
        self._inbox.put(ticket)

    def stop(self) -> None:
        """Cancel the running work item; tickets taken from now on are cancelled, not run."""
        with self._cond:
            if self._current is not None:
                self._current.cancel()
            self._stop = True

    def close(self) -> None:
        """Cancel every ticket still in the inbox (each gets its "cancelled"), then end the thread."""
        while True:
            try:
                ticket = self._inbox.get_nowait()
            except queue.Empty:
                break
            if ticket is not None:
                ticket.emit("cancelled", None)
        self._inbox.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while (ticket := self._inbox.get()) is not None:
            if ticket.cancelled.is_set() or self._stop:
                with self._cond:
                    self._leave_line()
                ticket.emit("cancelled", None)
            elif ticket.work is not None:
                self._run_work(ticket)
            else:
                self._prepare(ticket)

    def _run_work(self, ticket: Ticket) -> None:
        with self._cond:
            self._leave_line()
            self.busy += 1
            self._current = ticket
        try:
            result = ticket.work(ticket)
        except UserError as e:
            ticket.emit("error", e)
        except Exception as e:  # noqa: BLE001 — one item's bug is its own
            log.exception("work item failed")
            ticket.emit("error", e)
        else:
            ticket.emit("done", result)
        finally:
            with self._cond:
                self.busy -= 1
                self._current = None

    def _prepare(self, ticket: Ticket) -> None:
        try:
            prepared = self.service.generation.prepare(ticket.ask, start=ticket.submitted)
        except Exception as e:  # noqa: BLE001 — a UserError names bad input; anything else is this request's
            if not isinstance(e, UserError):
                log.exception("request failed before its model work")
            with self._cond:
                self._leave_line()
            ticket.emit("error", e)
            return
        with self._cond:
            self._hand_over(ticket, prepared)
