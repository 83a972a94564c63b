"""The generation role: retrieve → load chunk KV → fuse and repair → decode, as a stream.

    ask = Ask("who founded it?", namespace="acme", mode="epic")
    result = generation.generate(ask, on_text=print)   # deltas as they decode; the whole dict at the end
    prep = generation.prepare(ask)                     # the part before model work (the scheduler's)

A store fault is never a request failure: the store counts it and reports a miss, and the chunk
is prefilled here instead. A prompt that cannot fit the model's context is a UserError naming
the numbers, before any model work.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from blend import ChunkKV, KVCache, fuse_and_prefill, tokens_only
from blend.batch import decode_batch
from blend.decode import Sampling
from blend.prompt import as_ids, conversation

from ..corpus.corpus import Corpus, check_query
from ..corpus.ingest import same_tokenizer, unpack_ids
from ..errors import NotFound, UserError
from ..store import decode as decode_kv
from ..store.layers import decode_layerwise
from .policy import policy_for
from .prefixes import PrefixCache
from .rerank import rerank
from .repair import repair
from .sequence import Prepared, Sequence


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
    retrieval: str | None = None  # dense | bm25 | hybrid; None: RAGCACHE_RETRIEVAL
    rerank: int | None = None  # candidates reranked on their cached KV (0: none); None: RAGCACHE_RERANK
    tenant: str | None = None  # whose share it counts against (the caller's key); None: its namespace
    target_kl: float | None = None  # auto, adaptive: the calibrated point within this KL of full prefill
    stop: tuple[str, ...] = ()  # the answer ends before the first of these it writes (OpenAI's stop)

    @property
    def who(self) -> str:
        """The tenant the fairness limits count this request against."""
        return self.tenant or self.namespace


@dataclass
class Totals:
    """What every request added up to (read by /metrics)."""

    tokens: Counter = field(default_factory=Counter)  # recomputed, reused, completion
    chunks: Counter = field(default_factory=Counter)  # prefilled: a chunk no tier held, computed for a request


class Generation:
    def __init__(self, parts, corpus: Corpus):
        self.p, self.corpus = parts, corpus
        self.totals = Totals()
        self.prefixes = PrefixCache(parts)  # other system prompts' KV

    def policy_for(self, mode: str, ratio: float | None = None, k: int | None = None, target_kl: float | None = None):
        return policy_for(self.p, mode, ratio, k, target_kl)

    def prefix_for(self, head: list[int], namespace: str):
        """The exact prefix KV of a prompt head: the configured one, or one of a few recent others."""
        return self.p.prefix if head == self.p.frame.head else self.prefixes.get(head, namespace)

    def conversation(self, ask: Ask) -> tuple[list[int], list[int]]:
        """(the prompt's head: system prompt and template, its suffix: earlier turns, the question, the tail)."""
        p = self.p
        try:
            return conversation(p.tokenizer, p.settings.system_prompt if ask.system is None else ask.system,
                                [*ask.history, ("user", ask.query)])
        except Exception as e:  # noqa: BLE001 — a template's own rule (e.g. roles must alternate), named
            raise UserError(f"this conversation does not fit the model's chat template: {e}") from None

    def needs_prefix(self, ask: Ask) -> bool:
        """Whether `ask`'s prompt head is a custom one not cached yet: a prefill to run before `prepare`."""
        head, _ = self.conversation(ask)
        return head != self.p.frame.head and not self.prefixes.has(head, ask.namespace)

    def make_prefix(self, ask: Ask):
        """`ask`'s prompt head's KV (the scheduler's side worker computes it, for `prepare`)."""
        return self.prefix_for(self.conversation(ask)[0], ask.namespace)

    def load_chunks(self, token_ids: list[torch.Tensor], namespace: str) -> tuple[list[ChunkKV], list[str]]:
        """KV of each chunk and where it came from; missing or corrupt ones are computed and stored."""
        p = self.p
        keys = [p.kv_key_of(ids, namespace) for ids in token_ids]
        hits = p.store.get_many(keys)
        compact = [i for i, hit in enumerate(hits) if hit is not None and hit.entry.frames is not None]
        streamed = {}  # chunk index → its ChunkKV, layers decoding on another thread as the prefill runs
        if p.settings.layerwise_load and compact:
            streamed = dict(zip(compact, decode_layerwise([hits[i].entry for i in compact], p.model.dtype,
                                                          p.model.device)))
        chunks, tiers = [], []
        for i, (ids, key, hit) in enumerate(zip(token_ids, keys, hits)):
            if hit is not None:
                if p.admission.on_hit(key):  # declined once, used again: worth its write now
                    p.store.put(key, hit.entry, best_effort=True)
                chunks.append(streamed[i] if i in streamed else decode_kv(hit.entry, p.model.dtype, p.model.device))
                tiers.append(hit.tier)
                continue
            kv, stored = p.prefill_for_store(ids, namespace)
            self.totals.chunks["prefilled"] += 1
            if p.admission.on_miss(key):
                p.store.put(key, stored, best_effort=True)  # a full or failing tier: served anyway
            else:
                p.store.keep(key, stored)
            chunks.append(kv)
            tiers.append("computed")
        return chunks, tiers

    def prepare(self, ask: Ask, start: float | None = None, prefix=None) -> Prepared:
        """Everything before model work: checks, prompt, retrieval, chunk KV (off the model thread);
        `prefix`: the prompt head's KV when it was computed beforehand (`make_prefix`).

        Bad input raises UserError before any waiting: a request whose KV could never fit the
        budget (RAGCACHE_KV_BUDGET_BYTES) included.
        """
        p = self.p
        times = {"start": time.perf_counter() if start is None else start}
        check_query(ask.query)
        policy = self.policy_for(ask.mode or p.settings.mode, ask.ratio, ask.epic_k, ask.target_kl)
        if ask.max_new_tokens is not None and ask.max_new_tokens > p.settings.max_tokens_cap:
            raise UserError(f"max_tokens {ask.max_new_tokens} is over this server's cap of "
                            f"{p.settings.max_tokens_cap} (RAGCACHE_MAX_TOKENS_CAP)")
        try:
            sampling = Sampling(ask.max_new_tokens or p.settings.max_new_tokens, ask.temperature, ask.top_p, ask.seed)
        except ValueError as e:
            raise UserError(str(e)) from None
        head, suffix = self.conversation(ask)
        top_k = ask.top_k or p.settings.top_k
        rerank_n = p.settings.rerank if ask.rerank is None else ask.rerank
        reranking = rerank_n > top_k
        found = self.corpus.retrieve(ask.query, ask.namespace, rerank_n if reranking else top_k, ask.retrieval)
        if not found:
            raise NotFound(f"namespace {ask.namespace!r} has no precomputed chunks: ingest and precompute first")
        loaded = None  # (ChunkKVs, tiers) once the reranker loaded them, for a policy that reads them
        if reranking:
            found, chunks, tiers = rerank(self, ask.query, ask.namespace, found, top_k)
            loaded = (chunks, tiers) if policy.reads_chunk_kv else None
        times["retrieved"] = time.perf_counter()
        hits, rows = zip(*found)
        self._check_fits(head, rows, suffix, sampling.max_new_tokens)
        self._check_model(rows)
        rows_needed = len(head) + sum(r.n_tokens for r in rows) + len(suffix) + sampling.max_new_tokens
        kv_bytes = rows_needed * self.kv_row_bytes()
        if kv_bytes > p.settings.kv_budget_bytes:
            raise UserError(f"this request's KV cache ({rows_needed} tokens x {self.kv_row_bytes()} bytes = "
                            f"{kv_bytes} bytes) is over the server's whole KV budget of {p.settings.kv_budget_bytes} "
                            "bytes (RAGCACHE_KV_BUDGET_BYTES); lower top_k or max_tokens")
        token_ids = [unpack_ids(row.token_ids) for row in rows]
        if loaded is not None:  # the reranker loaded them
            chunks, tiers = loaded
        elif policy.reads_chunk_kv:
            chunks, tiers = self.load_chunks(token_ids, ask.namespace)
        else:  # full prefill: nothing comes from the cache
            chunks, tiers = [tokens_only(ids) for ids in token_ids], ["computed"] * len(token_ids)
        prefix = prefix if prefix is not None else self.prefix_for(head, ask.namespace)
        times["loaded"] = time.perf_counter()
        stops = frozenset() if ask.ignore_eos else p.stops
        return Prepared(ask, policy, sampling, prefix, as_ids(suffix), chunks, list(hits), tiers, stops, kv_bytes,
                        times)

    def kv_row_bytes(self) -> int:
        """Bytes of one token's K and V over every layer, as running sequences keep them (RAGCACHE_KV_CACHE_DTYPE)."""
        r = self.p.runner
        return KVCache.bytes_per_row_of(r.num_layers, r.num_kv_heads, r.head_dim, self.p.kv_cache_dtype)

    def generate(self, ask: Ask, on_text=None, cancelled=lambda: False) -> dict:
        """The answer, its chunks, token usage and stage timings; `on_text(delta)` streams the answer.

        One request alone, on the caller's thread (the CLI, the evaluation); a server batches
        requests through `Scheduler` instead, with the same steps.
        """
        prep = self.prepare(ask)
        prep.times["admitted"] = time.perf_counter()
        fused = fuse_and_prefill(self.p.runner, *prep.fuse_args())
        fused.cache = self.p.runner.compact(fused.cache, self.p.kv_cache_dtype)  # as a server's running sequence
        seq = Sequence(prep, fused, self.p.tokenizer, on_text)
        try:
            while (token := seq.advance()) is not None:
                if cancelled():
                    seq.cancel()
                    break
                if seq.wants_repair:  # deferred: the first token is out; the rest decode from the repair
                    error = repair(self.p.runner, self.p.kv_cache_dtype, [seq])[0]
                    if error is not None:
                        raise error
                    continue
                seq.logits = decode_batch(self.p.runner, [seq.cache], [token])[0]
        finally:
            if seq.cache is not None:
                self.p.runner.release(seq.cache)
        return seq.result(self.totals.tokens)

    def _check_fits(self, head: list[int], rows, suffix: list[int], max_new: int) -> None:
        limit = self.p.runner.max_positions
        context = sum(r.n_tokens for r in rows)
        need = len(head) + context + len(suffix) + max_new
        if need > limit:
            raise UserError(f"the prompt does not fit the model's context of {limit} tokens: system prompt "
                            f"{len(head)} + {len(rows)} chunks {context} + question {len(suffix)} + max_tokens "
                            f"{max_new} = {need}; lower top_k or max_tokens")

    def _check_model(self, chunks) -> None:
        other = {c.model for c in chunks} - set(same_tokenizer(self.p.model))
        if other:
            raise UserError("these chunks were tokenized by another tokenizer; re-ingest the documents with this "
                            "model (`ragcache ingest` re-tokenizes them)")

