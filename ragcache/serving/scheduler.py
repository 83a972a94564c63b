"""The serving loop: continuous batching of many requests on the one thread that owns the model.

    ticket = scheduler.submit_generation(ask, on_event)      # a request, batched with the others
    ticket = scheduler.submit(lambda t: work(), on_event)    # other work off the event loop (ingest, warm)

Three threads. The prep thread (`prep.PrepThread`) does what is not model work, tenants in turn:
tokenizing, retrieval (FAISS) and loading chunk KV from the store tiers, so that they overlap
decoding. The side worker (`side.SideWorker`) runs `submit`'s work items (ingest, warm-up) and custom
system prompts' prefills, which would stall the prep thread. The model thread, this module, loops
over `step()`:

    admit   prepared requests while their KV fits RAGCACHE_KV_BUDGET_BYTES (`admission.Admission`)
    prefill the admitted ones whose recomputed rows fit the step (`Admission.step_rows`, one at least),
            batched, tenants in turn; a longer one runs across steps, that many rows x layers a step
            (`piecewise.Piecewise`), its pieces taking turns with the others' batches
    pick    the next token of every running sequence, streaming its text
    release the finished or cancelled ones: their cache and budget go back at once, they answer
    decode  one forward of every sequence still running, batched
    repair  the sequences whose first token went out under `deferred`: prompt and token fused again, batched
            (`repair.repair`); they pick their second token at the next step

`on_event(kind, payload)` gets "text" deltas as tokens decode, then exactly one of "done" (the
result), "error" (the exception) or "cancelled". A ticket cancelled while it waits never runs;
one cancelled while it decodes leaves the batch at the next step. Past `max_queue` waiting
tickets, submitting raises Busy with a Retry-After estimate.

A request's exception, at any stage (plan, prefill, piece, start, pick, result, decode), is that
request's "error" alone: its budget goes back once, the others run on. A batched prefill or decode
that raises is tried again one request at a time, so that only a request that fails alone fails.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from blend.batch import decode_batch, fuse_batch
from blend.cores import claim_cores, hand_over_quickly

from .admission import Admission, Limits
from .piecewise import Piecewise
from .prep import PrepThread
from .repair import repair
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
        self._cond = threading.Condition()  # guards `admission`; `_running` and `_piecewise` are the model thread's
        self._running: list[tuple[Ticket, Sequence]] = []
        self._repairs: list[tuple[Ticket, Sequence]] = []  # picked their first token; their repair runs this step
        self._piecewise: Piecewise | None = None  # a long prompt recomputed across steps
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
        return (len(self.admission.admitted) + len(self._running) + len(self._repairs) + self._side.busy
                + (self._piecewise is not None))

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
        batch, cap = self._admit()
        self._share_cores()
        self._prefill(batch, cap)
        done = self._pick()
        self._release(done)
        self._decode()
        self._repair()

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
            batch, too_long, failed = self.admission.take_prefill(self.service.runner.num_layers, not long_one)
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
        try:
            fused = fuse_batch(self.service.runner, [prep.fuse_args() for _, prep in batch])
        except Exception as e:  # noqa: BLE001 — alone, each request fails or runs on its own
            if len(batch) > 1:
                for item in batch:
                    self._prefill_batch([item])
                return
            self._fail(*batch[0], None, e, "a prefill")
            return
        self.stats.prefill_batch.observe(len(batch))
        for (ticket, prep), f in zip(batch, fused):
            self._start(ticket, prep, f)

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
        self.stats.prefill_batch.observe(1)
        self._start(piece.ticket, piece.prep, fused)

    def _start(self, ticket: Ticket, prep: Prepared, fused) -> None:
        try:
            fused.cache = self.service.runner.compact(fused.cache, self.service.kv_cache_dtype)  # RAGCACHE_KV_CACHE_DTYPE
            seq = Sequence(prep, fused, self.service.tokenizer, lambda delta: ticket.emit("text", delta))
        except Exception as e:  # noqa: BLE001
            self._fail(ticket, prep, fused.cache, e, "starting a sequence")
            return
        self._running.append((ticket, seq))

    def _pick(self) -> list[tuple[Ticket, Sequence]]:
        """Every running sequence picks its next token (streaming its text); the finished and cancelled leave."""
        live, done = [], []
        for ticket, seq in self._running:
            if ticket.cancelled.is_set():
                seq.cancel()
            else:
                try:
                    seq.advance()
                except Exception as e:  # noqa: BLE001 — this sequence leaves; the others pick on
                    self._fail(ticket, seq.prep, seq.cache, e, "picking a token")
                    continue
            (done if seq.finish_reason else self._repairs if seq.wants_repair else live).append((ticket, seq))
        self._running = live
        return done

    def _release(self, done: list[tuple[Ticket, Sequence]]) -> None:
        """Each finished sequence gives back its cache and budget, then answers (or hears it was cancelled)."""
        for ticket, seq in done:
            if seq.finish_reason == "cancelled":
                self._give_back(seq.prep, seq.cache)
                ticket.emit("cancelled", None)
                continue
            try:
                result = seq.result(self.service.generation.totals.tokens)
            except Exception as e:  # noqa: BLE001
                self._fail(ticket, seq.prep, seq.cache, e, "reporting a result")
                continue
            self._give_back(seq.prep, seq.cache)
            self.admission.finished(time.perf_counter() - ticket.submitted)
            ticket.emit("done", result)

    def _decode(self) -> None:
        """One forward of every running sequence's picked token, batched: their next logits."""
        if not self._running:
            return
        self.stats.decode_batch.observe(len(self._running))
        self._running = self._decode_batch(self._running)

    def _decode_batch(self, live: list[tuple[Ticket, Sequence]]) -> list[tuple[Ticket, Sequence]]:
        """The sequences of `live` still running after their decode (with their next logits)."""
        try:
            logits = decode_batch(self.service.runner, [seq.cache for _, seq in live],
                                  [seq.token for _, seq in live])  # (B, V)
        except Exception as e:  # noqa: BLE001 — alone, each sequence fails or runs on its own
            if len(live) > 1:
                return [item for one in live for item in self._decode_batch([one])]
            ticket, seq = live[0]
            self._fail(ticket, seq.prep, seq.cache, e, "a decode step")
            return []
        for i, (_, seq) in enumerate(live):
            seq.logits = logits[i]
        return live

    def _repair(self) -> None:
        """Those whose first token went out under `deferred`: repaired together, their next logits."""
        items, self._repairs = self._repairs, []
        if not items:
            return
        errors = repair(self.service.runner, self.service.kv_cache_dtype, [seq for _, seq in items])
        for (ticket, seq), error in zip(items, errors):
            if error is None:
                self._running.append((ticket, seq))
            else:
                self._fail(ticket, seq.prep, seq.cache, error, "a repair after the first token")

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
        piecewise = [self._piecewise.ticket] if self._piecewise is not None else []
        for ticket in [*self.admission.clear(), *(t for t, _ in self._running + self._repairs), *piecewise]:
            ticket.emit("cancelled", None)
        self._running.clear()
        self._repairs.clear()
        self._side.close()
        self._prep_thread.close()
