"""The repair after the first token (mode `deferred`): each sequence's prompt and first token fused again from
its chunk KV by its repair policy, batched, as the scheduler's steps and the sequential path run it.

    errors = repair(runner, kv_cache_dtype, [seq_a, seq_b])   # each None (repaired) or what failed it

A sequence's old cache is released first (the repair does not read it), so a repair holds no more KV than
the request reserved. A batch that raises is tried one sequence at a time, so that only a sequence that
fails alone fails.
"""
from __future__ import annotations

from blend.batch import fuse_batch

from .sequence import Sequence


def repair(runner, kv_cache_dtype, seqs: list[Sequence]) -> list[Exception | None]:
    for seq in seqs:
        if seq.cache is not None:
            runner.release(seq.cache)
            seq.cache = None
    return _batch(runner, kv_cache_dtype, seqs)


def _batch(runner, kv_cache_dtype, seqs: list[Sequence]) -> list[Exception | None]:
    try:
        fused = fuse_batch(runner, [seq.prep.repair_args(seq.token) for seq in seqs])
    except Exception as e:  # noqa: BLE001 — alone, each sequence fails or is repaired on its own
        if len(seqs) > 1:
            return [error for seq in seqs for error in _batch(runner, kv_cache_dtype, [seq])]
        return [e]
    errors: list[Exception | None] = []
    for seq, f in zip(seqs, fused):
        try:
            f.cache = runner.compact(f.cache, kv_cache_dtype)  # RAGCACHE_KV_CACHE_DTYPE, as a started sequence's
        except Exception as e:  # noqa: BLE001
            runner.release(f.cache)
            errors.append(e)
            continue
        seq.repaired(f)
        errors.append(None)
    return errors
