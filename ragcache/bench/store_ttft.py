"""TTFT from a blob tier (disk with its page cache dropped, or Redis), per codec, with the chunk KV
decoded first or layer by layer beside the fused prefill (`store/layers.py`)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from blend import CacheBlend, Reuse, fuse_and_prefill
from blend.prompt import as_ids, encode as tokenize

from ..database import Database
from ..store import TieredStore, decode, encode
from ..store.disk import DiskTier
from ..store.layers import decode_layerwise
from ..store.memory import MemoryTier
from .timing import interleaved, median, table

MODES = {"reuse": Reuse(), "cacheblend@0.15": CacheBlend(0.15)}


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _tiers(settings, root: Path) -> dict:
    tiers = {"disk (cold)": DiskTier(root / "kv", 1 << 40)}
    url = settings.redis_url or "redis://127.0.0.1:6379/0"
    try:
        from ..store.redis import RedisTier

        redis = RedisTier(url, 1 << 40, f"bench{secrets.token_hex(4)}")
        redis.ping()
        tiers["redis"] = redis
    except Exception as e:  # noqa: BLE001 — no Redis here: measure the disk alone, and say so
        print(f"(no Redis at {url}: {e}; disk only)")
    return tiers


def ttft(service, item: dict, chunks: list, codecs: list[str], root: Path, repeats: int) -> list[list]:
    runner, m = service.runner, service.model
    suffix = as_ids(tokenize(service.tokenizer, "Question: " + item["question"]) + service.frame.tail)
    rows = []
    for source, tier in _tiers(service.settings, root).items():
        db = Database(f"sqlite:///{root / f'ttft-{len(chunks)}-{source[:4]}.db'}")
        store = TieredStore(db, [MemoryTier("cpu", "cpu", 0)], [tier])  # no memory room: every get reads the tier
        for codec in codecs:
            spec = service.codec_spec(codec)
            keys = [f"{codec}-{i}" for i in range(len(chunks))]
            for key, c in zip(keys, chunks):
                store.put(key, encode(c, "float32", spec, runner.inv_freq))
            paths = [p for k in keys for p in (root / "kv").glob(f"*/{k}.safetensors")]

            def request(mode: str, layerwise: bool):
                def go():
                    _drop_cache(paths)
                    entries = [hit.entry for hit in store.get_many(keys)]
                    kvs = (decode_layerwise(entries, m.dtype, m.device) if layerwise and spec is not None
                           else [decode(e, m.dtype, m.device) for e in entries])
                    out = fuse_and_prefill(runner, service.prefix, kvs, suffix, MODES[mode])
                    int(out.logits.argmax())  # the first token: TTFT ends here
                    runner.release(out.cache)
                return go

            steps = {(mode, lw): request(mode, lw) for mode in MODES for lw in (False, True)}
            times = {k: median(v) for k, v in interleaved(steps, repeats).items()}
            for mode in MODES:
                first, overlapped = times[mode, False], times[mode, True]
                rows.append([len(chunks), source, codec, mode, first * 1000, overlapped * 1000, first / overlapped])
            for key in keys:
                store.delete(key)
        db.dispose()
    return rows


def print_ttft(rows: list[list], repeats: int) -> None:
    print(f"\nTTFT from a blob tier, load + fused prefill to the first token (median of {repeats} interleaved "
          "repeats; disk: page cache dropped before each request): decode first vs layer by layer beside the "
          "prefill (raw blobs need no decode: both columns are the same path)")
    print(table(rows, ["passages", "from", "codec", "mode", "decode first ms", "layer-wise ms", "speedup"]))
