"""The serving loop: continuous batching of many requests on the one thread that owns the model.

    ticket = scheduler.submit_generation(ask, on_event)      # a request, batched with the others
    ticket = scheduler.submit(lambda t: work(), on_event)    # other work off the event loop (ingest, warm)

Two threads. The prep thread (`prep.PrepThread`) does what is not model work, in arrival order:
tokenizing, retrieval (FAISS) and loading chunk KV from the store tiers, so that they overlap
decoding; it also runs `submit`'s work items. The model thread, this module, loops over steps:

    admit   prepared requests, first come first served, while their KV fits RAGCACHE_KV_BUDGET_BYTES
    prefill the admitted ones whose recomputed rows fit RAGCACHE_MAX_STEP_ROWS (one at least), batched;
            a longer one whose rows are fixed (every policy but cacheblend, whose filter ranks them all
            at once) is recomputed in pieces of that many rows, one piece a step
    decode  one token of every running sequence, batched; finished or cancelled ones release their
            cache and budget at once

`on_event(kind, payload)` gets "text" deltas as tokens decode, then exactly one of "done" (the
result), "error" (the exception) or "cancelled". A ticket cancelled while it waits never runs;
one cancelled while it decodes leaves the batch at the next step. Past `max_queue` waiting
tickets, submitting raises Busy with a Retry-After estimate.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from blend.batch import decode_batch, fuse_batch

from .errors import Busy
from .piecewise import Piecewise
from .prep import PrepThread
from .sequence import Prepared, Sequence
from .tally import ServingStats
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class Scheduler:
    def __init__(self, service, max_queue: int):
        self.service, self.max_queue = service, max_queue
        self.kv_budget = service.settings.kv_budget_bytes
        self.stats = ServingStats()
        self._cond = threading.Condition()  # guards everything below but `_running` (the model thread's)
        self._ready: deque = deque()  # (ticket, Prepared): retrieved and loaded, waiting for KV budget
        self._admitted: deque = deque()  # (ticket, Prepared): budget reserved, waiting for their prefill
        self._running: list[tuple[Ticket, Sequence]] = []
        self._piecewise: Piecewise | None = None  # a long prompt recomputed a piece a step
        self._waiting = 0  # submitted, not yet admitted (nor failed, cancelled, or started as a work item)
        self._kv_in_use = 0
        self._stop = False
        self._threads = 0
        self._seconds_per_item = 1.0  # moving average of a request's time, for Retry-After
        self._prep_thread = PrepThread(service, self._cond, self._hand_over, self._leave_waiting)  # shares the lock
        self._model_thread = threading.Thread(target=self._model_loop, name="ragcache-model", daemon=True)
        self._model_thread.start()

    # ---- what /metrics and Retry-After read ---------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return len(self._admitted) + len(self._running) + self._prep_thread.busy + (self._piecewise is not None)

    @property
    def kv_in_use(self) -> int:
        return self._kv_in_use

    # ---- submitting ---------------------------------------------------------------------------

    def submit(self, work: Callable[[Ticket], Any], on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, work=work))

    def submit_generation(self, ask, on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, ask=ask))

    def _enqueue(self, ticket: Ticket) -> Ticket:
        with self._cond:
            if self._waiting >= self.max_queue:
                wait = math.ceil(self._seconds_per_item * (1 + self._waiting / max(1, self.running)))
                raise Busy(f"{self._waiting} requests are waiting (RAGCACHE_MAX_QUEUE={self.max_queue}); "
                           f"retry in {wait} s", retry_after=max(1, wait))
            self._waiting += 1
        self._prep_thread.put(ticket)
        return ticket

    # ---- from the prep thread (called holding `_cond`) ------------------------------------------

    def _hand_over(self, ticket: Ticket, prep: Prepared) -> None:
        self._ready.append((ticket, prep))
        self._cond.notify()

    def _leave_waiting(self) -> None:
        self._waiting -= 1

    # ---- the model thread -----------------------------------------------------------------------

    def _model_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not (self._ready or self._admitted or self._running or self._piecewise):
                    self._cond.wait()
                if self._stop:
                    return
                self._drop_cancelled()
                self._admit()
                batch = self._take_prefill()
            try:
                self._share_cores()
                if self._piecewise is not None:
                    self._prefill_piece()
                elif batch:
                    self._prefill(batch)
                self._decode_step()
            except Exception:  # noqa: BLE001 — the thread outlives anything one step does, emits included
                log.exception("the model thread caught an error outside any request")

    def _drop_cancelled(self) -> None:
        for line, reserved in ((self._ready, False), (self._admitted, True)):
            for item in [x for x in line if x[0].cancelled.is_set()]:
                line.remove(item)
                if reserved:
                    self._kv_in_use -= item[1].kv_bytes
                else:
                    self._waiting -= 1
                item[0].emit("cancelled", None)

    def _admit(self) -> None:
        """First come, first served: the head waits until its KV fits (no later request passes it)."""
        now = time.perf_counter()
        while self._ready and self._kv_in_use + self._ready[0][1].kv_bytes <= self.kv_budget:
            ticket, prep = self._ready.popleft()
            self._waiting -= 1
            self._kv_in_use += prep.kv_bytes
            self.stats.kv_peak = max(self.stats.kv_peak, self._kv_in_use)
            self.stats.queue_wait.observe(now - ticket.submitted)
            self._admitted.append((ticket, prep))

    def _take_prefill(self) -> list:
        cap, rows, batch = self.service.settings.max_step_rows, 0, []
        if self._piecewise is not None:
            return batch
        while self._admitted:
            plan = self._admitted[0][1].plan(self.service.runner.num_layers)
            n = plan.recompute_rows
            if batch and rows + n > cap:
                break
            if n > cap and not batch:  # too long for one step: in pieces
                self._piecewise = Piecewise(*self._admitted.popleft())
                break
            batch.append(self._admitted.popleft())
            rows += n
        return batch

    def _prefill(self, batch: list) -> None:
        runner, now = self.service.runner, time.perf_counter()
        for _, prep in batch:
            prep.times["admitted"] = now
        try:
            fused = fuse_batch(runner, [prep.fuse_args() for _, prep in batch])
        except Exception as e:  # noqa: BLE001 — these requests fail; the others run on
            log.exception("a batched prefill failed")
            for ticket, prep in batch:
                self._release(prep.kv_bytes, None)
                ticket.emit("error", e)
            return
        self.stats.prefill_batch.observe(len(batch))
        for (ticket, prep), f in zip(batch, fused):
            self._running.append((ticket, Sequence(prep, f, self.service.tokenizer,
                                                   lambda delta, t=ticket: t.emit("text", delta))))

    def _prefill_piece(self) -> None:
        piece = self._piecewise
        try:
            if piece.ticket.cancelled.is_set():
                self._piecewise = None
                self._release(piece.prep.kv_bytes, piece.cache)
                piece.ticket.emit("cancelled", None)
                return
            fused = piece.step(self.service.runner, self.service.settings.max_step_rows)
        except Exception as e:  # noqa: BLE001 — this request fails; the others run on
            log.exception("a piecewise prefill failed")
            self._piecewise = None
            self._release(piece.prep.kv_bytes, piece.cache)
            piece.ticket.emit("error", e)
            return
        if fused is None:
            return
        self._piecewise = None
        self.stats.prefill_batch.observe(1)
        self._running.append((piece.ticket, Sequence(piece.prep, fused, self.service.tokenizer,
                                                     lambda delta, t=piece.ticket: t.emit("text", delta))))

    def _decode_step(self) -> None:
        live, tokens = [], []
        for ticket, seq in self._running:
            if ticket.cancelled.is_set():
                seq.cancel()
                token = None
            else:
                token = seq.advance()
            if token is None:
                self._finish(ticket, seq)
            else:
                live.append((ticket, seq))
                tokens.append(token)
        self._running = live
        if not live:
            return
        self.stats.decode_batch.observe(len(live))
        try:
            logits = decode_batch(self.service.runner, [seq.cache for _, seq in live], tokens)  # (B, V)
        except Exception as e:  # noqa: BLE001 — the batch fails together, the thread lives on
            log.exception("a decode step failed")
            for ticket, seq in live:
                self._release(seq.prep.kv_bytes, seq.cache)
                ticket.emit("error", e)
            self._running = []
            return
        for i, (_, seq) in enumerate(live):
            seq.logits = logits[i]

    def _finish(self, ticket: Ticket, seq: Sequence) -> None:
        self._release(seq.prep.kv_bytes, seq.cache)
        if seq.finish_reason == "cancelled":
            ticket.emit("cancelled", None)
            return
        try:
            result = seq.result(self.service.generation.totals.tokens)
        except Exception as e:  # noqa: BLE001
            log.exception("a finished request failed to report")
            ticket.emit("error", e)
            return
        seconds = time.perf_counter() - ticket.submitted
        self._seconds_per_item = 0.8 * self._seconds_per_item + 0.2 * seconds
        ticket.emit("done", result)

    def _release(self, kv_bytes: int, cache) -> None:
        if cache is not None:
            self.service.runner.release(cache)
        with self._cond:
            self._kv_in_use -= kv_bytes
            self._cond.notify()

    def _share_cores(self) -> None:
        """Take every core, less what running precompute jobs use."""
        n = self.service.settings.thread_count(self.service.jobs.running())
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    # ---- shutting down --------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what runs and what waits (each gets its "cancelled", a work item sees its cancel), then stop."""
        self._prep_thread.stop()
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._model_thread.join(timeout=60)
        piecewise = [(self._piecewise.ticket, None)] if self._piecewise is not None else []
        for ticket, _ in [*self._ready, *self._admitted, *self._running, *piecewise]:
            ticket.emit("cancelled", None)
        self._ready.clear(), self._admitted.clear(), self._running.clear()
        self._prep_thread.close()
