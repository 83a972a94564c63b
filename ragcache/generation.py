"""The generation role: retrieve → load chunk KV → fuse and repair → decode, as a stream.

    ask = Ask("who founded it?", namespace="acme", mode="epic")
    result = generation.generate(ask, on_text=print)   # deltas as they decode; the whole dict at the end

A store fault is never a request failure: the store counts it and reports a miss, and the chunk
is prefilled here instead. A prompt that cannot fit the model's context is a UserError naming
the numbers, before any model work.
"""
from __future__ import annotations

import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from blend import ChunkKV, compute_prefix, fuse_and_prefill, make_policy, tokens_only
from blend.decode import Sampling, decode_steps
from blend.prompt import as_ids, conversation

from .config import RATIO_MODES
from .corpus import Corpus, check_query
from .errors import NotFound, UserError
from .explain import explain
from .ingest import unpack_ids
from .meta import ModelDefault
from .store import decode as decode_kv
from .textstream import TextStream


@dataclass(frozen=True)
class Ask:
    """One retrieve-and-generate request. `history`: earlier (role, content) turns, oldest first."""

    query: str
    namespace: str = "default"
    top_k: int | None = None
    mode: str | None = None
    ratio: float | None = None
    epic_k: int | None = None
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    history: tuple[tuple[str, str], ...] = ()
    system: str | None = None  # None: the configured system prompt (the shared exact prefix)
    explain: bool = False
    ignore_eos: bool = False


@dataclass
class Totals:
    """What every request added up to (read by /metrics)."""

    tokens: Counter = field(default_factory=Counter)  # recomputed, reused, completion


class Generation:
    def __init__(self, parts, corpus: Corpus, max_prefixes: int = 8):
        self.p, self.corpus = parts, corpus
        self.totals = Totals()
        self._prefixes: OrderedDict[tuple[int, ...], object] = OrderedDict()  # other system prompts' KV
        self._max_prefixes = max_prefixes

    def policy_for(self, mode: str, ratio: float | None = None, k: int | None = None):
        """A selection policy; `auto` is what `ragcache calibrate` chose for this model."""
        if mode == "auto":
            with self.p.db.session() as s:
                default = s.get(ModelDefault, self.p.model.fingerprint)
            if default is None:
                mode = "cacheblend"
            else:
                mode = default.mode
                ratio = default.param if mode in RATIO_MODES else ratio
                k = int(default.param) if mode == "epic" and default.param is not None else k
        s = self.p.settings
        knobs = {"cacheblend": {"ratio": s.cacheblend_ratio if ratio is None else ratio},
                 "epic": {"k": s.epic_k if k is None else k}}.get(mode, {})
        if mode in RATIO_MODES and mode != "cacheblend" and ratio is not None:
            knobs = {"ratio": ratio}  # else the policy's own default
        try:
            return make_policy(mode, **knobs)
        except ValueError as e:  # an unknown mode or a knob out of range, named by blend
            raise UserError(str(e)) from None

    def prefix_for(self, head: list[int]):
        """The exact prefix KV of a prompt head: the configured one, or one of a few recent others."""
        if head == self.p.frame.head:
            return self.p.prefix
        key = tuple(head)
        if key not in self._prefixes:
            self._prefixes[key] = compute_prefix(self.p.runner, as_ids(head))
            while len(self._prefixes) > self._max_prefixes:
                self._prefixes.popitem(last=False)
        self._prefixes.move_to_end(key)
        return self._prefixes[key]

    def load_chunks(self, token_ids: list[torch.Tensor], namespace: str) -> tuple[list[ChunkKV], list[str]]:
        """KV of each chunk and where it came from; missing or corrupt ones are computed and stored."""
        p = self.p
        keys = [p.kv_key_of(ids, namespace) for ids in token_ids]
        hits = p.store.get_many(keys)
        chunks, tiers = [], []
        for ids, key, hit in zip(token_ids, keys, hits):
            if hit is not None:
                chunks.append(decode_kv(hit.entry, p.model.dtype, p.model.device))
                tiers.append(hit.tier)
                continue
            kv = p.compute_chunk_kv(ids)
            p.store.put(key, p.store_encode(kv), best_effort=True)  # a full or failing tier: served anyway
            chunks.append(kv)
            tiers.append("computed")
        return chunks, tiers

    def generate(self, ask: Ask, on_text=None, cancelled=lambda: False) -> dict:
        """The answer, its chunks, token usage and stage timings; `on_text(delta)` streams the answer."""
        p = self.p
        check_query(ask.query)
        policy = self.policy_for(ask.mode or p.settings.mode, ask.ratio, ask.epic_k)
        if ask.max_new_tokens is not None and ask.max_new_tokens > p.settings.max_tokens_cap:
            raise UserError(f"max_tokens {ask.max_new_tokens} is over this server's cap of "
                            f"{p.settings.max_tokens_cap} (RAGCACHE_MAX_TOKENS_CAP)")
        try:
            sampling = Sampling(ask.max_new_tokens or p.settings.max_new_tokens, ask.temperature, ask.top_p, ask.seed)
        except ValueError as e:
            raise UserError(str(e)) from None
        try:
            head, suffix = conversation(p.tokenizer, p.settings.system_prompt if ask.system is None else ask.system,
                                        [*ask.history, ("user", ask.query)])
        except Exception as e:  # noqa: BLE001 — a template's own rule (e.g. roles must alternate), named
            raise UserError(f"this conversation does not fit the model's chat template: {e}") from None
        t0 = time.perf_counter()
        found = self.corpus.retrieve(ask.query, ask.namespace, ask.top_k)
        if not found:
            raise NotFound(f"namespace {ask.namespace!r} has no precomputed chunks: ingest and precompute first")
        t_retrieve = time.perf_counter()
        hits, rows = zip(*found)
        self._check_fits(head, rows, suffix, sampling.max_new_tokens)
        self._check_model(rows)
        token_ids = [unpack_ids(row.token_ids) for row in rows]
        if policy.reads_chunk_kv:
            chunks, tiers = self.load_chunks(token_ids, ask.namespace)
        else:  # full prefill: nothing comes from the cache
            chunks, tiers = [tokens_only(ids) for ids in token_ids], ["computed"] * len(token_ids)
        prefix = self.prefix_for(head)
        t_load = time.perf_counter()
        fused = fuse_and_prefill(p.runner, prefix, chunks, as_ids(suffix), policy, headroom=sampling.max_new_tokens)
        int(fused.logits.argmax())  # the first token is known (and a GPU synchronised): TTFT ends
        t_first = time.perf_counter()
        stream, finish = TextStream(p.tokenizer), "length"
        stops = frozenset() if ask.ignore_eos else p.stops
        try:
            for token in decode_steps(p.runner, fused.cache, fused.logits, sampling, stops):
                delta = stream.push(token)
                if delta and on_text:
                    on_text(delta)
                if cancelled():
                    finish = "cancelled"
                    break
            else:
                finish = "length" if len(stream.ids) == sampling.max_new_tokens else "stop"
            tail = stream.finish()
            if tail and on_text:
                on_text(tail)
        finally:
            p.runner.release(fused.cache)
        t_end = time.perf_counter()
        prompt = fused.layout.total
        recomputed = int(fused.kv_rows[-1].numel())
        usage = {"prompt_tokens": prompt, "reused_tokens": prompt - recomputed, "recomputed_tokens": recomputed,
                 "completion_tokens": len(stream.ids)}
        self.totals.tokens.update(recomputed=recomputed, reused=prompt - recomputed, completion=len(stream.ids))
        ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
        out = {
            "request_id": uuid.uuid4().hex[:16],
            "answer": stream.sent,
            "mode": policy.name,
            "finish_reason": finish,
            "chunks": [{"id": h.id, "doc_id": h.doc_id, "score": round(h.score, 4), "tier": t}
                       for h, t in zip(hits, tiers)],
            "usage": usage,
            "timings_ms": {"retrieve": ms(t0, t_retrieve), "load": ms(t_retrieve, t_load),
                           "blend": ms(t_load, t_first), "ttft": ms(t0, t_first), "decode": ms(t_first, t_end),
                           "total": ms(t0, t_end)},
        }
        if ask.explain:
            out["explain"] = explain(p.tokenizer, fused, policy)
        return out

    def _check_fits(self, head: list[int], rows, suffix: list[int], max_new: int) -> None:
        limit = self.p.runner.max_positions
        context = sum(r.n_tokens for r in rows)
        need = len(head) + context + len(suffix) + max_new
        if need > limit:
            raise UserError(f"the prompt does not fit the model's context of {limit} tokens: system prompt "
                            f"{len(head)} + {len(rows)} chunks {context} + question {len(suffix)} + max_tokens "
                            f"{max_new} = {need}; lower top_k or max_tokens")

    def _check_model(self, chunks) -> None:
        other = {c.model for c in chunks} - {self.p.model.fingerprint}
        if other:
            raise UserError("these chunks were tokenized for another model; re-ingest the corpus with this one")

