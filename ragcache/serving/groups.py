"""How many fused prefills run at once: a batch whose caches are compacted runs in groups on the CPU.

    for group in groups(runner, kv_cache_dtype, batch):
        ran = each_alone(group, lambda b: fuse_batch(runner, ...), fail)   # then compact each, as now

Where running sequences keep a compact copy of the fused cache (`RAGCACHE_KV_CACHE_DTYPE` below the model's
dtype) on the CPU, a group is as many requests as the runner keeps spare working caches: each group's float
caches are compacted and go back before the next group assembles, so it writes into pages the last one left
warm. Sixteen fresh working caches at once (113 MB each at 2.5K tokens) took 1.4-3x as long as groups of two
to four, and batching them gained nothing on the CPU (BENCHMARKS.md, "A burst's prefill in groups").
Elsewhere (float caches kept as they are, or CUDA's caching allocator) a batch runs whole.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from blend.runner import SPARE_CACHES

T = TypeVar("T")


def groups(runner, kv_cache_dtype: torch.dtype, batch: Sequence[T]) -> list[Sequence[T]]:
    compacting = kv_cache_dtype != runner.dtype and runner.device.type == "cpu"
    size = SPARE_CACHES if compacting else max(len(batch), 1)
    return [batch[i : i + size] for i in range(0, len(batch), size)]
