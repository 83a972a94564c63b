"""Who runs next: the queue limit at the door, then the KV budget at admission, first come first served.

    admission.enter()                  # a submit: Busy past RAGCACHE_MAX_QUEUE waiting requests
    admission.ready(ticket, prep)      # retrieved and loaded (from the prep thread): in line for the budget
    admission.admit()                  # the head of the line while its KV fits RAGCACHE_KV_BUDGET_BYTES
    admission.take_prefill(cap, L)     # admitted prompts whose recomputed rows fit one step's cap
    admission.release(prep)            # a finished, failed or cancelled request gives its budget back

The scheduler owns the lock: every method but `release` is called holding it. This is the room where
fairness between tenants and the serving KV's precision would weigh in.
"""
from __future__ import annotations

import math
import time
from collections import deque

from ..errors import Busy
from .sequence import Prepared
from .tally import ServingStats
from .ticket import Ticket


class Admission:
    def __init__(self, max_queue: int, kv_budget: int, stats: ServingStats):
        self.max_queue, self.kv_budget, self.stats = max_queue, kv_budget, stats
        self.ready_line: deque[tuple[Ticket, Prepared]] = deque()  # retrieved and loaded, waiting for budget
        self.admitted: deque[tuple[Ticket, Prepared]] = deque()  # budget reserved, waiting for their prefill
        self.waiting = 0  # submitted, not yet admitted (nor failed, cancelled, or started as a work item)
        self.kv_in_use = 0
        self.seconds_per_item = 1.0  # moving average of a request's time, for Retry-After

    @property
    def has_work(self) -> bool:
        return bool(self.ready_line or self.admitted)

    def enter(self, running: int) -> None:
        """One more waiting request, or Busy with a Retry-After estimate when the line is full."""
        if self.waiting >= self.max_queue:
            wait = math.ceil(self.seconds_per_item * (1 + self.waiting / max(1, running)))
            raise Busy(f"{self.waiting} requests are waiting (RAGCACHE_MAX_QUEUE={self.max_queue}); "
                       f"retry in {wait} s", retry_after=max(1, wait))
        self.waiting += 1

    def leave(self) -> None:
        """A waiting request failed or was cancelled before it was ready, or a work item started."""
        self.waiting -= 1

    def ready(self, ticket: Ticket, prep: Prepared) -> None:
        self.ready_line.append((ticket, prep))

    def drop_cancelled(self) -> None:
        """Cancelled tickets leave both lines (giving back what they reserved) and hear so."""
        for line, reserved in ((self.ready_line, False), (self.admitted, True)):
            for item in [x for x in line if x[0].cancelled.is_set()]:
                line.remove(item)
                if reserved:
                    self.kv_in_use -= item[1].kv_bytes
                else:
                    self.waiting -= 1
                item[0].emit("cancelled", None)

    def admit(self) -> None:
        """First come, first served: the head waits until its KV fits (no later request passes it)."""
        now = time.perf_counter()
        while self.ready_line and self.kv_in_use + self.ready_line[0][1].kv_bytes <= self.kv_budget:
            ticket, prep = self.ready_line.popleft()
            self.waiting -= 1
            self.kv_in_use += prep.kv_bytes
            self.stats.kv_peak = max(self.stats.kv_peak, self.kv_in_use)
            self.stats.queue_wait.observe(now - ticket.submitted)
            self.admitted.append((ticket, prep))

    def take_prefill(self, cap: int, num_layers: int):
        """(admitted prompts whose recomputed rows fit `cap` together, whether the one alone is too long for a
        step, [(ticket, prep, exception)] of those whose plan raised: they left the line, their budget still
        reserved); a too-long one is always taken alone, to be recomputed across steps."""
        rows, batch, failed = 0, [], []
        while self.admitted:
            try:
                n = self.admitted[0][1].plan(num_layers).recompute_rows
            except Exception as e:  # noqa: BLE001 — that request's own failure, for the scheduler to report
                failed.append((*self.admitted.popleft(), e))
                continue
            if batch and rows + n > cap:
                break
            batch.append(self.admitted.popleft())
            if n > cap:  # too long for one step: in pieces, alone
                return batch, True, failed
            rows += n
        return batch, False, failed

    def release(self, prep: Prepared) -> None:
        self.kv_in_use -= prep.kv_bytes

    def finished(self, seconds: float) -> None:
        """A request answered in `seconds`, submit to done: what Retry-After estimates from."""
        self.seconds_per_item = 0.8 * self.seconds_per_item + 0.2 * seconds

    def clear(self) -> list[Ticket]:
        """Every ticket in either line, which leave them (the scheduler is closing)."""
        tickets = [t for t, _ in [*self.ready_line, *self.admitted]]
        self.ready_line.clear(), self.admitted.clear()
        return tickets
