"""The repair after the first token (mode `deferred`): each sequence's prompt and first token fused again from
its chunk KV by its repair policy, batched (in `groups`), as the scheduler's steps and the sequential path run it.

    batch, long_one, wait, failed = take(waiting, cap, num_layers, long_ok)   # within a step's rows
    errors = repair(runner, kv_cache_dtype, [seq_a, seq_b])   # each None (repaired) or what failed it
    release(runner, seq); ...; error = finish(runner, kv_cache_dtype, seq, fused)   # one run in pieces

A sequence's old cache is released first (the repair does not read it), so a repair holds no more KV than
the request reserved. A batch that raises is tried one sequence at a time, so that only a sequence that
fails alone fails.
"""
from __future__ import annotations

from blend.batch import fuse_batch

from .alone import each_alone
from .groups import groups
from .sequence import Sequence


def repair(runner, kv_cache_dtype, seqs: list[Sequence]) -> list[Exception | None]:
    for seq in seqs:
        release(runner, seq)
    errors: dict[int, Exception] = {}
    for group in groups(runner, kv_cache_dtype, seqs):  # compacted: in groups, into warm pages
        ran = each_alone(group, lambda b: fuse_batch(runner, [seq.prep.repair_args(seq.token) for seq in b]),
                         lambda seq, e: errors.__setitem__(id(seq), e))
        for seq, f in ran:
            error = finish(runner, kv_cache_dtype, seq, f)
            if error is not None:
                errors[id(seq)] = error
    return [errors.get(id(seq)) for seq in seqs]


def take(items: list[tuple], cap: int, num_layers: int, long_ok: bool):
    """items [(ticket, seq)] waiting for their repair → (those whose recomputed rows fit `cap` together, one longer
    than `cap` to run in pieces (taken only when `long_ok`; else None), the rest (they wait), [(item, exception)]
    of those whose plan raised): the rule `Admission.take_prefill` keeps for prompts."""
    batch, long_one, wait, failed, rows = [], None, [], [], 0
    for item in items:
        try:
            n = item[1].prep.repair_rows(num_layers)
        except Exception as e:  # noqa: BLE001 — that request's own failure, for the scheduler to report
            failed.append((item, e))
            continue
        if rows + n <= cap:
            batch.append(item)
            rows += n
        elif n > cap and long_ok and long_one is None:
            long_one = item
        else:
            wait.append(item)
    return batch, long_one, wait, failed


def release(runner, seq: Sequence) -> None:
    """The sequence's cache goes back before its repair, which fuses from the chunk KV, not from it."""
    if seq.cache is not None:
        runner.release(seq.cache)
        seq.cache = None


def finish(runner, kv_cache_dtype, seq: Sequence, fused) -> Exception | None:
    """`seq` decodes on from its repair's `fused` result, its cache compacted as a started sequence's; else the
    error, the repair's cache released."""
    try:
        fused.cache = runner.compact(fused.cache, kv_cache_dtype)  # RAGCACHE_KV_CACHE_DTYPE
    except Exception as e:  # noqa: BLE001
        runner.release(fused.cache)
        return e
    seq.repaired(fused)
    return None
