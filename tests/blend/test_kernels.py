"""Each Triton kernel against its torch reference (TRITON_INTERPRET=1 on CPU; natively on CUDA)."""
from __future__ import annotations

import threading

import pytest
import torch

from blend.kernels import reference
from blend.rope import delta_cos_sin

triton_ops = pytest.importorskip("blend.kernels.triton_ops")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,n,hd", [(6, 37, 64), (90, 5, 32), (1, 130, 128)])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_realign_rope_matches_reference(dtype, b, n, hd, out_of_place):
    src = _randn(b, n, hd, dtype=dtype)
    delta = torch.randint(-500, 5000, (n,), generator=torch.Generator().manual_seed(1))
    cos, sin = (t.to(DEVICE) for t in delta_cos_sin(delta, 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))))
    ours, ref = src.clone(), src.clone()
    # a strided destination, as a slice of a bigger cache is
    big = torch.zeros(b, n + 7, hd, dtype=dtype, device=DEVICE)
    dst = big[:, 3 : 3 + n] if out_of_place else ours
    triton_ops.realign_rope_(dst, cos, sin, src if out_of_place else None)
    reference.realign_rope_(ref, cos, sin)
    assert torch.allclose(dst.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if out_of_place:
        assert big[:, :3].abs().sum() == 0 and big[:, 3 + n :].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,cap,hd,n", [(3, 200, 64, 17), (8, 64, 128, 64), (1, 50, 16, 1)])
def test_deviation_scatter_matches_reference(dtype, hkv, cap, hd, n):
    cache = _randn(hkv, cap, hd, dtype=dtype)
    rows = torch.randperm(cap, generator=torch.Generator().manual_seed(2))[:n].to(DEVICE)
    new = _randn(n, hkv, hd, dtype=dtype, seed=3)
    c_ours, c_ref = cache.clone(), cache.clone()
    d_ours = triton_ops.deviation_scatter_(c_ours, rows, new)
    d_ref = reference.deviation_scatter_(c_ref, rows, new)
    assert torch.equal(c_ours, c_ref)
    assert torch.allclose(d_ours, d_ref, rtol=1e-4, atol=1e-4)


def _rows(kind: str, t: int, n: int) -> torch.Tensor:
    if kind == "contiguous":
        return torch.arange(t - n, t)
    if kind == "prefill":
        return torch.arange(n)
    return torch.randperm(t, generator=torch.Generator().manual_seed(4))[:n].sort().values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,hd", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("kind,t,n", [("scattered", 300, 70), ("contiguous", 150, 20), ("prefill", 90, 90),
                                      ("scattered", 130, 1)])
def test_selected_attention_matches_reference(dtype, h, hkv, hd, kind, t, n):
    q = _randn(n, h, hd, dtype=dtype, seed=5)
    k, v = _randn(hkv, t, hd, dtype=dtype, seed=6), _randn(hkv, t, hd, dtype=dtype, seed=7)
    pos = _rows(kind, t, n).to(DEVICE)
    ours = triton_ops.selected_attention(q, k, v, pos, hd**-0.5)
    ref = reference.selected_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), pos.cpu(), hd**-0.5)
    assert torch.allclose(ours.cpu().float(), ref, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)


def test_selected_attention_reference_is_causal_by_absolute_position():
    """A naive softmax over keys ≤ each row's position, written out: the oracle's oracle."""
    q, k, v = torch.randn(12, 4, 16), torch.randn(2, 100, 16), torch.randn(2, 100, 16)
    pos = torch.tensor([0, 3, 4, 5, 40, 41, 60, 61, 62, 63, 97, 99])
    out = reference.selected_attention(q, k, v, pos, 0.25)
    for i, p in enumerate(pos.tolist()):
        for head in range(4):
            kv = head // 2
            w = torch.softmax(q[i, head] @ k[kv, : p + 1].T * 0.25, dim=0)
            assert torch.allclose(out[i, head], w @ v[kv, : p + 1], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,n,hd", [(90, 33, 64), (4, 1, 128), (1, 200, 16)])
def test_dequantize_int8_matches_reference(dtype, b, n, hd):
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (b, n, hd), generator=g, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(b, n, generator=g) * 0.1).to(DEVICE)
    ours = triton_ops.dequantize_int8(q, scale, dtype)
    ref = reference.dequantize_int8(q, scale, dtype)
    assert ours.dtype == dtype
    # bfloat16: the interpreter may round the last bit differently from torch; one ulp apart at most
    assert torch.allclose(ours.float(), ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,hd", [(9, 3, 64), (8, 1, 128)])
def test_varlen_attention_matches_reference(dtype, h, hkv, hd):
    """Sequences of different lengths, each in its own cache (own capacity): a decode row, a recompute
    block longer than one program's rows, scattered rows, a single early row."""
    from blend.kernels import triton_varlen

    caps, lens = [40, 160, 90, 20], [33, 150, 90, 3]
    rows = [torch.tensor([32]), torch.arange(70, 150), _rows("scattered", 90, 17), torch.tensor([1])]
    caches = [(_randn(hkv, c, hd, dtype=dtype, seed=10 + i), _randn(hkv, c, hd, dtype=dtype, seed=20 + i))
              for i, c in enumerate(caps)]
    ks, vs = [k[:, :n] for (k, _), n in zip(caches, lens)], [v[:, :n] for (_, v), n in zip(caches, lens)]
    q = _randn(sum(r.numel() for r in rows), h, hd, dtype=dtype, seed=9)
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + r.numel())
    pos = torch.cat(rows).to(DEVICE)
    ours = triton_varlen.varlen_attention(q, ks, vs, pos, cu, hd**-0.5)
    ref = reference.varlen_attention(q.cpu().float(), [k.cpu().float() for k in ks], [v.cpu().float() for v in vs],
                                     pos.cpu(), cu, hd**-0.5)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):  # and each sequence is what it gets alone
        alone = reference.selected_attention(q[a:b].cpu().float(), ks[i].cpu().float(), vs[i].cpu().float(),
                                             pos[a:b].cpu(), hd**-0.5)
        assert torch.equal(ref[a:b], alone)
    assert torch.allclose(ours.cpu().float(), ref, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,hd,n,t", [(9, 3, 64, 30, 300), (4, 4, 32, 1, 70), (8, 1, 128, 70, 64)])
def test_attention_mass_matches_reference(dtype, h, hkv, hd, n, t):
    q = _randn(n, h, hd, dtype=dtype, seed=9)
    k = _randn(hkv, t, hd, dtype=dtype, seed=10)
    ours = triton_ops.attention_mass(q, k, hd**-0.5)
    ref = reference.attention_mass(q.cpu().float(), k.cpu().float(), hd**-0.5)
    assert ours.dtype == torch.float32 and ours.shape == (t,)
    assert torch.allclose(ours.cpu(), ref, atol=TOL[dtype] * 5 * n * h / t, rtol=TOL[dtype] * 5)


def test_attention_mass_reference_is_the_softmax_written_out():
    """Each (row, head) spreads a mass of 1 over the keys; GQA: head j reads K/V head j // group."""
    q, k = torch.randn(5, 6, 16), torch.randn(2, 40, 16)
    out = reference.attention_mass(q, k, 0.25)
    naive = sum(torch.softmax(q[i, head] @ k[head // 3].T * 0.25, dim=0) for i in range(5) for head in range(6))
    assert torch.allclose(out, naive, atol=1e-5) and abs(float(out.sum()) - 30) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,hd,n,t", [(9, 3, 64, 30, 300), (4, 4, 32, 1, 70), (8, 1, 128, 70, 150)])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a row with no stale key took log(0) in the interpreter
def test_reweighted_attention_matches_reference(dtype, h, hkv, hd, n, t):
    """APE: stale keys up to 3/4 of the cache with recomputed holes (at t = 300 the first block of keys
    has none: that group starts empty), the question's rows last, causal among themselves."""
    from blend.kernels import triton_reweight

    q = _randn(n, h, hd, dtype=dtype, seed=9)
    k, v = _randn(hkv, t, hd, dtype=dtype, seed=10), _randn(hkv, t, hd, dtype=dtype, seed=11)
    stale = torch.zeros(t, dtype=torch.bool)
    first, end = (70 if t > 200 else 5), min(3 * t // 4, t - n)  # every question row sees every stale key
    stale[first:end] = True
    stale[first + 3 : end : 7] = False
    q_pos = torch.arange(t - n, t)
    ours = triton_reweight.reweighted_attention(q, k, v, q_pos.to(DEVICE), stale.to(DEVICE), hd**-0.5, 0.8, 0.6)
    ref = reference.reweighted_attention_dense(q.cpu().float(), k.cpu().float(), v.cpu().float(), q_pos, stale,
                                               hd**-0.5, 0.8, 0.6)
    assert torch.allclose(ours.cpu().float(), ref, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)


# ---- compact caches (RAGCACHE_KV_CACHE_DTYPE): bfloat16 K/V under float32 queries, int8 with per-row scales ----

COMPACT = [(torch.float32, torch.int8), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int8)]


def _compact(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Hkv, T, hd) float32 → (compact, its per-row scales or None)."""
    return reference.quantize_int8(x) if dtype == torch.int8 else (x.to(dtype), None)


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(3, 50, 64) * torch.logspace(-3, 2, 50)[None, :, None]  # rows of very different sizes
    x[1, 7] = 0  # an all-zero row (the suffix rows fusion zeroes)
    q, s = reference.quantize_int8(x)
    back = reference.dequantize_int8(q, s, torch.float32)
    assert q.dtype == torch.int8 and s.shape == (3, 50) and s[1, 7] == 0 and back[1, 7].abs().sum() == 0
    assert ((back - x).abs() <= s[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("q_dtype,kv_dtype", COMPACT)
@pytest.mark.parametrize("h,hkv,hd,kind,t,n", [(9, 3, 64, "contiguous", 150, 1), (8, 1, 128, "scattered", 300, 70),
                                               (4, 4, 32, "contiguous", 130, 16)])
def test_compact_attention_matches_reference(q_dtype, kv_dtype, h, hkv, hd, kind, t, n):
    """The Triton kernel widens a block of keys at a time; the torch oracle (the CPU path of bfloat16) does
    too, and matches plain attention over the widened cache."""
    q = _randn(n, h, hd, dtype=q_dtype, seed=12).cpu()
    (k, ks), (v, vs) = _compact(torch.randn(hkv, t, hd), kv_dtype), _compact(torch.randn(hkv, t, hd), kv_dtype)
    pos = _rows(kind, t, n)
    ref = reference.compact_attention(q.float(), k, v, pos, hd**-0.5, ks, vs, block=64)
    dense = reference.selected_attention(q.float(), reference.widen(k, ks, torch.float32),
                                         reference.widen(v, vs, torch.float32), pos, hd**-0.5)
    assert torch.allclose(ref, dense, atol=1e-5, rtol=1e-5)
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    ours = triton_ops.selected_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pos.to(DEVICE), hd**-0.5,
                                         dev(ks), dev(vs))
    assert ours.dtype == q_dtype
    assert torch.allclose(ours.cpu().float(), ref, atol=TOL[q_dtype] * 5, rtol=TOL[q_dtype] * 5)


@pytest.mark.parametrize("h,hkv,hd,t,rows", [(9, 3, 64, 2471, [2470]), (8, 1, 128, 700, [100, 101, 699]),
                                             (4, 4, 32, 90, list(range(70, 90)))])
def test_cpu_int8_attention_matches_reference(h, hkv, hd, t, rows):
    """The numba decode kernel, over the first rows of a bigger cache (as a running sequence's are)."""
    from blend.kernels import cpu_int8

    (k, ks), (v, vs) = _compact(torch.randn(hkv, t + 30, hd), torch.int8), _compact(torch.randn(hkv, t + 30, hd),
                                                                                    torch.int8)
    q, pos = torch.randn(len(rows), h, hd), torch.tensor(rows)
    ours = cpu_int8.attention(q, k[:, :t], v[:, :t], pos, hd**-0.5, ks[:, :t], vs[:, :t])
    ref = reference.compact_attention(q, k[:, :t], v[:, :t], pos, hd**-0.5, ks[:, :t], vs[:, :t])
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parallel_from", [0, 1 << 40])  # every call on TBB's cores; every call on one
def test_cpu_int8_varlen_attention_is_each_sequence_alone(monkeypatch, parallel_from):
    """One call for a whole decode batch: sequences of different lengths and capacities, one or several rows
    each (a row past a block edge, one at key 0), each equal to its own attention over its own cache."""
    from blend.kernels import cpu_int8

    monkeypatch.setattr(cpu_int8, "PARALLEL_FROM", parallel_from)
    lengths, caps, rows = [2471, 1030, 1, 600], [2600, 1030, 40, 700], [[2470], [1023, 1024, 1029], [0], [599]]
    caches = [(_compact(torch.randn(3, c, 64), torch.int8), _compact(torch.randn(3, c, 64), torch.int8)) for c in caps]
    ks, vs = [k[:, :t] for ((k, _), _), t in zip(caches, lengths)], [v[:, :t] for (_, (v, _)), t in zip(caches, lengths)]
    scales = [(a[:, :t], b[:, :t]) for ((_, a), (_, b)), t in zip(caches, lengths)]
    pos, cu = torch.tensor([p for r in rows for p in r]), [0, 1, 4, 5, 6]
    q = torch.randn(len(pos), 9, 64)
    ours = cpu_int8.varlen_attention(q, ks, vs, pos, cu, 0.125, scales)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        ref = reference.compact_attention(q[a:b], ks[i], vs[i], pos[a:b], 0.125, *scales[i])
        assert torch.allclose(ours[a:b], ref, atol=1e-5, rtol=1e-5), i


@pytest.mark.parametrize("warm", [False, True])
def test_compact_step_writes_and_attends_as_the_per_layer_calls_do(monkeypatch, warm):
    """A decode step over whole int8 caches (two sequences, different capacities, a layer past the first): each
    row's K/V written where `write_int8_` writes it, bit for bit and nothing else touched, and the attention
    `varlen_attention`'s over the layer's first rows: bit for bit (the same kernel), or split on every core in
    blocks of 256 when warm (float32 rounding)."""
    from blend import kernels
    from blend.kernels import cpu_int8

    monkeypatch.setattr(cpu_int8, "WARM_PARALLEL_FROM", 0)
    caps, lengths, l = [300, 41], [257, 40], 2
    caches = [[torch.randint(-127, 128, (4, 3, c, 64), dtype=torch.int8) for _ in "kv"]
              + [torch.rand(4, 3, c) for _ in "kv"] for c in caps]
    before = [[t.clone() for t in c] for c in caches]
    pos, cu = torch.tensor([n - 1 for n in lengths]), [0, 1, 2]
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    step = kernels.compact_step([tuple(c) for c in caches], pos, cu, warm)
    assert (step.threads > 1) == warm or torch.get_num_threads() == 1
    ours = kernels.step_attention(step, l, q, k, v, 0.125)
    for i, (b, n) in enumerate(zip(before, lengths)):
        kernels.write_int8_(b[0][l], b[2][l], k[i : i + 1], n - 1)
        kernels.write_int8_(b[1][l], b[3][l], v[i : i + 1], n - 1)
        assert all(torch.equal(x, y) for x, y in zip(caches[i], b)), i
    ks = [c[0][l][:, :n] for c, n in zip(caches, lengths)]
    vs = [c[1][l][:, :n] for c, n in zip(caches, lengths)]
    scales = [(c[2][l][:, :n], c[3][l][:, :n]) for c, n in zip(caches, lengths)]
    ref = kernels.varlen_attention(q, ks, vs, pos, cu, 0.125, scales=scales)
    assert torch.equal(ours, ref) if not warm else torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)


def test_cpu_int8_cache_write_is_the_reference_quantization_bit_for_bit():
    """The compiled write of a contiguous run of rows (a decode step's) against `reference.quantize_int8`:
    rows of very different sizes, an all-zero row, values at exact half steps (ties to even), a strided
    input (V is a view of the fused projection), and nothing written outside the run."""
    from blend import kernels

    x = torch.randn(6, 3, 64) * torch.logspace(-3, 2, 6)[:, None, None]
    x[2, 1] = 0
    x[4, 0] = torch.arange(64) - 31.5  # scale exactly 1 (amax 127 below): every value a tie
    x[4, 0, 0] = 127
    wide = torch.cat([x, torch.randn(6, 3, 64)], dim=-1)[..., :64]  # strided rows
    q, s = torch.zeros(3, 20, 64, dtype=torch.int8), torch.full((3, 20), -1.0)
    kernels.write_int8_(q, s, wide, 7)
    ref_q, ref_s = reference.quantize_int8(x.transpose(0, 1))
    assert torch.equal(q[:, 7:13], ref_q) and torch.equal(s[:, 7:13], ref_s)
    assert not q[:, :7].any() and not q[:, 13:].any() and (s[:, :7] == -1).all() and (s[:, 13:] == -1).all()


def test_compacting_a_whole_cache_to_int8_is_the_reference_quantization_bit_for_bit():
    """`quantize_int8_into` (a fused cache compacted for decoding: every layer, head and row in one compiled
    pass) against `reference.quantize_int8`: rows of very different sizes, an all-zero row, a -0.0, exact half
    steps, a row whose largest magnitude is negative, and nothing written past row n."""
    from blend import kernels

    x = torch.randn(2, 3, 9, 64) * torch.logspace(-3, 2, 9)[:, None]
    x[0, 1, 2] = 0
    x[1, 2, 3, 5] = -0.0
    x[1, 0, 4] = torch.arange(64) - 31.5  # scale exactly 1 (amax 127 below): every value a tie
    x[1, 0, 4, 0] = -127
    q, s = torch.zeros(2, 3, 9, 64, dtype=torch.int8), torch.full((2, 3, 9), -1.0)
    kernels.quantize_int8_into(x, q, s, 7)
    ref_q, ref_s = reference.quantize_int8(x[:, :, :7])
    assert torch.equal(q[:, :, :7], ref_q) and torch.equal(s[:, :, :7], ref_s)
    assert not q[:, :, 7:].any() and (s[:, :, 7:] == -1).all()


def test_cpu_int8_exp_matches_libm_where_softmax_uses_it():
    """The vectorized exp of the softmax: within a few float32 ulps of exp over the shifted scores' range."""
    import numpy as np

    from blend.kernels.cpu_int8_loops import exp_into

    x = -np.concatenate([np.linspace(0, 87, 100_001), [1e-7, 0.5 * np.log(2), 87]]).astype(np.float32)
    out = np.empty_like(x)
    exp_into(x, out, np.empty(x.shape, dtype=np.int32))
    rel = np.abs(out.astype(np.float64) / np.exp(x.astype(np.float64)) - 1)
    assert rel.max() < 1e-6 and out[0] == 1.0


def test_cpu_int8_attention_off_the_main_thread_runs_on_tbb():
    """The server's model thread is not the main thread: there numba's OpenMP layer ran a decode step 5x
    slower than TBB's (BENCHMARKS.md, issue 24 part B), so the kernel must run on TBB, and agree."""
    import numba

    from blend.kernels import cpu_int8

    (k, ks), (v, vs) = _compact(torch.randn(3, 600, 64), torch.int8), _compact(torch.randn(3, 600, 64), torch.int8)
    q, pos, out = torch.randn(2, 9, 64), torch.tensor([598, 599]), {}
    worker = threading.Thread(target=lambda: out.update(o=cpu_int8.attention(q, k, v, pos, 0.125, ks, vs)))
    worker.start()
    worker.join()
    assert numba.threading_layer() == "tbb"
    assert torch.allclose(out["o"], reference.compact_attention(q, k, v, pos, 0.125, ks, vs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_dtype,kv_dtype", COMPACT)
def test_varlen_attention_over_compact_caches(q_dtype, kv_dtype):
    """Decode rows and a short run of rows, each sequence against its own compact cache (own capacity)."""
    from blend.kernels import triton_varlen

    h, hkv, hd = 9, 3, 64
    caps, lens, rows = [40, 160, 90], [33, 150, 90], [torch.tensor([32]), torch.arange(140, 150), torch.tensor([89])]
    caches = [(_compact(torch.randn(hkv, c, hd), kv_dtype), _compact(torch.randn(hkv, c, hd), kv_dtype)) for c in caps]
    ks = [k[:, :n] for ((k, _), _), n in zip(caches, lens)]
    vs = [v[:, :n] for (_, (v, _)), n in zip(caches, lens)]
    scales = [(a[:, :n], b[:, :n]) if a is not None else () for ((_, a), (_, b)), n in zip(caches, lens)]
    q = _randn(sum(r.numel() for r in rows), h, hd, dtype=q_dtype, seed=13)
    cu = [0, 1, 11, 12]
    pos = torch.cat(rows)
    dev = lambda xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    ours = triton_varlen.varlen_attention(q, dev(ks), dev(vs), pos.to(DEVICE), cu, hd**-0.5,
                                          [tuple(dev(s)) for s in scales])
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        ref = reference.compact_attention(q[a:b].cpu().float(), ks[i], vs[i], pos[a:b], hd**-0.5, *scales[i])
        assert torch.allclose(ours[a:b].cpu().float(), ref, atol=TOL[q_dtype] * 5, rtol=TOL[q_dtype] * 5)
