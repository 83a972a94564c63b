"""The serving loop: continuous batching of many requests on the one thread that owns the model.

    ticket = scheduler.submit_generation(ask, on_event)      # a request, batched with the others
    ticket = scheduler.submit(lambda t: work(), on_event)    # other work off the event loop (ingest, warm)

The model thread, this module, loops over `step()` (the prep thread and the side worker: serving/__init__):

    admit   prepared requests while their KV fits RAGCACHE_KV_BUDGET_BYTES (`admission.Admission`)
    prefill the admitted ones whose recomputed rows fit the step (`Admission.step_rows`, one at least),
            batched, tenants in turn, `group_size` of them where their caches are compacted (the rest in the
            next steps); a longer one runs across steps, that many rows x layers a step
            (`piecewise.Piecewise`), its pieces taking turns with the others' batches
    pick, release, decode, repair: the running sequences' part (`decoding.Decoding`): each picks its next
            token, the finished answer, the rest decode in one batch, and those whose first token went out
            under `deferred` are fused again within the step's rows (a longer one in pieces, as a prompt)

`on_event(kind, payload)` gets "text" deltas as tokens decode, then exactly one of "done" (the
result), "error" (the exception) or "cancelled". A ticket cancelled while it waits never runs;
one cancelled while it decodes leaves the batch at the next step. Past `max_queue` waiting
tickets, submitting raises Busy with a Retry-After estimate.

A request's exception, at any stage (plan, prefill, piece, start, pick, result, decode), is that
request's "error" alone: its budget goes back once, the others run on. A batched prefill or decode
that raises is tried again one request at a time (`alone`). An exception outside any request fails
every request the thread holds, rather than leave them waiting on a loop that may fail again.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from blend.batch import fuse_batch
from blend.cores import claim_cores, hand_over_quickly

from .admission import Admission, Limits
from .alone import each_alone
from .decoding import Decoding
from .groups import group_size
from .piecewise import Piecewise
from .prep import PrepThread
from .repair import finish
from .side import SideWorker
from .sequence import Prepared, Sequence
from .tally import ServingStats
from .ticket import Ticket

log = logging.getLogger("ragcache.scheduler")


class Scheduler:
    def __init__(self, service, max_queue: int):
        self.service = service
        self.stats = ServingStats()
        self.admission = Admission(Limits.of(service.settings, max_queue), self.stats, service.generation.prefixes)
        self._cond = threading.Condition()  # guards `admission`; `_seqs` and `_piecewise` are the model thread's
        self._seqs = Decoding(service, self.stats, self.admission, self._fail, self._give_back)  # the running
        self._piecewise: Piecewise | None = None  # a long prompt (or repair) recomputed across steps
        self._piece_next = True  # whether the next step runs the piecewise prefill's piece, or offers a batch
        self._stop = False
        hand_over_quickly()  # the model thread's ops beside the other threads' Python (blend/cores.py)
        self._side = SideWorker(self._cond, self.admission.leave)  # both share the lock
        self._prep_thread = PrepThread(service, self._cond, self._hand_over, self.admission.leave, self._side)
        self._model_thread = threading.Thread(target=self._model_loop, name="ragcache-model", daemon=True)
        self._model_thread.start()

    # ---- what /metrics and Retry-After read ---------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def running(self) -> int:
        return len(self.admission.admitted) + len(self._seqs) + self._side.busy + (self._piecewise is not None)

    @property
    def kv_budget(self) -> int:
        return self.admission.kv_budget

    @property
    def kv_in_use(self) -> int:
        return self.admission.kv_in_use

    # ---- submitting ---------------------------------------------------------------------------

    def submit(self, work: Callable[[Ticket], Any], on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, work=work), self._side.put)

    def submit_generation(self, ask, on_event: Callable[[str, Any], None]) -> Ticket:
        return self._enqueue(Ticket(on_event, ask=ask), self._prep_thread.put)

    def _enqueue(self, ticket: Ticket, put: Callable[[Ticket], None]) -> Ticket:
        with self._cond:
            self.admission.enter(self.running, ticket.tenant)
        put(ticket)
        return ticket

    def _hand_over(self, ticket: Ticket, prep: Prepared) -> None:
        """From the prep thread, holding `_cond`: a request retrieved and loaded."""
        self.admission.ready(ticket, prep)
        self._cond.notify()

    # ---- the model thread -----------------------------------------------------------------------

    def _model_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not (self.admission.has_work or self._seqs or self._piecewise):
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 — the thread outlives anything one step does, emits included
                log.exception("the model thread caught an error outside any request")
                self._abandon(e)

    def step(self) -> None:
        """One turn of the serving loop."""
        self._share_cores()
        batch, cap = self._admit()
        self._prefill(batch, cap)
        self._seqs.release(self._seqs.pick())
        self._seqs.decode()
        piece = self._seqs.repair(cap, self._piecewise is None)
        if piece is not None:  # a repair longer than a step: in pieces, as a long prompt
            self._piecewise = piece

    def _admit(self) -> tuple[list[tuple[Ticket, Prepared]], int]:
        """Admit what fits the KV budget; take this step's prefill batch (none when a long one's piece runs),
        and the step's row cap."""
        with self._cond:
            self.admission.drop_cancelled()
            self.admission.admit()
            cap, long_one = self.admission.step_rows, self._piecewise is not None
            if long_one and self._piece_next:
                self._piece_next = False
                return [], cap
            runner = self.service.runner
            batch, too_long, failed = self.admission.take_prefill(runner.num_layers, not long_one,
                                                                  group_size(runner, self.service.kv_cache_dtype))
        for ticket, prep, e in failed:
            self._fail(ticket, prep, None, e, "planning a prefill")
        if too_long:
            self._piecewise, batch = Piecewise(*batch[0]), []
        self._piece_next = bool(batch)  # a piece runs in this step when no batch does; else in the next
        return batch, cap

    def _prefill(self, batch: list[tuple[Ticket, Prepared]], cap: int) -> None:
        """The batch's selective recomputes together, else the next `cap` rows x layers of a long one: new
        running sequences."""
        if not batch:
            if self._piecewise is not None:
                self._prefill_piece(cap)
            return
        now = time.perf_counter()
        for _, prep in batch:
            prep.times["admitted"] = now
        self._prefill_batch(batch)

    def _prefill_batch(self, batch: list[tuple[Ticket, Prepared]]) -> None:
        ran = each_alone(batch, lambda b: fuse_batch(self.service.runner, [prep.fuse_args() for _, prep in b]),
                         lambda item, e: self._fail(*item, None, e, "a prefill"))
        if ran:
            self.stats.prefill_batch.observe(len(ran))
        for (ticket, prep), fused in ran:
            self._start(ticket, prep, fused)

    def _prefill_piece(self, cap: int) -> None:
        piece = self._piecewise
        if piece.ticket.cancelled.is_set():
            self._piecewise = None
            self._give_back(piece.prep, piece.cache)
            piece.ticket.emit("cancelled", None)
            return
        try:
            fused = piece.step(self.service.runner, cap)
        except Exception as e:  # noqa: BLE001 — this request fails; the others run on
            self._piecewise = None
            self._fail(piece.ticket, piece.prep, piece.cache, e, "a piecewise prefill")
            return
        if fused is None:
            return
        self._piecewise = None
        if piece.seq is not None:  # a repair after the first token
            self._seqs.repaired(piece.ticket, piece.seq, finish(self.service.runner, self.service.kv_cache_dtype,
                                                                piece.seq, fused))
            return
        self.stats.prefill_batch.observe(1)
        self._start(piece.ticket, piece.prep, fused)

    def _start(self, ticket: Ticket, prep: Prepared, fused) -> None:
        try:
            fused.cache = self.service.runner.compact(fused.cache, self.service.kv_cache_dtype)  # RAGCACHE_KV_CACHE_DTYPE
            seq = Sequence(prep, fused, self.service.tokenizer, lambda delta: ticket.emit("text", delta))
        except Exception as e:  # noqa: BLE001
            self._fail(ticket, prep, fused.cache, e, "starting a sequence")
            return
        self._seqs.running.append((ticket, seq))

    def _abandon(self, error: Exception) -> None:
        """A step failed outside any request: every request this thread holds fails with that error (each hears
        it, its cache and budget go back), so that none waits on a loop that may fail the same way at every step,
        and the loop waits for new work instead of spinning."""
        with self._cond:
            lined = self.admission.drain()
        for ticket in lined:
            ticket.emit("error", error)
        for ticket, prep, cache in self._let_go():
            self._fail(ticket, prep, cache, error, "a step that failed outside any request")

    def _let_go(self) -> list[tuple[Ticket, Prepared, Any]]:
        """(ticket, prep, cache) of every request past its admission, which this thread no longer holds."""
        held = self._seqs.let_go()
        if self._piecewise is not None:
            held.append((self._piecewise.ticket, self._piecewise.prep, self._piecewise.cache))
        self._piecewise = None
        return held

    def _fail(self, ticket: Ticket, prep: Prepared, cache, error: Exception, where: str) -> None:
        """One request failed: its cache and budget go back (once: it has left every line), it hears why."""
        log.error("a request failed in %s", where, exc_info=error)
        try:
            self._give_back(prep, cache)
        finally:
            ticket.emit("error", error)

    def _give_back(self, prep: Prepared, cache) -> None:
        try:
            if cache is not None:
                self.service.runner.release(cache)
        finally:
            with self._cond:
                self.admission.release(prep)
                self._cond.notify()

    def _share_cores(self) -> None:
        """Take every core, less what running precompute jobs use (read without the jobs lock: never a wait) and
        one while the side worker runs an item: an ingest's chunking and SQL keep a core busy, and an OpenMP team
        with a thread on that core waits for it at every op (BENCHMARKS.md, "An ingest beside a generate")."""
        claim_cores(self.service.settings.thread_count(self.service.jobs.working(), self._side.busy > 0))

    # ---- shutting down --------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what runs and what waits (each gets its "cancelled", a work item sees its cancel), then stop."""
        self._side.stop()
        self._prep_thread.stop()
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._model_thread.join(timeout=60)
        for ticket in [*self.admission.drain(), *(t for t, _, _ in self._let_go())]:
            ticket.emit("cancelled", None)
        self._side.close()
        self._prep_thread.close()
