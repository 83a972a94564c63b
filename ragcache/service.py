"""The facade the CLI, the evaluation, the demo and the REST API call.

generate: embed the query → search the namespace's index → batch-load the chunks' KV from the
store (a missing or corrupt one is prefilled on the spot and stored) → fuse with the chosen
policy → decode. Parts load on first use, so `search` never loads the LLM.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from sqlalchemy import select

from blend import (ALONE, ChunkKV, Runner, compute_chunk, compute_prefix, fuse_and_prefill, load_model, make_policy,
                   tokens_only)
from blend.decode import Sampling, decode
from blend.prompt import as_ids, chat_frame, encode, stop_token_ids

from .chunking import read_documents
from .config import Settings
from .errors import UserError
from .ingest import IngestReport, corpus_counts, ingest_documents, unpack_ids
from .meta import Chunk, Database, ModelDefault
from .meta import Document as DocRow
from .store import decode as decode_kv
from .store import encode as encode_kv
from .store import kv_key, open_store


@dataclass(frozen=True)
class ChunkHit:
    id: int
    doc_id: str
    score: float
    text: str


class RagCache:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or Settings()
        self.settings.home.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.settings.db_url)
        self._lock = threading.Lock()  # one generation at a time: the model owns the cores
        self._synced: set[str] = set()
        self._salts: dict[str, str] = {}  # namespace → key salt; never changes once created

    def __enter__(self) -> "RagCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- parts, loaded on first use -----------------------------------------------------------

    @cached_property
    def model(self):
        s = self.settings
        return load_model(s.model, s.home, s.device, s.dtype)

    @cached_property
    def runner(self) -> Runner:
        return Runner(self.model)

    @cached_property
    def tokenizer(self):
        return self.model.tokenizer

    @cached_property
    def frame(self):
        return chat_frame(self.tokenizer, self.settings.system_prompt)

    @cached_property
    def prefix(self):
        """The system prompt's KV: an exact prefix cache shared by every request."""
        return compute_prefix(self.runner, as_ids(self.frame.head))

    @cached_property
    def stops(self) -> frozenset[int]:
        return stop_token_ids(self.tokenizer, self.model.config)

    @cached_property
    def store(self):
        return open_store(self.settings, self.db)

    @cached_property
    def embedder(self):
        from index import Embedder

        return Embedder()

    @cached_property
    def index(self):
        from index import VectorIndex

        return VectorIndex(self.settings.home / "index", self.embedder.dim, self.settings.index_kind)

    @property
    def kv_dtype(self) -> str:
        d = self.settings.kv_dtype
        return str(self.model.dtype).removeprefix("torch.") if d == "auto" else d

    @property
    def chunk_context(self) -> str:
        return self.prefix.key if self.settings.chunk_prefill == "prefixed" else ALONE

    def kv_key_of(self, token_ids: torch.Tensor, namespace: str) -> str:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = self.db.namespace_salt(namespace, self.settings.share_across_namespaces)
        return kv_key(self.model.fingerprint, token_ids, self.chunk_context, self.kv_dtype, salt)

    def store_encode(self, kv: ChunkKV):
        return encode_kv(kv, self.kv_dtype)

    def compute_chunk_kv(self, token_ids: torch.Tensor) -> ChunkKV:
        prefixed = self.settings.chunk_prefill == "prefixed"
        return compute_chunk(self.runner, token_ids, self.prefix if prefixed else None)

    def warm(self, namespace: str = "default") -> None:
        """Load every part a request touches, so that request timings hold no one-time work."""
        _ = self.runner, self.prefix, self.stops, self.store, self.embedder
        if namespace not in self._synced:
            self.sync_index(namespace)

    # ---- corpus --------------------------------------------------------------------------------

    def ingest(self, path: str | Path, namespace: str = "default") -> IngestReport:
        docs = read_documents(Path(path))
        report = ingest_documents(self.db, self.tokenizer, self.model.fingerprint, docs, namespace,
                                  self.settings.chunk_tokens)
        if report.removed_chunk_ids:
            self.index.remove(namespace, np.asarray(report.removed_chunk_ids))
            self.index.save(namespace)
        for key in report.orphan_kv_keys:
            self.store.delete(key)
        return report

    def counts(self, namespace: str | None = None) -> dict[str, int]:
        return corpus_counts(self.db, namespace)

    def sync_index(self, namespace: str) -> int:
        """Make the namespace's index hold exactly its done chunks' embeddings (SQL is the truth)."""
        with self.db.session() as s:
            rows = s.execute(select(Chunk.id, Chunk.embedding).where(Chunk.namespace == namespace,
                                                                     Chunk.state == "done")).all()
        want = {cid: emb for cid, emb in rows if emb is not None}
        have = self.index.ids(namespace)
        extra = np.asarray(sorted(have - want.keys()), dtype=np.int64)
        missing = sorted(want.keys() - have)
        if len(extra):
            self.index.remove(namespace, extra)
        if missing:
            vecs = np.stack([np.frombuffer(want[c], dtype=np.float32) for c in missing])
            self.index.add(namespace, np.asarray(missing, dtype=np.int64), vecs)
        if len(extra) or missing:
            self.index.save(namespace)
        self._synced.add(namespace)
        return len(missing) + len(extra)

    def search(self, query: str, namespace: str = "default", k: int | None = None) -> list[ChunkHit]:
        return [hit for hit, _ in self._retrieve(query, namespace, k)]

    def _retrieve(self, query: str, namespace: str, k: int | None) -> list[tuple[ChunkHit, Chunk]]:
        """The top-k chunks for `query`, best first, with their rows."""
        _check_query(query)
        if namespace not in self._synced:
            self.sync_index(namespace)
        found = self.index.search(namespace, self.embedder.embed([query])[0], k or self.settings.top_k)
        if not found:
            return []
        with self.db.session() as s:
            rows = {c.id: (c, d.external_id) for c, d in s.execute(
                select(Chunk, DocRow).join(DocRow, DocRow.id == Chunk.document_id).where(
                    Chunk.id.in_([i for i, _ in found]), Chunk.namespace == namespace))}
        return [(ChunkHit(i, rows[i][1], score, rows[i][0].text), rows[i][0]) for i, score in found if i in rows]

    # ---- generation ----------------------------------------------------------------------------

    def policy_for(self, mode: str, ratio: float | None = None, k: int | None = None):
        """A selection policy; `auto` is what `ragcache calibrate` chose for this model."""
        if mode == "auto":
            with self.db.session() as s:
                default = s.get(ModelDefault, self.model.fingerprint)
            if default is None:
                mode = "cacheblend"
            else:
                mode = default.mode
                ratio = default.param if mode == "cacheblend" else ratio
                k = int(default.param) if mode == "epic" and default.param is not None else k
        knobs = {"cacheblend": {"ratio": self.settings.cacheblend_ratio if ratio is None else ratio},
                 "epic": {"k": self.settings.epic_k if k is None else k}}.get(mode, {})
        try:
            return make_policy(mode, **knobs)
        except ValueError as e:  # an unknown mode or a knob out of range, named by blend
            raise UserError(str(e)) from None

    def load_chunks(self, token_ids: list[torch.Tensor], namespace: str) -> tuple[list[ChunkKV], list[str]]:
        """KV of each chunk and where it came from; missing or corrupt ones are computed and stored."""
        keys = [self.kv_key_of(ids, namespace) for ids in token_ids]
        hits = self.store.get_many(keys)
        chunks, tiers = [], []
        for ids, key, hit in zip(token_ids, keys, hits):
            if hit is not None:
                chunks.append(decode_kv(hit.entry, self.model.dtype, self.model.device))
                tiers.append(hit.tier)
                continue
            kv = self.compute_chunk_kv(ids)
            self.store.put(key, self.store_encode(kv))
            chunks.append(kv)
            tiers.append("computed")
        return chunks, tiers

    def generate(self, query: str, namespace: str = "default", top_k: int | None = None, mode: str | None = None,
                 ratio: float | None = None, k: int | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> dict:
        _check_query(query)
        policy = self.policy_for(mode or self.settings.mode, ratio, k)
        try:
            sampling = Sampling(max_new_tokens or self.settings.max_new_tokens, temperature, top_p, seed)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.warm(namespace)
        with self._lock:
            t0 = time.perf_counter()
            found = self._retrieve(query, namespace, top_k)
            if not found:
                raise UserError(f"namespace {namespace!r} has no precomputed chunks: run ingest and precompute")
            t_retrieve = time.perf_counter()
            hits, rows = zip(*found)
            self._check_model(rows)
            token_ids = [unpack_ids(row.token_ids) for row in rows]
            if policy.reads_chunk_kv:
                chunks, tiers = self.load_chunks(token_ids, namespace)
            else:  # full prefill: nothing comes from the cache
                chunks, tiers = [tokens_only(ids) for ids in token_ids], ["computed"] * len(token_ids)
            t_load = time.perf_counter()
            suffix = as_ids(encode(self.tokenizer, "Question: " + query) + self.frame.tail)
            fused = fuse_and_prefill(self.runner, self.prefix, chunks, suffix, policy,
                                     headroom=sampling.max_new_tokens)
            int(fused.logits.argmax())  # the first token is known (and a GPU synchronised): TTFT ends
            t_first = time.perf_counter()
            answer_ids = decode(self.runner, fused.cache, fused.logits, sampling, self.stops)
            t_end = time.perf_counter()
            self.runner.release(fused.cache)
        prompt = fused.layout.total
        recomputed = int(fused.kv_rows[-1].numel())
        ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
        return {
            "answer": self.tokenizer.decode(answer_ids, skip_special_tokens=True).strip(),
            "chunks": [{"id": h.id, "doc_id": h.doc_id, "score": round(h.score, 4), "tier": t}
                       for h, t in zip(hits, tiers)],
            "usage": {"prompt_tokens": prompt, "reused_tokens": prompt - recomputed,
                      "recomputed_tokens": recomputed, "completion_tokens": len(answer_ids)},
            "timings_ms": {"retrieve": ms(t0, t_retrieve), "load": ms(t_retrieve, t_load),
                           "blend": ms(t_load, t_first), "ttft": ms(t0, t_first), "decode": ms(t_first, t_end),
                           "total": ms(t0, t_end)},
        }

    def _check_model(self, chunks) -> None:
        other = {c.model for c in chunks} - {self.model.fingerprint}
        if other:
            raise UserError("these chunks were tokenized for another model; re-ingest the corpus with this one")

    def close(self) -> None:
        if "store" in self.__dict__:
            self.store.close()
        self.db.dispose()


def _check_query(query: str) -> None:
    if not query.strip():
        raise UserError("the query is empty")
