"""The runner's matrix products, chosen once here: oneDNN's prepacked float32 GEMM on CPU
(1.5–1.7× faster than F.linear for the few-row products of selective recompute, faster for
full prefill too), F.linear everywhere else (CUDA, half precision, builds without oneDNN).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def make_linear(device: torch.device, dtype: torch.dtype) -> tuple[Callable[[torch.Tensor], torch.Tensor], Linear]:
    """(prepare a (out, in) weight, apply y = x @ wᵀ + b) for this device and dtype."""
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            probe = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), None)
            _packed_linear(torch.ones(1, 2), probe)
        except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
            return (lambda w: w), F.linear
        return (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)), _packed_linear
    return (lambda w: w), F.linear
