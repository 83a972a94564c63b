"""The runner's matrices and their products, chosen once here.

Prefill and recompute: oneDNN's prepacked float32 GEMM on CPU (1.5–1.7× faster than F.linear for
the few-row products of selective recompute, faster for full prefill too), F.linear everywhere else
(CUDA, half precision, builds without oneDNN). Decode (`RAGCACHE_DECODE_WEIGHTS`) reads every weight
once per step for a handful of rows, so it is bound by the weights' bytes: `float16` keeps a second,
half-size copy that fbgemm's GEMM widens to float32 inside its kernel (weight-only: the rows and the
sums stay float32); `int8` a quarter-size copy, one symmetric scale per output row (7 bits on a CPU without
AVX-512 VNNI, where 8 would saturate fbgemm's int16 sums: `_int8_levels`), through fbgemm's
dynamic int8 GEMM, which quantizes each call's rows to 8 bits too (each row over its own range), so it
is not weight-only: ~1% relative error a product, where float16's is ~0.02%. `int4` keeps the blocks' matrices
in 4-bit groups of 32 and the LM head in 8-bit groups (GGUF's Q4_1 and Q8_0: the bundled SmolLM2's own
formats, so its weights pack without loss), weight-only, through `kernels.group_linear`: the fewest bytes
and the fastest step for one sequence; slower than `int8` from a few rows on.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import cpuinfo, kernels

Linear = Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]
NormLinear = Callable[[torch.Tensor, torch.Tensor, float, object, torch.Tensor | None], torch.Tensor]
ActLinear = Callable[[torch.Tensor, object], torch.Tensor]
DECODE_WEIGHTS = ("model", "float16", "int8", "int4")  # "model": decode multiplies by the prefill's own matrices


@dataclass
class Layer:
    ln1: torch.Tensor  # (D,)
    wqkv: object  # ((H + 2·Hkv)·hd, D): q, k, v projections fused, as the path prepares it
    bqkv: torch.Tensor | None  # qwen2's projection biases
    q_norm: torch.Tensor | None  # (hd,) qwen3
    k_norm: torch.Tensor | None
    wo: object  # (D, H·hd)
    ln2: torch.Tensor  # (D,)
    wgu: object  # (2·I, D): gate and up fused
    wd: object  # (D, I)


@dataclass
class Weights:
    """Every matrix of the blocks and the LM head, prepared for one GEMM path, and that path's product."""

    layers: list[Layer]
    lm_head: object  # (V, D)
    linear: Linear  # (x (n, in), a prepared (out, in) weight, bias) → (n, out)
    norm_linear: NormLinear  # (x, norm weight (in,), eps, weight, bias) → linear(rms_norm(x), weight, bias)
    act_linear: ActLinear  # (gu (n, 2·in) gate then up, weight) → linear(silu(gate) · up, weight)
    bytes: int  # the matrices' bytes as this path stores them: what one product of each reads
    on_numba: bool = False  # its products run on numba's threads (int4), which the step's attention may then share
    stack: object = None  # every block's matrices stacked for `kernels.step_layers` (int4, where they stack), else None


def make_weights(state: dict[str, torch.Tensor], num_layers: int, kind: str = "model") -> Weights:
    """The blocks' and LM head's matrices from HF-named `state`, for the `kind` of GEMM (DECODE_WEIGHTS)."""
    if kind not in DECODE_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(DECODE_WEIGHTS)}")
    w = state["lm_head.weight"]
    prepare, prepare_head, products, itemsize = _path(w.device, w.dtype, kind)
    layers = [_layer(state, f"model.layers.{i}.", prepare) for i in range(num_layers)]
    head = prepare_head(w)
    if itemsize is None:  # int4: the prepared matrices know their bytes
        return Weights(layers, head, *products, head.nbytes + sum(m.nbytes for ly in layers
                                                                  for m in (ly.wqkv, ly.wo, ly.wgu, ly.wd)),
                       True, _stack(layers))
    matrices = [n for n in state if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    numel = w.numel() + sum(state[n].numel() for n in matrices)
    return Weights(layers, head, *products, numel * itemsize)


def _path(device: torch.device, dtype: torch.dtype, kind: str) -> tuple[Callable, Callable, tuple, int | None]:
    """(prepare a block's (out, in) weight, prepare the LM head's, their products (linear, norm_linear,
    act_linear), bytes per weight or None where the prepared matrices say) for this device, dtype and kind."""
    cpu32 = device.type == "cpu" and dtype == torch.float32
    if kind == "float16" and cpu32:
        fp16 = torch.ops.quantized.linear_prepack_fp16
        return fp16, fp16, _around(_fp16_linear), 2
    if kind == "int8" and cpu32:  # its input pass makes the norm too
        return _int8_prepack, _int8_prepack, (_int8_linear, _int8_norm_linear, _int8_act_linear), 1
    if kind == "int4" and cpu32:
        products = (_group_linear, lambda x, ln, eps, w, b=None: _group_linear(x, w, b, ln, eps),
                    lambda gu, w: _group_linear(kernels.silu_mul(gu), w))
        return (lambda w: kernels.group_pack(w, 4)), (lambda w: kernels.group_pack(w, 8)), products, None
    if cpu32 and torch.backends.mkldnn.is_available():
        try:
            probe = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), None)
            _packed_linear(torch.ones(1, 2), probe)
        except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
            return _same, _same, _around(F.linear), dtype.itemsize
        return _onednn_prepack, _onednn_prepack, _around(_packed_linear), 4
    return _same, _same, _around(F.linear), dtype.itemsize


def _stack(layers: list[Layer]):
    """The blocks' int4 matrices stacked for `kernels.step_layers`, each layer's re-pointed at its views of the
    stack (one copy in memory); None where they do not stack or a block norms its heads (qwen3)."""
    if any(ly.q_norm is not None for ly in layers):
        return None
    stack = kernels.stack_layers([(ly.ln1, ly.wqkv, ly.bqkv, ly.wo, ly.ln2, ly.wgu, ly.wd) for ly in layers])
    for l, ly in enumerate(layers if stack is not None else []):
        ly.wqkv, ly.wo, ly.wgu, ly.wd = stack.matrices(l)
    return stack


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


def _onednn_prepack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def _around(linear: Linear) -> tuple[Linear, NormLinear, ActLinear]:
    """A product and the two a block runs after a pass over its input, that pass a kernel of its own."""
    return (linear, lambda x, ln, eps, w, b=None: linear(kernels.rms_norm(x, ln, eps), w, b),
            lambda gu, w: linear(kernels.silu_mul(gu), w, None))


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def _fp16_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), w)  # w packed with its bias None
    return y if b is None else y + b


def _group_linear(x: torch.Tensor, w, b: torch.Tensor | None = None, ln: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """x (n, in) → W·x + b; with `ln`, W·rms_norm(x) + b, the norm in the product's own call."""
    y = kernels.group_linear(x, w, ln, eps)
    return y if b is None else y + b


@functools.cache
def _int8_levels() -> int:
    """The weights' largest level: 127 where fbgemm multiplies with AVX-512 VNNI (int32 sums), 63 elsewhere. Without
    VNNI it sums pairs of u8 · s8 products in int16 (`vpmaddubsw`), which saturates past 2 · 255 · 64: on an AVX2
    host 127 levels put the logits 39% off float32's, 63 levels 4% (tests/blend/test_linear.py)."""
    return 127 if "avx512_vnni" in cpuinfo.read() else 63


def _int8_prepack(w: torch.Tensor):
    """(out, in) float32 → (fbgemm's packed int8 matrix, w ≈ scale[o] · q[o, :] with q in [−L, L] (`_int8_levels`);
    its row sums (1, out) as packed, for `_int8_linear`)."""
    top = _int8_levels()
    scale = (w.abs().amax(1) / top).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
    q = torch.round(w / scale[:, None]).clamp_(-top, top)
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; fbgemm's GEMM takes only them
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*deprecated", category=UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q.to(torch.int8), scale.double(),
                                                      torch.zeros_like(scale, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None), (q * scale[:, None]).sum(1)[None]  # sums (1, out)


def _int8_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """fbgemm quantizes its input to 8 bits over the whole tensor, so a row's rounding would depend on the
    other rows of a batch. Each row goes in mapped onto [0, 1] (x = low + span · u), so every batch's range
    is [0, 1], a row is quantized over its own range, and a sequence's product is the one it gets alone:
    W·x = span · (W·u) + low · (W's row sums)."""
    return _int8_product(*kernels.spread_rows(x), w, b)


def _int8_norm_linear(x: torch.Tensor, ln: torch.Tensor, eps: float, w, b: torch.Tensor | None = None):
    return _int8_product(*kernels.spread_rows(x, ln, eps), w, b)


def _int8_act_linear(gu: torch.Tensor, w) -> torch.Tensor:
    return _int8_product(*kernels.spread_rows(gu, silu_mul=True), w, None)


def _int8_product(u: torch.Tensor, ends: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """u (n, in) rows on [0, 1], ends (2, n, 1) their (low, span) → W·x + b (n, out)."""
    packed, sums = w
    y = kernels.unspread_(torch.ops.quantized.linear_dynamic(u, packed, False), ends, sums)
    return y if b is None else y + b


def _layer(s: dict[str, torch.Tensor], p: str, prepare: Callable) -> Layer:
    a = p + "self_attn."
    biases = [s.get(a + f"{x}_proj.bias") for x in "qkv"]
    return Layer(
        ln1=s[p + "input_layernorm.weight"],
        wqkv=prepare(torch.cat([s[a + f"{x}_proj.weight"] for x in "qkv"])),
        bqkv=torch.cat(biases) if all(b is not None for b in biases) else None,
        q_norm=s.get(a + "q_norm.weight"),
        k_norm=s.get(a + "k_norm.weight"),
        wo=prepare(s[a + "o_proj.weight"]),
        ln2=s[p + "post_attention_layernorm.weight"],
        wgu=prepare(torch.cat([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]])),
        wd=prepare(s[p + "mlp.down_proj.weight"]),
    )
