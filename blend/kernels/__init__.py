"""Kernels of the blend hot path. Triton on CUDA, torch on CPU: chosen here and nowhere else.

Each function takes the same tensors on either device; the Triton launchers assert layout.
The torch versions in `reference.py` are both the CPU implementation and the tests' oracle.
"""
from __future__ import annotations

import torch

from . import reference


def _triton(t: torch.Tensor):
    """The Triton module set when `t` lives on a GPU, else None (imported lazily: CPU needs none)."""
    if not t.is_cuda:
        return None
    from . import triton_ops

    return triton_ops


def realign_rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """Rotate K by per-row position deltas: k ← R(delta)·src (src=None: k in place).

    k, src (B, n, hd), last dim contiguous; cos, sin (n, hd/2) float32 of delta·inv_freq.
    """
    ops = _triton(k)
    (ops.realign_rope_ if ops else reference.realign_rope_)(k, cos, sin, src)


def deviation_scatter_(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """dev[i] = ||new[i] - cache[:, rows[i]]||² over heads and hd, then cache[:, rows] = new.

    cache (Hkv, capacity, hd); rows (n,) int64; new (n, Hkv, hd) → dev (n,) float32.
    """
    ops = _triton(cache)
    return (ops.deviation_scatter_ if ops else reference.deviation_scatter_)(cache, rows, new)


def attention_plan(q_pos: torch.Tensor) -> list[reference.Block] | None:
    """Work split for `selected_attention`, made once per row set (the torch path's query blocks)."""
    return None if q_pos.is_cuda else reference.attention_blocks(q_pos)


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                       plan: list[reference.Block] | None = None, scales: tuple = ()) -> torch.Tensor:
    """Attention of selected rows over a whole cache, causal by absolute position (key j at j).

    q (n, H, hd) with q_pos (n,) ascending; k, v (Hkv, T, hd), H a multiple of Hkv → (n, H, hd).
    K/V may be compact (`KVCache.compact`): bfloat16 under float32 queries, or int8 with
    scales = (k_scale, v_scale) (Hkv, T); sums stay float32 either way.
    """
    ops = _triton(q)
    if ops:
        return ops.selected_attention(q, k, v, q_pos, scale, *scales)
    if k.dtype == q.dtype:
        return reference.selected_attention(q, k, v, q_pos, scale, plan)
    if k.dtype == torch.int8 and q.dtype == torch.float32:
        from . import cpu_int8  # numba compiles it on first use

        return cpu_int8.attention(q, k, v, q_pos, scale, *scales)
    return reference.compact_attention(q, k, v, q_pos, scale, *scales)


def varlen_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_pos: torch.Tensor,
                     cu_rows: list[int], scale: float, plans: list | None = None,
                     scales: list[tuple] | None = None) -> torch.Tensor:
    """`selected_attention` of several sequences at once, each against its own cache.

    q (N, H, hd): sequence i's rows q[cu_rows[i]:cu_rows[i+1]], positions q_pos (N,) ascending within
    each; ks[i], vs[i] (Hkv, T_i, hd) → (N, H, hd). One Triton launch on CUDA, a loop on CPU
    (measured faster there than a padded batch: no copies of the caches). `plans`: per sequence,
    from `attention_plan` (CPU only). Compact K/V as `selected_attention` takes them, scales[i] sequence i's.
    """
    if q.is_cuda:
        from . import triton_varlen

        return triton_varlen.varlen_attention(q, ks, vs, q_pos, cu_rows, scale, scales)
    if ks[0].dtype == q.dtype:
        return reference.varlen_attention(q, ks, vs, q_pos, cu_rows, scale, plans)
    if ks[0].dtype == torch.int8 and q.dtype == torch.float32:
        from . import cpu_int8  # numba compiles it on first use

        return cpu_int8.varlen_attention(q, ks, vs, q_pos, cu_rows, scale, scales)  # one call: the cores share it
    scales = scales or [()] * len(ks)
    return torch.cat([selected_attention(q[a:b], k, v, q_pos[a:b], scale, scales=sc)
                      for a, b, k, v, sc in zip(cu_rows, cu_rows[1:], ks, vs, scales)])  # (N, H, hd)


def compact_step(caches: list[tuple[torch.Tensor, ...]], q_pos: torch.Tensor, cu_rows: list[int], warm: bool = False):
    """A decode step over int8 caches on the CPU, found once for all its layers (None elsewhere: the caller
    takes `KVCache.write` and `varlen_attention` per layer). caches[i] = sequence i's whole (k, v, k_scale,
    v_scale), (L, Hkv, capacity, hd) and (L, Hkv, capacity); its rows q_pos[cu_rows[i]:cu_rows[i+1]]. `warm`:
    the step's products are `group_linear`'s, so numba's threads are awake and the attention splits sooner."""
    if q_pos.is_cuda or any(c[0].dtype != torch.int8 for c in caches):
        return None
    from . import cpu_int8

    return cpu_int8.step(caches, q_pos, cu_rows, warm)


def step_attention(step, l: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Layer l of a `compact_step`: the rows' new K, V (N, Hkv, hd) written into their caches as
    `write_int8_` writes them, then `varlen_attention` of q (N, H, hd) float32 → (N, H, hd)."""
    from . import cpu_int8

    return cpu_int8.step_attention(step, l, q, k, v, scale)


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """The question's attention on each key: softmax over all T keys per row and head, summed.

    q (n, H, hd) of rows that see every key; k (Hkv, T, hd), H a multiple of Hkv → (T,) float32.
    """
    ops = _triton(q)
    return (ops.attention_mass if ops else reference.attention_mass)(q, k, scale)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per row: x (..., hd) float → (int8 (..., hd), float32 scale (...)); either device."""
    return reference.quantize_int8(x)


def quantize_int8_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int) -> None:
    """`quantize_int8` of rows 0..n of x (L, Hkv, capacity, hd) into those of q (L, Hkv, ≥ n, hd) int8 and scale
    (L, Hkv, ≥ n) float32. One compiled pass for contiguous float32 on the CPU: compacting a fused cache of
    2.5K rows took torch ~100 ms here (six passes)."""
    if x.is_cuda or x.dtype != torch.float32 or not (x.is_contiguous() and q.is_contiguous() and scale.is_contiguous()):
        rows, scales = quantize_int8(x[:, :, :n])
        q[:, :, :n], scale[:, :, :n] = rows, scales
        return
    from . import cpu_int8

    cpu_int8.quantize_into(x, q, scale, n)


def write_int8_(q: torch.Tensor, scale: torch.Tensor, new: torch.Tensor, first: int) -> None:
    """Rows first.. of a compact layer ← `quantize_int8` of new (n, Hkv, hd): q (Hkv, capacity, hd) int8,
    scale (Hkv, capacity) float32. One compiled pass for float32 rows on CPU: a decode step writes one row a
    layer, and the torch ops took ~35 µs for its K and V (scratch timing of `KVCache.write`; 8 µs now)."""
    if new.is_cuda or new.dtype != torch.float32:
        rows, scales = reference.quantize_int8(new.transpose(0, 1))
        q[:, first : first + new.shape[0]], scale[:, first : first + new.shape[0]] = rows, scales
        return
    from . import cpu_int8

    cpu_int8.write_rows_(q, scale, new, first)


ROWS = 64  # rows up to which the small passes between products run compiled on the CPU: decode steps, few-row recomputes


def _few_rows(x: torch.Tensor) -> bool:
    return not x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= ROWS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: x (..., D), weight (D,) → (..., D). One compiled pass for a few float32
    rows on CPU (`cpu_rows`), torch's ops otherwise."""
    if _few_rows(x) and weight.dtype == torch.float32:
        from . import cpu_rows

        return torch.from_numpy(cpu_rows.norm_rows(x.contiguous().numpy(), weight.numpy(), eps))
    return reference.rms_norm(x, weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu (n, 2·I), gate then up → silu(gate) · up (n, I). torch's on CPU too: its exp is vectorized, a compiled
    loop's is not (7.5 against 5.4 µs a row here)."""
    return reference.silu_mul(gu)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, hd); cos, sin (n, 1, hd) → x rotated to its rows' positions."""
    return reference.apply_rope(x, cos, sin)


def split_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """qkv (n, (H + 2·Hkv)·hd), cos/sin (n, 1, hd) → q (n, H, hd), k (n, Hkv, hd) post-RoPE, v (n, Hkv, hd);
    the compiled pass is bit for bit torch's."""
    if _few_rows(qkv) and cos.dtype == torch.float32:
        from . import cpu_rows

        return cpu_rows.rope(qkv, cos, sin, heads, kv_heads)
    return reference.split_rope(qkv, cos, sin, heads, kv_heads)


def spread_rows(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False):
    """x (n, d) float32 on CPU → (y mapped row by row onto [0, 1] (n, d'), ends (2, n, 1): each row's least
    value and its range): y = low + span · out. The input of the int8 decode weights' GEMM (`blend.linear`); y is x, or
    `rms_norm(x, norm, eps)`, or `silu_mul(x)` (d' = d / 2), made in the same pass."""
    from . import cpu_rows

    if norm is not None:
        return cpu_rows.spread(x, cpu_rows.norm_spread, norm.numpy(), eps)
    return cpu_rows.spread(x, cpu_rows.silu_mul_spread if silu_mul else cpu_rows.spread_rows)


def unspread_(y: torch.Tensor, ends: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """y (n, out) ← span · y + low · sums: W·u → W·x for x = low + span · u, ends (2, n, 1) `spread_rows`'s
    (low, span), sums (1, out) W's row sums."""
    from . import cpu_rows

    cpu_rows.unspread_(y.numpy(), ends.numpy(), sums.numpy())
    return y


def group_pack(w: torch.Tensor, bits: int):
    """A decode weight w (out, in) float32 in groups of 32 inputs at 4 bits (step and minimum per group) or 8
    (step per group), fp16 steps (GGUF's Q4_1 and Q8_0), for `group_linear`; CPU only."""
    from . import cpu_groups

    return cpu_groups.pack(w, bits)


def group_linear(x: torch.Tensor, w, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x (n, in) float32 → x · Wᵀ (n, out) for a `group_pack`ed W, weight-only: sums in float32; with `norm`
    (in,), `rms_norm(x, norm, eps)` · Wᵀ."""
    from . import cpu_groups

    return cpu_groups.linear(x, w, norm, eps)


def stack_layers(layers: list[tuple]):
    """layers[l] = (ln1, wqkv, bqkv or None, wo, ln2, wgu, wd), the matrices `group_pack`ed at 4 bits → the stack
    `step_layers` runs them from (`Stack.matrices(l)`: layer l's as views of it), or None where they do not
    stack (another bit width, shapes that differ)."""
    from . import cpu_step

    return cpu_step.stack_layers(layers)


def step_layers(step, stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, scale: float,
                eps: float) -> torch.Tensor:
    """Every block of a `compact_step` in one compiled call, through a `stack_layers` stack: x (N, D) float32,
    cos/sin (N, 1, hd) of the rows' positions → x after the last block (N, D); the rows' K/V written into their
    caches on the way, as `step_attention` writes them."""
    from . import cpu_step

    return cpu_step.layers(step, stack, x, cos, sin, heads, scale, eps)


def widen(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Compact K or V (..., T, hd), bfloat16 or int8 with scale (..., T) → `dtype`."""
    return reference.widen(x, scale, dtype)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Symmetric int8 with one scale per row: q (B, n, hd) int8, scale (B, n) float32 → (B, n, hd)."""
    ops = _triton(q)
    return (ops.dequantize_int8 if ops else reference.dequantize_int8)(q, scale, dtype)


def reweighted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         stale: torch.Tensor, scale: float, temperature: float, factor: float) -> torch.Tensor:
    """APE re-weighting (`blend/reweight.py`): causal attention of rows that follow every stale key,
    the stale keys' logits ÷ T and their group's mass S·exp(T·logsumexp).

    q (n, H, hd) at q_pos (n,); k, v (Hkv, T, hd); stale (T,) bool → (n, H, hd). One Triton launch
    on CUDA; on CPU one flash pass with a bias at T = 1, else two (the stale keys gathered, then the rest)
    merged by weight.
    """
    if q.is_cuda:
        from . import triton_reweight

        return triton_reweight.reweighted_attention(q, k, v, q_pos, stale, scale, temperature, factor)
    return reference.reweighted_attention(q, k, v, q_pos, stale, scale, temperature, factor)
