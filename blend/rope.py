"""Rotary position embeddings: the model's frequencies, cos/sin tables, rotation and re-alignment.

K is cached post-RoPE. Moving a row from position p to p + d is one more rotation by d:
R(p + d)·k = R(d)·(R(p)·k); `delta_cos_sin` gives that rotation (V has no position).
"""
from __future__ import annotations

import torch


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """inv_freq (head_dim/2,) float32 and the cos/sin scaling, exactly as transformers computes them."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RopeTable:
    """cos/sin per position, grown on demand; computed as transformers does (float32 angles)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, device: torch.device):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # (hd/2,)
        self.scaling = scaling
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (n,) int64 → cos, sin (n, 1, hd)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0], 1024))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _grow(self, n: int) -> None:
        freqs = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        self.sin = (emb.sin() * self.scaling).to(self.dtype)


def delta_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row rotation by `delta` positions: cos, sin (n, hd/2) float32, angles in float64.

    Float64 angles add no rounding of their own, so R(d)·K(p) is as close to K(p + d) as
    transformers' own float32 table allows. No attention scaling: it is already in K.
    """
    angle = delta.to(torch.float64)[:, None] * inv_freq.to(device=delta.device, dtype=torch.float64)
    return angle.cos().float(), angle.sin().float()
