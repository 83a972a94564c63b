"""`ragcache bench store`, by part (--parts, all by default):

    throughput  a CPU-tier and a disk-tier load beside plain copies of the same bytes
    codecs      each codec on real chunk KV: bits per element, × smaller than bf16, encode/decode GB/s (one core)
    fidelity    ΔKL per mode of each codec against the float32 store (`evaluate`, --limit questions, --passages)
    ttft        TTFT from disk (page cache dropped) and Redis, decode first vs layer-wise, per codec
    trace       admission on synthetic traces (--trace Zipf exponents): prefill saved, bytes written
    zipf        LRU vs GDSF (by measured prefill cost and by length) in the CPU tier on a Zipf stream
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from blend import ChunkKV

from ..database import Database
from ..store import TieredStore, decode, encode
from ..store.disk import DiskTier
from ..store.memory import MemoryTier
from ..evaluation.evaluate import load_dataset
from .timing import interleaved, median, table

# one 512-token SmolLM2 chunk: 30 layers × 3 KV heads × 64 dims, K and V
SHAPE = (30, 3, 512, 64)


def _chunk(seed: int, n: int = 512) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = SHAPE[:2] + (n,) + SHAPE[3:]
    return ChunkKV(torch.randint(0, 49152, (n,), generator=g), torch.randn(shape, generator=g),
                   torch.randn(shape, generator=g), 0, "")


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _store(db, root: Path, cpu_bytes: int, policy: str = "lru") -> TieredStore:
    return TieredStore(db, [MemoryTier("cpu", "cpu", cpu_bytes)], [DiskTier(root, 1 << 40)], policy=policy)


def _throughput(root: Path, repeats: int) -> list[list]:
    db = Database(f"sqlite:///{root / 'meta.db'}")
    store = _store(db, root / "kv", 1 << 34)
    entry = encode(_chunk(0), "float32")
    store.put("c", entry)
    path = next((root / "kv").glob("*/c.safetensors"))
    size = path.stat().st_size
    dest = torch.empty(SHAPE)

    def cpu_tier():  # what a request does with a CPU hit: fetch, then copy into the fused cache
        hit = store.get("c")
        dest.copy_(decode(hit.entry, torch.float32, torch.device("cpu")).k)
        dest.copy_(hit.entry.v)

    src_k, src_v = entry.k.clone(), entry.v.clone()

    def plain_copy():
        dest.copy_(src_k)
        dest.copy_(src_v)

    cold = _store(db, root / "kv", 0)  # no memory tier room: every get reads the disk

    def disk_tier():
        _drop_cache(path)
        hit = cold.get("c")
        dest.copy_(decode(hit.entry, torch.float32, torch.device("cpu")).k)

    def raw_read():
        _drop_cache(path)
        with open(path, "rb") as f:
            buf = f.read()
        dest.copy_(torch.frombuffer(bytearray(buf[-dest.nbytes:]), dtype=torch.float32).view(SHAPE))

    times = interleaved({"cpu tier get": cpu_tier, "memcpy same bytes": plain_copy, "disk tier get": disk_tier,
                         "raw read same file": raw_read}, repeats)
    gb = entry.nbytes / 1e9
    rows = [[name, median(t) * 1000, gb / median(t)] for name, t in times.items()]
    rows[0].append(f"{median(times['memcpy same bytes']) / median(times['cpu tier get']):.2f} of memcpy")
    rows[1].append("")
    rows[2].append(f"{median(times['raw read same file']) / median(times['disk tier get']):.2f} of raw read")
    rows[3].append("")
    print(f"entry: {SHAPE} float32 K and V = {entry.nbytes / 1e6:.1f} MB ({size / 1e6:.1f} MB on disk); "
          f"page cache dropped per read with posix_fadvise(DONTNEED); median of {repeats}")
    print(table(rows, ["load", "ms", "GB/s", "ratio"]))
    db.dispose()
    return rows


def _prefill_seconds(settings, sizes: list[int], repeats: int) -> dict[int, float]:
    """Measured prefill time of a chunk of each size on the configured model (median, interleaved)."""
    from blend import Runner, compute_chunk, load_model

    runner = Runner(load_model(settings.model, settings.home, settings.device, settings.dtype))
    ids = {n: torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)) for n in sizes}
    times = interleaved({n: (lambda n=n: compute_chunk(runner, ids[n])) for n in sizes}, repeats)
    return {n: median(t) for n, t in times.items()}


def _hit_rates(settings, root: Path, repeats: int, requests: int = 10_000, chunks: int = 1000) -> None:
    """LRU vs GDSF on a Zipf stream; a miss costs the measured prefill of its chunk's length."""
    grid = [64, 128, 256, 384, 512]
    measured = _prefill_seconds(settings, grid, repeats)
    rng = np.random.default_rng(0)
    ranks = rng.zipf(1.1, size=requests * 3)
    stream = [int(r) - 1 for r in ranks if r <= chunks][:requests]
    sizes = rng.integers(64, 513, size=chunks)  # chunks hold 64..512 tokens
    cost = {i: float(np.interp(sizes[i], grid, [measured[n] for n in grid])) for i in range(chunks)}
    tiny = {i: _chunk(i, n=int(sizes[i])) for i in range(chunks)}
    tiny = {i: ChunkKV(c.token_ids, c.k[:1, :1, :, :4].clone(), c.v[:1, :1, :, :4].clone(), 0, "")
            for i, c in tiny.items()}  # bytes ∝ tokens, kept small to run fast
    room = sum(encode(c, "float32").nbytes for c in tiny.values()) // 10
    rows = []
    for policy, measured_cost in (("lru", False), ("gdsf", False), ("gdsf", True)):
        name = f"{policy}-{'measured' if measured_cost else 'tokens'}"
        db = Database(f"sqlite:///{root / f'zipf-{name}.db'}")
        store = TieredStore(db, [MemoryTier("cpu", "cpu", room)], [DiskTier(root / f"zipf-{name}", 1 << 40)],
                            policy=policy)
        spent = 0.0
        for i in stream:
            if store.memory[0].contains(f"c{i}"):
                store.get(f"c{i}")
                continue
            spent += cost[i]  # a miss: recomputed and stored
            entry = encode(tiny[i], "float32")
            entry.cost_s = cost[i] if measured_cost else None  # None: cost = its length in tokens
            store.put(f"c{i}", entry)
        everything = sum(cost[i] for i in stream)
        rows.append([policy, "measured prefill s" if measured_cost else "tokens", store.hits["cpu"] / len(stream),
                     spent, 1 - spent / everything])
        db.dispose()
    print("\nprefill seconds by chunk length (this model, median of %d)" % repeats)
    print(table([[n, measured[n], measured[n] / n * 1000] for n in grid], ["tokens", "s", "ms per token"]))
    print(f"\nZipf(1.1) over {chunks} chunks of 64–512 tokens, {len(stream)} requests, CPU tier holds 10% of the "
          "bytes; a miss costs its measured prefill")
    print(table(rows, ["policy", "cost", "cpu hit rate", "recompute s", "prefill time saved"]))


def _codec_parts(settings, args, root: Path, parts: set[str]) -> None:
    from ..service import RagCache
    from .store_codec import fidelity, print_fidelity, print_sizes, real_chunks, sizes_and_speeds
    from .store_ttft import print_ttft, ttft
    from .timeline import print_timeline

    item = load_dataset(Path(args.dataset), None)[args.question]
    passages = args.passages or [4, 10]
    with RagCache(settings) as service:
        if "codecs" in parts:
            chunks = real_chunks(service, item, max(passages))
            rows = sizes_and_speeds(service, chunks, args.codecs, args.repeats)
            print_sizes(rows, chunks, service.model)
            measured = {r[0]: (r[1], r[4]) for r in rows if r[0] not in ("raw float32", "raw bfloat16")}
            print_timeline({"raw bf16": (16.0, None), **measured})  # an 8B bf16 blob needs no decode
        if "ttft" in parts:
            rows = []
            for n in passages:
                rows += ttft(service, item, real_chunks(service, item, n), ["raw", *args.codecs], root, args.repeats)
            print_ttft(rows, args.repeats)
        if "fidelity" in parts:
            how = args.chunk_prefill or "prefixed"
            print_fidelity(fidelity(service, args.dataset, args.codecs, passages, args.limit, root, how), args.limit,
                           how)


def run(settings, args) -> int:
    parts = set(args.parts)
    with tempfile.TemporaryDirectory(dir=settings.home if settings.home.exists() else None) as tmp:
        root = Path(tmp)
        if "throughput" in parts:
            _throughput(root, args.repeats)
        if parts & {"codecs", "ttft", "fidelity"}:
            _codec_parts(settings, args, root, parts)
        if "trace" in parts:
            from .trace import prefill_flops, report

            bytes_per_token = 2 * SHAPE[0] * SHAPE[1] * SHAPE[3] * 4  # SmolLM2 float32 K and V
            rows = report(prefill_flops, args.trace, bytes_per_token)
            print("\nadmission of query-time misses into one blob tier (capacity a share of the trace's distinct "
                  "chunks' bytes), a miss costing its prefill FLOPs; ratios against LRU without admission")
            print(table(rows, ["zipf s", "capacity", "eviction", "admission", "hit rate", "prefill work saved",
                               "GB written", "saved ÷ LRU's", "written ÷ LRU's"]))
        if "zipf" in parts:
            _hit_rates(settings, root, args.repeats)
    return 0
