"""The tiered chunk-KV store. `open_store` builds the tiers the settings ask for.

    gpu (CUDA only) → cpu → disk (RAGCACHE_HOME/kv) → redis (when RAGCACHE_REDIS_URL is set)

Layers never import upward: tiers know bytes or tensors, `tiered.py` knows tiers and SQL. Blobs are
written by a codec (codec.py: raw, or compact.py's, chosen in codecs.py); compact hits decode a layer at a
time beside the prefill (layers.py); admission.py decides which query-time misses are written.

May import: config, errors, meta, database (and blend).
"""
from __future__ import annotations

import secrets

import torch

from ..config import Settings
from ..database import Database
from .codec import CorruptBlob, StoredKV, decode, encode, kv_key
from .disk import DiskTier
from .ledger import ensure_store
from .memory import MemoryTier
from .tier import StoreFull
from .tiered import Hit, TieredStore

__all__ = ["CorruptBlob", "Hit", "StoreFull", "StoredKV", "TieredStore", "decode", "encode", "kv_key", "open_store"]


def open_store(settings: Settings, db: Database) -> TieredStore:
    memory = []
    if torch.cuda.is_available() and settings.gpu_cache_bytes > 0:
        memory.append(MemoryTier("gpu", "cuda", settings.gpu_cache_bytes))
    memory.append(MemoryTier("cpu", "cpu", settings.cpu_cache_bytes))
    blobs = [DiskTier(settings.home / "kv", settings.disk_cache_bytes)]
    if settings.redis_url:
        from .redis import STORE_ID, RedisTier

        token = ensure_store(db, STORE_ID, secrets.token_hex(8))  # this deployment's key prefix, made once
        blobs.append(RedisTier(settings.redis_url, settings.redis_cache_bytes, token))
    return TieredStore(db, memory, blobs, policy=settings.eviction, write_back=settings.write_policy == "write-back",
                       orphan_grace_s=settings.orphan_grace_s)
