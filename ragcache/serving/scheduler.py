"""The serving loop: continuous batching of many requests on the one thread that owns the model.

    ticket = scheduler.submit_generation(ask, on_event)      # a request, batched with the others
    ticket = scheduler.submit(lambda t: work(), on_event)    # other work off the event loop (ingest, warm)

Two threads. The prep thread (`prep.PrepThread`) does what is not model work, in arrival order:
tokenizing, retrieval (FAISS) and loading chunk KV from the store tiers, so that they overlap
decoding; it also runs `submit`'s work items. The model thread, this module, loops over `step()`:

    admit   prepared requests while their KV fits RAGCACHE_KV_BUDGET_BYTES (`admission.Admission`)
    prefill the admitted ones whose recomputed rows fit RAGCACHE_MAX_STEP_ROWS (one at least), batched;
            a longer one runs across steps, that many rows x layers a step (`piecewise.Piecewise`)
    pick    the next token of every running sequence, streaming its text
    release the finished or cancelled ones: their cache and budget go back at once, they answer
    decode  one forward of every sequence still running, batched

`on_event(kind, payload)` gets "text" deltas as tokens decode, then exactly one of "done" (the
result), "error" (the exception) or "cancelled". A ticket cancelled while it waits never runs;
one cancelled while it decodes leaves the batch at the next step. Past `max_queue` waiting
tickets, submitting raises Busy with a Retry-After estimate.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from blend.batch import decode_batch, fuse_batch

from .admission import Admission
from .piecewise import Piecewise
from .prep import PrepThread
from .sequence import Prepared, Sequence
from .tally import ServingStats
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class Scheduler:
    def __init__(self, service, max_queue: int):
        self.service = service
        self.stats = ServingStats()
        self.admission = Admission(max_queue, service.settings.kv_budget_bytes, self.stats)
        self._cond = threading.Condition()  # guards `admission`; `_running` and `_piecewise` are the model thread's
        self._running: list[tuple[Ticket, Sequence]] = []
        self._piecewise: Piecewise | None = None  # a long prompt recomputed across steps
        self._stop = False
        self._threads = 0
        self._prep_thread = PrepThread(service, self._cond, self._hand_over, self.admission.leave)  # shares the lock
        self._model_thread = threading.Thread(target=self._model_loop, name="ragcache-model", daemon=True)
        self._model_thread.start()

    # ---- what /metrics and Retry-After read ---------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def running(self) -> int:
        return (len(self.admission.admitted) + len(self._running) + self._prep_thread.busy
                + (self._piecewise is not None))

    @property
    def kv_budget(self) -> int:
        return self.admission.kv_budget

    @property
    def kv_in_use(self) -> int:
        return self.admission.kv_in_use

    # ---- submitting ---------------------------------------------------------------------------

    def submit(self, work: Callable[[Ticket], Any], on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, work=work))

    def submit_generation(self, ask, on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, ask=ask))

    def _enqueue(self, ticket: Ticket) -> Ticket:
        with self._cond:
            self.admission.enter(self.running)
        self._prep_thread.put(ticket)
        return ticket

    def _hand_over(self, ticket: Ticket, prep: Prepared) -> None:
        """From the prep thread, holding `_cond`: a request retrieved and loaded."""
        self.admission.ready(ticket, prep)
        self._cond.notify()

    # ---- the model thread -----------------------------------------------------------------------

    def _model_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not (self.admission.has_work or self._running or self._piecewise):
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 — the thread outlives anything one step does, emits included
                log.exception("the model thread caught an error outside any request")

    def step(self) -> None:
        """One turn of the serving loop."""
        batch = self._admit()
        self._share_cores()
        self._prefill(batch)
        done = self._pick()
        self._release(done)
        self._decode()

    def _admit(self) -> list[tuple[Ticket, Prepared]]:
        """Admit what fits the KV budget; take this step's prefill batch (none while a long one runs)."""
        with self._cond:
            self.admission.drop_cancelled()
            self.admission.admit()
            if self._piecewise is not None:
                return []
            batch, too_long = self.admission.take_prefill(self.service.settings.max_step_rows,
                                                          self.service.runner.num_layers)
            if too_long:
                self._piecewise = Piecewise(*batch[0])
                return []
            return batch

    def _prefill(self, batch: list[tuple[Ticket, Prepared]]) -> None:
        """The batch's selective recomputes together, or the next piece of a long one: new running sequences."""
        if self._piecewise is not None:
            self._prefill_piece()
            return
        if not batch:
            return
        runner, now = self.service.runner, time.perf_counter()
        for _, prep in batch:
            prep.times["admitted"] = now
        try:
            fused = fuse_batch(runner, [prep.fuse_args() for _, prep in batch])
        except Exception as e:  # noqa: BLE001 — these requests fail; the others run on
            log.exception("a batched prefill failed")
            for ticket, prep in batch:
                self._give_back(prep.kv_bytes, None)
                ticket.emit("error", e)
            return
        self.stats.prefill_batch.observe(len(batch))
        for (ticket, prep), f in zip(batch, fused):
            self._start(ticket, prep, f)

    def _prefill_piece(self) -> None:
        piece = self._piecewise
        try:
            if piece.ticket.cancelled.is_set():
                self._piecewise = None
                self._give_back(piece.prep.kv_bytes, piece.cache)
                piece.ticket.emit("cancelled", None)
                return
            fused = piece.step(self.service.runner, self.service.settings.max_step_rows)
        except Exception as e:  # noqa: BLE001 — this request fails; the others run on
            log.exception("a piecewise prefill failed")
            self._piecewise = None
            self._give_back(piece.prep.kv_bytes, piece.cache)
            piece.ticket.emit("error", e)
            return
        if fused is None:
            return
        self._piecewise = None
        self.stats.prefill_batch.observe(1)
        self._start(piece.ticket, piece.prep, fused)

    def _start(self, ticket: Ticket, prep: Prepared, fused) -> None:
        fused.cache = self.service.runner.compact(fused.cache, self.service.kv_cache_dtype)  # RAGCACHE_KV_CACHE_DTYPE
        self._running.append((ticket, Sequence(prep, fused, self.service.tokenizer,
                                               lambda delta: ticket.emit("text", delta))))

    def _pick(self) -> list[tuple[Ticket, Sequence]]:
        """Every running sequence picks its next token (streaming its text); the finished and cancelled leave."""
        live, done = [], []
        for ticket, seq in self._running:
            if ticket.cancelled.is_set():
                seq.cancel()
            else:
                seq.advance()
            (done if seq.finish_reason else live).append((ticket, seq))
        self._running = live
        return done

    def _release(self, done: list[tuple[Ticket, Sequence]]) -> None:
        """Each finished sequence gives back its cache and budget, then answers (or hears it was cancelled)."""
        for ticket, seq in done:
            self._give_back(seq.prep.kv_bytes, seq.cache)
            if seq.finish_reason == "cancelled":
                ticket.emit("cancelled", None)
                continue
            try:
                result = seq.result(self.service.generation.totals.tokens)
            except Exception as e:  # noqa: BLE001
                log.exception("a finished request failed to report")
                ticket.emit("error", e)
                continue
            self.admission.finished(time.perf_counter() - ticket.submitted)
            ticket.emit("done", result)

    def _decode(self) -> None:
        """One forward of every running sequence's picked token, batched: their next logits."""
        if not self._running:
            return
        live = self._running
        self.stats.decode_batch.observe(len(live))
        try:
            logits = decode_batch(self.service.runner, [seq.cache for _, seq in live],
                                  [seq.token for _, seq in live])  # (B, V)
        except Exception as e:  # noqa: BLE001 — the batch fails together, the thread lives on
            log.exception("a decode step failed")
            for ticket, seq in live:
                self._give_back(seq.prep.kv_bytes, seq.cache)
                ticket.emit("error", e)
            self._running = []
            return
        for i, (_, seq) in enumerate(live):
            seq.logits = logits[i]

    def _give_back(self, kv_bytes: int, cache) -> None:
        if cache is not None:
            self.service.runner.release(cache)
        with self._cond:
            self.admission.release(kv_bytes)
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
        piecewise = [self._piecewise.ticket] if self._piecewise is not None else []
        for ticket in [*self.admission.clear(), *(t for t, _ in self._running), *piecewise]:
            ticket.emit("cancelled", None)
        self._running.clear()
        self._prep_thread.close()
