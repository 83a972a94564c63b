"""How many fused prefills run at once: where their caches are compacted, a group on the CPU.

    batch = admission.take_prefill(layers, long_ok, group_size(runner, kv_cache_dtype))   # a step's prompts
    for group in groups(runner, kv_cache_dtype, batch): ...    # the deferred repairs of a step, group by group

Where running sequences keep a compact copy of the fused cache (`RAGCACHE_KV_CACHE_DTYPE` below the model's
dtype) on the CPU, a group is as many requests as the runner keeps spare working caches: each group's float
caches are compacted and go back before the next group assembles, so it writes into pages the last one left
warm. Sixteen fresh working caches at once (113 MB each at 2.5K tokens) took 1.4-3x as long as groups of two
to four, and batching them gained nothing on the CPU. A step prefills one group of prompts, so the running
sequences decode between a burst's groups and its first groups answer sooner: at 16 clients the median TTFT
fell from 1.7 to 0.4 s at the same tokens/s (BENCHMARKS.md, "A burst's prefill in groups"). A step's deferred
repairs run group by group within it. Elsewhere (float caches kept as they are, or CUDA's caching allocator)
there is no limit.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from blend.runner import SPARE_CACHES

T = TypeVar("T")


def group_size(runner, kv_cache_dtype: torch.dtype) -> int | None:
    """The most fused prefills to run at once; None: no limit."""
    return SPARE_CACHES if kv_cache_dtype != runner.dtype and runner.device.type == "cpu" else None


def groups(runner, kv_cache_dtype: torch.dtype, batch: Sequence[T]) -> list[Sequence[T]]:
    size = group_size(runner, kv_cache_dtype) or max(len(batch), 1)
    return [batch[i : i + size] for i in range(0, len(batch), size)]
