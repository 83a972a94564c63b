"""A running sequence's compact KV (RAGCACHE_KV_CACHE_DTYPE): float32 is the working cache itself,
bfloat16 and int8 decode within a stated bound of it, and batched decoding over compact caches gives
each sequence what it gets alone."""
from __future__ import annotations

import pytest
import torch

from blend import KVCache, Runner
from blend.batch import decode_batch

# teacher-forced KL(float32 ‖ compact) of the next-token distribution, per decode step, on SmolLM2
KL_BOUND = {torch.bfloat16: 2e-3, torch.int8: 2e-3}


def _prompt(runner, n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 20000, (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(runner, ids: torch.Tensor, room: int) -> tuple[KVCache, torch.Tensor]:
    pre = runner.prefill(ids)
    cache = runner.new_cache(ids.numel() + room)
    cache.k[:, :, : ids.numel()], cache.v[:, :, : ids.numel()] = pre.k, pre.v
    cache.length = ids.numel()
    return cache, pre.logits


def _step(runner, cache: KVCache, token: int) -> torch.Tensor:
    return runner.forward_selected(cache, torch.tensor([token]), torch.tensor([cache.length])).logits


def test_float32_keeps_the_working_cache_itself(smol_runner):
    cache, _ = _prefilled(smol_runner, _prompt(smol_runner, 20, 0), 4)
    assert smol_runner.compact(cache, torch.float32) is cache
    assert cache.bytes_per_row() == 2 * 30 * 3 * 64 * 4
    smol_runner.release(cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_compact_decoding_stays_within_its_bound(smol_runner, dtype):
    """500 tokens of prompt, 4 decode steps fed float32's greedy picks: every step's distribution within
    KL_BOUND of float32's, and the compact cache a quarter (int8, scales included: 0.27) or half the bytes."""
    ref_cache, logits = _prefilled(smol_runner, _prompt(smol_runner, 500, 1), 4)
    cache = KVCache(ref_cache.k.clone(), ref_cache.v.clone(), ref_cache.length).compact(dtype)
    assert cache.dtype == dtype and cache.length == 500
    assert cache.bytes_per_row() / ref_cache.bytes_per_row() == (0.5 if dtype == torch.bfloat16 else (64 + 4) / 256)
    worst = 0.0
    for _ in range(4):
        token = int(logits.argmax())
        logits, ours = _step(smol_runner, ref_cache, token), _step(smol_runner, cache, token)
        kl = torch.nn.functional.kl_div(ours.log_softmax(-1), logits.log_softmax(-1), log_target=True,
                                        reduction="sum")
        worst = max(worst, float(kl))
    assert 0 < worst < KL_BOUND[dtype], worst
    smol_runner.release(ref_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_batched_decode_over_compact_caches_matches_each_alone(smol_runner, dtype):
    prompts = [_prompt(smol_runner, n, 10 + i) for i, n in enumerate([150, 41, 90])]
    alone, caches = [], []
    for p in prompts:
        cache, logits = _prefilled(smol_runner, p, 4)
        cache = smol_runner.compact(cache, dtype)
        token = int(logits.argmax())
        alone.append((token, _step(smol_runner, cache, token)))
        cache.length -= 1  # that step again, batched
        caches.append(cache)
    batched = decode_batch(smol_runner, caches, [t for t, _ in alone])
    for row, (_, ref) in enumerate(alone):
        # a batch's products and one row's may take different float32 GEMM kernels (an Intel AMX host: 1.9e-4 on
        # logits of 22 for bfloat16 caches): equal within 2e-5 of the logits' scale, a wrong row is off by ~1
        gap = float((batched[row] - ref).abs().max())
        assert gap <= 2e-5 * float(ref.abs().max()), (row, gap)
    assert [c.length for c in caches] == [p.numel() + 1 for p in prompts]


def test_int8_cache_grows_with_its_scales(smol_runner):
    cache, _ = _prefilled(smol_runner, _prompt(smol_runner, 10, 3), 1)
    exact = cache.k[2, :, :10].clone()
    small = smol_runner.compact(cache, torch.int8)  # the float32 one goes back to the runner
    k, v, ks, vs = small.layer(2, 10)
    small.reserve(50)
    assert small.capacity >= 50 and small.k_scale.shape[2] == small.capacity
    assert [torch.equal(a, b) for a, b in zip(small.layer(2, 10), (k, v, ks, vs))] == [True] * 4
    widened = small.float_layer(2, 10, torch.float32)[0]
    assert ((widened - exact).abs() <= ks[..., None] / 2 * (1 + 1e-5)).all()


def test_ape_decodes_over_an_int8_cache_within_its_bound(smol_runner):
    """APE's re-weighted pass reads a compact cache widened back to float32: one decode step after a reused
    fusion under APE lands within KL_BOUND of the same step over the float32 cache."""
    from blend import Reuse, compute_chunk, fuse_and_prefill
    from blend.reweight import Reweight, Reweighted

    g = torch.Generator().manual_seed(5)
    chunks = [compute_chunk(smol_runner, torch.randint(10, 20000, (n,), generator=g)) for n in (60, 40)]
    suffix = torch.randint(10, 20000, (6,), generator=g)
    fused = fuse_and_prefill(smol_runner, None, chunks, suffix, Reweighted(Reuse(), Reweight(1.0, 0.5)), headroom=2)
    assert fused.cache.reweight is not None
    small = KVCache(fused.cache.k.clone(), fused.cache.v.clone(), fused.cache.length).compact(torch.int8)
    small.reweight = fused.cache.reweight
    token = int(fused.logits.argmax())
    ref, ours = _step(smol_runner, fused.cache, token), _step(smol_runner, small, token)
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum")
    assert 0 < float(kl) < KL_BOUND[torch.int8], float(kl)


def test_a_compact_cache_let_go_is_where_the_next_compaction_writes_and_holds_the_same_bits(smollm):
    """A running sequence's cache (int8 or bfloat16) goes back to its runner when it finishes, and the next fused
    cache compacted to that dtype is written into it (fresh pages cost a 2-core VM ~3x the int8 pass itself). Its
    rows are what a new cache gets; the working caches' pool is apart (a float cache is never handed a compact
    one), and a compact cache too small for the rows is passed over."""
    runner = Runner(smollm)
    ids = _prompt(runner, 20, 0)
    for dtype in (torch.int8, torch.bfloat16):
        fused = lambda: _prefilled(runner, ids, 4)[0]  # noqa: E731 — a fresh working cache each time
        want = fused().compact(dtype)
        first = runner.compact(fused(), dtype)
        runner.release(first)
        assert runner.new_cache(24).dtype == runner.dtype  # the working pool: not the compact cache
        second = runner.compact(fused(), dtype)
        assert second.k.data_ptr() == first.k.data_ptr() and second.length == want.length == 20
        for got, ref in zip(second._parts(), want._parts()):
            assert torch.equal(got[:, :, :20], ref[:, :, :20])
        runner.release(second)
        longer = runner.compact(_prefilled(runner, _prompt(runner, 60, 1), 4)[0], dtype)  # 64 rows > 2 x 24
        assert longer.k.data_ptr() != first.k.data_ptr() and longer.capacity == 64


def test_a_chunk_prefilled_outside_inference_mode_may_reuse_a_spare_cache_made_inside_it(smol_runner):
    """`compute_chunk` behind a prefix takes a working cache from the runner's spares; one released under
    inference mode (a rerank's or a fused prefill's) is an inference tensor, which torch refuses to write
    outside it. `eval --rerank` hit that with a traceback; the chunk now computes the same either way."""
    from blend import compute_chunk, compute_prefix

    g = torch.Generator().manual_seed(3)
    prefix = compute_prefix(smol_runner, torch.randint(10, 20000, (12,), generator=g))
    ids = torch.randint(10, 20000, (30,), generator=g)
    with torch.inference_mode():
        want = compute_chunk(smol_runner, ids, prefix)
        smol_runner.release(smol_runner.new_cache(len(prefix) + len(ids)))  # an inference-mode spare that fits
    got = compute_chunk(smol_runner, ids, prefix)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_a_spare_made_under_inference_mode_is_not_handed_to_a_caller_outside_it(smollm):
    """Any working cache taken outside inference mode must be writable there, whichever spares are pooled. A
    runner of its own: the shared one's pool may be full already, and a full pool keeps no more."""
    smol_runner = Runner(smollm)
    with torch.inference_mode():
        smol_runner.release(smol_runner.new_cache(24))
    cache, _ = _prefilled(smol_runner, _prompt(smol_runner, 20, 0), 4)  # writes into a cache of 24 rows
    assert not cache.k.is_inference()
    smol_runner.release(cache)
    with torch.inference_mode():  # the inference spare still serves a caller inside it
        assert smol_runner.new_cache(24).k.is_inference()
