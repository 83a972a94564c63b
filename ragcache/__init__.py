"""ragcache: a RAG serving cache of precomputed chunk KV, stitched and repaired at query time.

    from ragcache import RagCache, Settings
    rc = RagCache(Settings())            # RAGCACHE_* environment variables apply
    rc.ingest("docs.jsonl"); ...         # then `ragcache precompute`
    rc.generate("a question", mode="cacheblend")
"""
from __future__ import annotations


def __getattr__(name: str):
    """Lazy: `ragcache --help` should not wait for torch."""
    if name == "RagCache":
        from .service import RagCache

        return RagCache
    if name == "Settings":
        from .config import Settings

        return Settings
    raise AttributeError(name)
