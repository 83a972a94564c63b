"""The facade the CLI, the evaluation, the demo and the REST API call: the shared parts plus one
object per role.

    rc = RagCache(Settings())
    rc.corpus      documents in and out, retrieval (corpus/corpus.py)
    rc.generation  retrieve → load → blend → decode, streamed (serving/generation.py)
    rc.cache       lookups, pins, evictions, tier statistics (cache_admin.py)
    rc.jobs        precompute jobs in child processes (jobs/launcher.py)
    rc.requests    the recent requests a server answered (serving/recent.py)

`generate`, `ingest`, `search` and friends stay here as one-liners: the Python API of the README.
"""
from __future__ import annotations

from pathlib import Path

from blend.batch import warm_decode

from .cache_admin import CacheAdmin
from .config import Settings
from .corpus.corpus import ChunkHit, Corpus
from .corpus.ingest import IngestReport
from .jobs.launcher import Jobs
from .parts import Parts
from .serving.generation import Ask, Generation
from .serving.policy import within_depth
from .serving.recent import RequestLog

__all__ = ["Ask", "ChunkHit", "RagCache"]


class RagCache(Parts):
    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        self.corpus = Corpus(self)
        self.generation = Generation(self, self.corpus)
        self.cache = CacheAdmin(self, self.corpus)
        self.jobs = Jobs(self)
        self.requests = RequestLog()

    def __enter__(self) -> "RagCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm(self, namespace: str | None = "default") -> None:
        """Load every part a request touches, so that request timings hold no one-time work."""
        _ = self.runner, self.prefix, self.stops, self.store, self.embedder, self.index
        _ = self.kv_codec  # a codec that cannot be built (`+f` never calibrated) fails here, not in a request
        within_depth(self.settings, self.runner.num_layers)  # so does a probe set deeper than the model
        if namespace is not None and (self.settings.chunk_prefill != "lead" or self.corpus.counts(namespace)):
            self.chunk_prefix(namespace)  # a lead is picked once the namespace holds chunks
        warm_decode(self.runner, self.kv_cache_dtype)
        if self.settings.retrieval != "dense":
            _ = self.lexical
        if namespace is not None:
            self.corpus.refresh(namespace)

    def ingest(self, path: str | Path, namespace: str = "default") -> IngestReport:
        return self.corpus.ingest(path, namespace)

    def counts(self, namespace: str | None = None) -> dict[str, int]:
        return self.corpus.counts(namespace)

    def sync_index(self, namespace: str) -> int:
        return self.corpus.sync_index(namespace)

    def search(self, query: str, namespace: str = "default", k: int | None = None,
               retrieval: str | None = None) -> list[ChunkHit]:
        return self.corpus.search(query, namespace, k, retrieval)

    def policy_for(self, mode: str, ratio: float | None = None, k: int | None = None,
                   target_kl: float | None = None):
        return self.generation.policy_for(mode, ratio, k, target_kl)

    def generate(self, query: str, namespace: str = "default", top_k: int | None = None, mode: str | None = None,
                 ratio: float | None = None, k: int | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, retrieval: str | None = None,
                 rerank: int | None = None, target_kl: float | None = None, stop: tuple[str, ...] = ()) -> dict:
        return self.generation.generate(Ask(query, namespace, top_k, mode, ratio, k, max_new_tokens, temperature,
                                            top_p, seed, retrieval=retrieval, rerank=rerank, target_kl=target_kl,
                                            stop=stop))

    def close(self) -> None:
        self.jobs.close()
        self.corpus.close()
        super().close()
