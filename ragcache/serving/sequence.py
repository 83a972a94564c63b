"""One generation request between its retrieval and its last token.

`Prepared` is what the request needs before any model work (built off the model thread:
tokenizing, retrieval, chunk KV loading); `Sequence` is its decoding state once its fused
prefill ran: the next token, its text deltas, and the result dict at the end. The sequential
path (`Generation.generate`) and the scheduler's batched steps drive the same `Sequence`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from blend.decode import Sampling, pick
from blend.deferred import after_first, repair_of
from blend.fuse import layout_of
from blend.labels import label

from .explain import explain
from .textstream import TextStream


@dataclass
class Prepared:
    ask: object  # generation.Ask
    policy: object
    sampling: Sampling
    prefix: object  # PrefixKV of the prompt's head
    suffix: torch.Tensor  # (S,) the question and chat tail
    chunks: list  # ChunkKV per retrieved chunk
    hits: list  # ChunkHit per chunk
    tiers: list[str]
    stops: frozenset[int]
    kv_bytes: int  # the fused cache with room for every new token: what the KV budget reserves
    times: dict[str, float] = field(default_factory=dict)  # perf_counter at: start, retrieved, loaded, admitted

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix) + sum(len(c) for c in self.chunks) + self.suffix.numel()

    @property
    def kv_rows(self) -> int:
        """The fused cache's rows with room for every new token: the tokens a tenant's share counts."""
        return self.prompt_tokens + self.sampling.max_new_tokens

    def plan(self, num_layers: int):
        """The policy's Plan for this prompt: its rows from layer 0 are what the scheduler's per-step cap counts."""
        return self.policy.plan(layout_of(self.prefix, self.chunks, self.suffix.numel()), num_layers)

    def fuse_args(self) -> tuple:
        """(prefix_kv, chunk_kvs, suffix_ids, policy, headroom) for `fuse_and_prefill` / `fuse_batch`."""
        return self.prefix, self.chunks, self.suffix, self.policy, self.sampling.max_new_tokens

    def repair_rows(self, num_layers: int) -> int:
        """The rows the repair after the first token recomputes from layer 0: what a step's cap counts."""
        layout = layout_of(self.prefix, self.chunks, self.suffix.numel() + 1)  # the prompt and its first token
        return repair_of(self.policy).plan(layout, num_layers).recompute_rows

    def repair_args(self, token: int) -> tuple:
        """`fuse_args` of the repair after the first token (`deferred`): the prompt and `token`, by the repair
        policy, in a cache of the same size."""
        return (self.prefix, self.chunks, after_first(self.suffix, token), repair_of(self.policy),
                self.sampling.max_new_tokens - 1)


class Sequence:
    def __init__(self, prep: Prepared, fused, tokenizer, on_text=None):
        self.prep, self.fused, self.on_text = prep, fused, on_text
        self.cache = fused.cache
        self.logits = fused.logits  # (V,) the next token's distribution
        self.repairs_with = repair_of(prep.policy)  # deferred: the policy of the repair after the first token
        self.repair = None  # the repair's FusedResult once it ran
        self.repair_s = 0.0
        self.stream = TextStream(tokenizer, prep.ask.stop)
        self.finish_reason: str | None = None
        self.token: int | None = None  # the last token picked, for the next decode step to feed back
        self.generator = None
        s = prep.sampling
        if s.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(s.seed if s.seed is not None else torch.seed())
        self.cache.reserve(self.cache.length + s.max_new_tokens)
        int(self.logits.argmax())  # the first token is known (and a GPU synchronised): TTFT ends
        self.t_first = time.perf_counter()

    def advance(self) -> int | None:
        """Pick the next token from `logits` and stream its text; the token to feed back, or None once done."""
        token = pick(self.logits, self.prep.sampling, self.generator)
        if token in self.prep.stops:
            self.finish_reason = "stop"
            return None
        self._emit(self.stream.push(token))
        if self.stream.stopped:  # a stop string: the answer ended before it
            self.finish_reason = "stop"
            return None
        if len(self.stream.ids) == self.prep.sampling.max_new_tokens:
            self.finish_reason = "length"
            return None
        self.token = token
        return token

    @property
    def wants_repair(self) -> bool:
        """The first token is out and the policy repairs after it: the next logits come from `repaired`, not a
        decode step. Whoever runs the repair releases `cache` first (the repair fuses from the chunk KV)."""
        return (self.token is not None and self.repair is None and len(self.stream.ids) == 1
                and self.repairs_with is not None)

    def repaired(self, fused) -> None:
        """The repair's fused prompt and first token: decoding goes on from its cache and logits."""
        self.repair, self.cache, self.logits = fused, fused.cache, fused.logits
        self.repair_s = time.perf_counter() - self.t_first

    def cancel(self) -> None:
        self.finish_reason = "cancelled"

    def _emit(self, delta: str) -> None:
        if delta and self.on_text:
            self.on_text(delta)

    def result(self, tokens_totals) -> dict:
        """The whole answer (flushes the text tail); adds its token counts to `tokens_totals` (a Counter)."""
        self._emit(self.stream.finish())
        t_end, p, fused = time.perf_counter(), self.prep, self.fused
        t = p.times
        prompt = fused.layout.total
        recomputed = int(fused.kv_rows[-1].numel())
        if self.repair is not None:  # deferred: what the answer decodes from is the repair's (the token's row aside)
            recomputed = int(self.repair.kv_rows[-1].numel()) - 1
        kept = prompt - recomputed
        usage = {"prompt_tokens": prompt, "reused_tokens": kept, "recomputed_tokens": recomputed,
                 "completion_tokens": len(self.stream.ids)}
        tokens_totals.update(recomputed=recomputed, reused=kept, completion=len(self.stream.ids))
        ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
        out = {
            "request_id": uuid.uuid4().hex[:16],
            "answer": self.stream.sent,
            "mode": p.policy.name,
            "policy": label(p.policy),  # what served it, knobs and APE included (what `auto` picked)
            "finish_reason": self.finish_reason,
            "chunks": [{"id": h.id, "doc_id": h.doc_id, "score": round(h.score, 4), "tier": tier,
                        "heading": h.heading, "page": h.page} for h, tier in zip(p.hits, p.tiers)],
            "usage": usage,
            "timings_ms": {"retrieve": ms(t["start"], t["retrieved"]), "load": ms(t["retrieved"], t["loaded"]),
                           "queue": ms(t["loaded"], t["admitted"]), "blend": ms(t["admitted"], self.t_first),
                           "ttft": ms(t["start"], self.t_first), "repair": round(self.repair_s * 1000, 2),
                           "decode": ms(self.t_first, t_end),
                           "total": ms(t["start"], t_end)},
        }
        if p.ask.explain:
            out["explain"] = explain(self.stream.tokenizer, fused, p.policy)
        return out
