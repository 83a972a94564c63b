"""The running sequences' part of a scheduler step, on the model thread:

    pick    the next token of every running sequence, streaming its text
    release the finished or cancelled ones: their cache and budget go back at once, they answer
    decode  one forward of every sequence still running, batched
    repair  those whose first token went out under `deferred`: prompt and token fused again, batched within the
            step's rows as prompts are (a longer one in pieces, by the scheduler); their next token after

`fail(ticket, prep, cache, error, where)` and `give_back(prep, cache)` are the scheduler's: a sequence that
fails leaves alone, its budget going back once.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from blend.batch import decode_batch

from .alone import each_alone
from .piecewise import Piecewise
from .repair import release, repair, take
from .sequence import Prepared, Sequence
from .ticket import Ticket


class Decoding:
    def __init__(self, service, stats, admission, fail: Callable, give_back: Callable):
        self.service, self.stats, self.admission = service, stats, admission
        self._fail, self._give_back = fail, give_back
        self.running: list[tuple[Ticket, Sequence]] = []
        self.repairs: list[tuple[Ticket, Sequence]] = []  # picked their first token; waiting for their repair

    def __len__(self) -> int:
        return len(self.running) + len(self.repairs)

    def pick(self) -> list[tuple[Ticket, Sequence]]:
        """Every running sequence picks its next token (streaming its text); the finished and cancelled leave."""
        live, done = [], []
        for ticket, seq in self.running:
            if ticket.cancelled.is_set():
                seq.cancel()
            else:
                try:
                    seq.advance()
                except Exception as e:  # noqa: BLE001 — this sequence leaves; the others pick on
                    self._fail(ticket, seq.prep, seq.cache, e, "picking a token")
                    continue
            (done if seq.finish_reason else self.repairs if seq.wants_repair else live).append((ticket, seq))
        self.running = live
        return done

    def release(self, done: list[tuple[Ticket, Sequence]]) -> None:
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

    def decode(self) -> None:
        """One forward of every running sequence's picked token, batched: their next logits."""
        if not self.running:
            return
        self.stats.decode_batch.observe(len(self.running))
        ran = each_alone(self.running, lambda b: decode_batch(self.service.runner, [seq.cache for _, seq in b],
                                                              [seq.token for _, seq in b]),  # (B, V)
                         lambda item, e: self._fail(item[0], item[1].prep, item[1].cache, e, "a decode step"))
        for (_, seq), logits in ran:
            seq.logits = logits
        self.running = [item for item, _ in ran]

    def repair(self, cap: int, long_ok: bool) -> Piecewise | None:
        """Those waiting for their repair after the first token: as many as fit `cap` rows together repaired (their
        next logits); one longer, when `long_ok`, returned to run in pieces; the rest wait for a later step."""
        live = []
        for ticket, seq in self.repairs:
            if ticket.cancelled.is_set():
                self._give_back(seq.prep, seq.cache)
                ticket.emit("cancelled", None)
            else:
                live.append((ticket, seq))
        runner = self.service.runner
        batch, long_one, self.repairs, failed = take(live, cap, runner.num_layers, long_ok)
        for (ticket, seq), e in failed:
            self._fail(ticket, seq.prep, seq.cache, e, "planning a repair")
        errors = repair(runner, self.service.kv_cache_dtype, [seq for _, seq in batch]) if batch else []
        for (ticket, seq), error in zip(batch, errors):
            self.repaired(ticket, seq, error)
        if long_one is None:
            return None
        ticket, seq = long_one
        release(runner, seq)
        return Piecewise(ticket, seq.prep, seq)

    def repaired(self, ticket: Ticket, seq: Sequence, error: Exception | None) -> None:
        if error is None:
            self.running.append((ticket, seq))
        else:
            self._fail(ticket, seq.prep, seq.cache, error, "a repair after the first token")

    def let_go(self) -> list[tuple[Ticket, Prepared, Any]]:
        """(ticket, prep, cache) of every sequence, which this no longer holds."""
        held = [(t, s.prep, s.cache) for t, s in self.running + self.repairs]
        self.running, self.repairs = [], []
        return held
