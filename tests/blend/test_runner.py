"""Our forward pass against transformers' on the real SmolLM2 and on tiny random models of each shape."""
from __future__ import annotations

import pytest
import torch

from blend.decode import Sampling, decode, pick
from blend.prompt import stop_token_ids

TOL = 1e-4  # float32 logits


def _ids(runner, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, runner.embed.shape[0], (n,), generator=g)


def test_prefill_matches_hf_forward(arch):
    hf, runner = arch
    ids = _ids(runner, 300)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0, -1]
    out = runner.prefill(ids)
    assert out.k.shape == (runner.num_layers, runner.num_kv_heads, 300, runner.head_dim)
    assert (out.logits - ref).abs().max() <= TOL


def test_prefill_kv_matches_hf_cache(arch):
    hf, runner = arch
    ids = _ids(runner, 64, seed=1)
    with torch.inference_mode():
        past = hf(ids[None], use_cache=True).past_key_values
    out = runner.prefill(ids)
    for l in (0, runner.num_layers - 1):
        hk, hv = past.layers[l].keys[0], past.layers[l].values[0]  # (Hkv, n, hd)
        # float32 with different GEMM kernels: ~1e-6 relative on values up to ~20
        assert torch.allclose(out.k[l], hk, rtol=1e-5, atol=1e-4) and torch.allclose(out.v[l], hv, rtol=1e-5, atol=1e-4)


def test_forward_selected_over_all_rows_equals_prefill(arch):
    _, runner = arch
    ids = _ids(runner, 200, seed=2)
    pre = runner.prefill(ids)
    cache = runner.new_cache(256)
    sel = runner.forward_selected(cache, ids, torch.arange(200))
    assert (sel.logits - pre.logits).abs().max() <= TOL
    assert torch.allclose(cache.k[:, :, :200], pre.k, atol=1e-5)
    assert torch.allclose(cache.v[:, :, :200], pre.v, atol=1e-5)


def test_forward_selected_behind_a_cached_prefix_equals_prefill(arch):
    """Rows 150..199 recomputed against cached rows 0..149: what a prefix cache does."""
    _, runner = arch
    ids = _ids(runner, 200, seed=3)
    pre = runner.prefill(ids)
    cache = runner.new_cache(200)
    cache.k[:, :, :150], cache.v[:, :, :150] = pre.k[:, :, :150], pre.v[:, :, :150]
    cache.length = 150
    sel = runner.forward_selected(cache, ids[150:], torch.arange(150, 200))
    assert (sel.logits - pre.logits).abs().max() <= TOL


def test_appending_a_token_never_changes_earlier_rows(arch):
    _, runner = arch
    ids = _ids(runner, 120, seed=4)
    short, long = runner.prefill(ids[:-1]), runner.prefill(ids)
    # the same rows through GEMMs of 119 and 120 rows: the BLAS may order their sums differently
    # (1.6e-5 seen on an AVX2 EPYC); a causality bug would move them by orders of magnitude more
    assert torch.allclose(long.k[:, :, :-1], short.k, atol=TOL)
    assert torch.allclose(long.v[:, :, :-1], short.v, atol=TOL)
    a, b = runner.new_cache(128), runner.new_cache(128)
    la = runner.forward_selected(a, ids[:-1], torch.arange(119), all_logits=True).logits
    lb = runner.forward_selected(b, ids, torch.arange(120), all_logits=True).logits
    assert (lb[:-1] - la).abs().max() <= TOL


def test_greedy_decode_equals_generate(arch):
    hf, runner = arch
    ids = _ids(runner, 80, seed=5)
    stops = stop_token_ids(runner.model.tokenizer, runner.model.config)
    with torch.inference_mode():
        ref = hf.generate(ids[None], attention_mask=torch.ones(1, 80, dtype=torch.long), max_new_tokens=32,
                          do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)[0, 80:].tolist()
    while ref and ref[-1] in stops:
        ref.pop()
    pre = runner.prefill(ids)
    cache = runner.new_cache(80)  # too small on purpose: decode grows it
    cache.k[:, :, :80], cache.v[:, :, :80] = pre.k, pre.v
    cache.length = 80
    assert decode(runner, cache, pre.logits, Sampling(max_new_tokens=32), stops) == ref


def test_sampling_is_seeded_and_respects_top_p():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0])
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    s = Sampling(max_new_tokens=1, temperature=1.0, top_p=0.5)
    assert {pick(logits, s, g()) for _ in range(20)} == {0}  # token 0 alone holds > 50%
    wide = Sampling(max_new_tokens=1, temperature=5.0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    assert len({pick(logits, wide, gen) for _ in range(200)}) == 4
    with pytest.raises(ValueError):
        Sampling(top_p=0)


def test_position_limit_is_checked(arch):
    _, runner = arch
    with pytest.raises(ValueError, match="exceeds"):
        runner.prefill(torch.tensor([5]), positions=torch.tensor([runner.max_positions]))
