"""Who runs next: the queue limits at the door, then the KV budget at admission, tenants in turn.

    admission.enter(running, tenant)   # a submit: Busy past RAGCACHE_MAX_QUEUE waiting requests, or past
                                       # the tenant's RAGCACHE_TENANT_MAX_QUEUE
    admission.ready(ticket, prep)      # retrieved and loaded (from the prep thread): in its tenant's line
    admission.admit()                  # tenants' heads in turn, while their KV fits the budget and their share
    admission.take_prefill(L)          # admitted prompts, tenants in turn, whose recomputed rows fit this step
    admission.release(prep)            # a finished, failed or cancelled request gives its budget back

A tenant is an API key (the namespace, without keys; `Ask.who`). Its share of what runs at once:
RAGCACHE_TENANT_MAX_RUNNING requests and RAGCACHE_TENANT_MAX_TOKENS tokens of KV (prompt + max_tokens).
The shares are work-conserving: a tenant past its share waits only while another tenant has a request
ready, so one tenant alone may use the whole budget; one request alone always runs. The tenant whose
turn it is and that is within its share waits for the budget: nobody passes it, so nobody starves.
The waiting-room share (RAGCACHE_TENANT_MAX_QUEUE) holds even for a tenant alone, or a flood that came
first would fill the room before anyone else arrives; without keys (one trusted user) it is the whole room.

A step's recomputed rows are RAGCACHE_MAX_STEP_ROWS while one tenant is active, RAGCACHE_SHARED_STEP_ROWS
while more are (`step_rows`; active: a request in flight, or one that ended in the last SHARED_WINDOW_S).
A step cannot be interrupted, so a request that arrives waits for the one under way: while tenants share
the model a step stays short, and one tenant's long prefills (run across steps) delay another's first
token by about one short step. The window keeps steps short between one tenant's requests, when it has
none in flight for a moment and a long step would start just before its next one arrives.

Cached custom prompt heads (`prefixes.PrefixCache`) hold part of the budget too, and give way to a request.

The scheduler owns the lock: every method is called holding it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..errors import Busy
from .fair import RoundRobin
from .sequence import Prepared
from .tally import ServingStats
from .ticket import Ticket


SHARED_WINDOW_S = 10.0  # a tenant whose last request ended this recently still shares the model


@dataclass
class Share:
    """One tenant's requests in flight."""

    waiting: int = 0  # submitted, not yet admitted
    running: int = 0  # admitted: budget reserved, prefilling or decoding
    kv_bytes: int = 0  # the budget its running requests reserve
    tokens: int = 0  # their KV rows

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)


@dataclass(frozen=True)
class Limits:
    max_queue: int  # waiting requests, every tenant together
    kv_budget: int  # bytes of KV reserved by running requests, together
    tenant_queue: int  # one tenant's waiting requests
    tenant_running: int  # one tenant's running requests
    tenant_tokens: int  # one tenant's KV rows running at once; 0: half the budget (in bytes)
    step_rows: int  # recomputed rows a step takes, one tenant in flight
    shared_step_rows: int  # the same, more than one

    @classmethod
    def of(cls, settings, max_queue: int) -> "Limits":
        """From the settings; a tenant limit of 0 is derived from the global ones (the queue's from whether
        there are keys, hence tenants to keep apart)."""
        s = settings
        queue = max(1, max_queue // 2) if s.api_keys else max_queue
        return cls(max_queue, s.kv_budget_bytes, s.tenant_max_queue or queue,
                   s.tenant_max_running or max(1, max_queue // 4), s.tenant_max_tokens, s.max_step_rows,
                   s.shared_step_rows)


class Admission:
    def __init__(self, limits: Limits, stats: ServingStats, prefixes):
        self.limits, self.kv_budget, self.stats = limits, limits.kv_budget, stats
        self.prefixes = prefixes  # prefixes.PrefixCache: custom prompt heads' KV, inside the budget
        self.ready_lines = RoundRobin()  # (ticket, prep) per tenant: retrieved and loaded, waiting for budget
        self.admitted = RoundRobin()  # (ticket, prep) per tenant: budget reserved, waiting for their prefill
        self.shares: dict[str | None, Share] = {}  # tenant → its requests in flight (None: work items)
        self.waiting = 0  # submitted, not yet admitted (nor failed, cancelled, or started as a work item)
        self.kv_in_use = 0
        self.last_active: dict[str | None, float] = {}  # tenant → when its last request ended (recent ones only)
        self.seconds_per_item = 1.0  # moving average of a request's time, for Retry-After

    @property
    def has_work(self) -> bool:
        return bool(self.ready_lines or self.admitted)

    def enter(self, running: int, tenant: str | None) -> None:
        """One more waiting request, or Busy with a Retry-After estimate when the line (or the tenant's) is full."""
        lim, share = self.limits, self.shares.get(tenant) or Share()
        if self.waiting >= lim.max_queue:
            self._busy(f"{self.waiting} requests are waiting (RAGCACHE_MAX_QUEUE={lim.max_queue})", self.waiting,
                       running)
        if tenant is not None and share.waiting >= lim.tenant_queue:
            self._busy(f"this tenant has {share.waiting} requests waiting (RAGCACHE_TENANT_MAX_QUEUE="
                       f"{lim.tenant_queue})", share.waiting, share.running)
        self.shares[tenant] = share
        share.waiting += 1
        self.waiting += 1

    def _busy(self, why: str, waiting: int, running: int):
        wait = math.ceil(self.seconds_per_item * (1 + waiting / max(1, running)))
        raise Busy(f"{why}; retry in {wait} s", retry_after=max(1, wait))

    def leave(self, tenant: str | None) -> None:
        """A waiting request failed or was cancelled before it was ready, or a work item started."""
        self.waiting -= 1
        self._share(tenant).waiting -= 1
        self._forget(tenant)

    def ready(self, ticket: Ticket, prep: Prepared) -> None:
        self.ready_lines.put(ticket.tenant, (ticket, prep))

    def drop_cancelled(self) -> None:
        """Cancelled tickets leave both lines (giving back what they reserved) and hear so."""
        for ticket, prep in self.ready_lines.remove_if(lambda x: x[0].cancelled.is_set()):
            self.leave(ticket.tenant)
            ticket.emit("cancelled", None)
        for ticket, prep in self.admitted.remove_if(lambda x: x[0].cancelled.is_set()):
            self.release(prep)
            ticket.emit("cancelled", None)

    def admit(self) -> None:
        """Tenants in turn: the head of each line within its tenant's share, while it fits the budget."""
        now, admitted = time.perf_counter(), True
        while admitted:
            admitted = False
            heads = self.ready_lines.heads()
            for tenant, (ticket, prep) in heads:
                if len(heads) > 1 and not self._within_share(self._share(tenant), prep):
                    continue  # its own requests hold its share and another tenant is ready: it passes
                room = self.kv_budget - self.kv_in_use - prep.kv_bytes
                if room < 0:
                    return  # its turn: it waits for the budget
                self.prefixes.shrink(room)  # cached prompt heads give way to a request
                self.ready_lines.take(tenant)
                self._reserve(ticket, prep, now)
                admitted = True

    def _within_share(self, share: Share, prep: Prepared) -> bool:
        lim = self.limits
        if share.running == 0:
            return True  # one alone always runs (it fits the whole budget: checked before it waited)
        if share.running >= lim.tenant_running:
            return False
        if lim.tenant_tokens:
            return share.tokens + prep.kv_rows <= lim.tenant_tokens
        return share.kv_bytes + prep.kv_bytes <= self.kv_budget // 2

    def _reserve(self, ticket: Ticket, prep: Prepared, now: float) -> None:
        share = self._share(ticket.tenant)
        share.waiting -= 1
        share.running += 1
        share.kv_bytes += prep.kv_bytes
        share.tokens += prep.kv_rows
        self.waiting -= 1
        self.kv_in_use += prep.kv_bytes
        self.stats.kv_peak = max(self.stats.kv_peak, self.kv_in_use)
        self.stats.queue_wait.observe(now - ticket.submitted)
        self.admitted.put(ticket.tenant, (ticket, prep))

    @property
    def step_rows(self) -> int:
        """This step's cap on recomputed rows: short while more than one tenant has requests in flight."""
        now = time.monotonic()
        for t in [t for t, at in self.last_active.items() if now - at > SHARED_WINDOW_S]:
            del self.last_active[t]
        tenants = len({t for t, share in self.shares.items() if share.running} | set(self.last_active))
        return self.limits.shared_step_rows if tenants > 1 else self.limits.step_rows

    def take_prefill(self, num_layers: int, long_ok: bool = True, most: int | None = None):
        """(admitted prompts, tenants in turn, whose recomputed rows fit `step_rows` together, `most` of them at
        most; whether the one taken is too long for a step; [(ticket, prep, exception)] of those whose plan raised:
        they left the line, their budget still reserved). A too-long one is taken alone, to be recomputed across
        steps, when `long_ok` and nothing else was taken first; else it waits, and shorter ones pass it."""
        cap, rows, batch, failed = self.step_rows, 0, [], []
        took = True
        while took:
            took = False
            for tenant, (_ticket, prep) in self.admitted.heads():
                if len(batch) == most:
                    break
                try:
                    n = prep.plan(num_layers).recompute_rows
                except Exception as e:  # noqa: BLE001 — that request's own failure, for the scheduler to report
                    failed.append((*self.admitted.take(tenant), e))
                    took = True
                    continue
                if rows + n <= cap:
                    batch.append(self.admitted.take(tenant))
                    rows, took = rows + n, True
                elif n > cap and long_ok and not batch:  # too long for one step: in pieces, alone
                    return [self.admitted.take(tenant)], True, failed
        return batch, False, failed

    def release(self, prep: Prepared) -> None:
        tenant = prep.ask.who
        share = self._share(tenant)
        share.running -= 1
        share.kv_bytes -= prep.kv_bytes
        share.tokens -= prep.kv_rows
        self.kv_in_use -= prep.kv_bytes
        self.last_active[tenant] = time.monotonic()
        self._forget(tenant)

    def _share(self, tenant: str | None) -> Share:
        return self.shares.setdefault(tenant, Share())

    def _forget(self, tenant: str | None) -> None:
        """A tenant with nothing in flight leaves the table (namespaces are many; the table stays small)."""
        if tenant in self.shares and self.shares[tenant].idle:
            del self.shares[tenant]

    def finished(self, seconds: float) -> None:
        """A request answered in `seconds`, submit to done: what Retry-After estimates from."""
        self.seconds_per_item = 0.8 * self.seconds_per_item + 0.2 * seconds

    def drain(self) -> list[Ticket]:
        """Every ticket in either line, which leave them giving back what they held (a step failed outside any
        request, or the scheduler is closing)."""
        ready, admitted = self.ready_lines.remove_if(lambda _x: True), self.admitted.remove_if(lambda _x: True)
        for ticket, _prep in ready:
            self.leave(ticket.tenant)
        for _ticket, prep in admitted:
            self.release(prep)
        return [t for t, _ in [*ready, *admitted]]
