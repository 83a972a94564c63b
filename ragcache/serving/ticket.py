"""One submitted item as the scheduler's two threads pass it along: a request (`ask`) or a work item (`work`).

Its events (`on_event(kind, payload)`) are the scheduler's: see its docstring. `cancel()` may come from
any thread; the thread holding the ticket sees it at its next step.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("ragcache.scheduler")


class Ticket:
    def __init__(self, on_event: Callable[[str, Any], None], work: Callable[["Ticket"], Any] | None = None,
                 ask=None):
        self.on_event, self.work, self.ask = on_event, work, ask
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.prefix = None  # a request's custom prompt head KV, once the side worker computed it

    @property
    def tenant(self) -> str | None:
        """Whose share a request counts against (None: a work item)."""
        return self.ask.who if self.ask is not None else None

    def emit(self, kind: str, payload: Any) -> None:
        """Tell the listener; one that raises (a closed event loop) is its own trouble, never the caller's:
        the scheduler goes on releasing and answering the others."""
        try:
            self.on_event(kind, payload)
        except Exception:  # noqa: BLE001
            log.exception("a ticket's listener failed on %r", kind)

    def cancel(self) -> None:
        self.cancelled.set()
