"""The per-sequence KV cache that fusion fills and decoding extends."""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer K (post-RoPE) and V of one sequence. Row i holds absolute position i.

    k, v: (L, Hkv, capacity, hd); rows [0, length) are valid; the model reads a layer through `layer(l)`. `reweight`: set by fusion when the
    question's attention to cached context is re-weighted (`blend.reweight.Stale`), else None.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0):
        assert k.shape == v.shape and k.dim() == 4, (k.shape, v.shape)
        self.k, self.v, self.length = k, v, length
        self.reweight = None
        self.pending = None  # set by fusion while chunk layers are still arriving: pending(l) places layer l

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's K and V (Hkv, capacity, hd), its chunk KV placed first if it was still arriving."""
        if self.pending is not None:
            self.pending(l)
        return self.k[l], self.v[l]

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for n rows (grows by copying, at least doubling)."""
        if n <= self.capacity:
            return
        grown = KVCache.empty(self.k.shape[0], self.k.shape[1], self.k.shape[3], max(n, 2 * self.capacity),
                              self.k.dtype, self.k.device)
        grown.k[:, :, : self.length] = self.k[:, :, : self.length]
        grown.v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = grown.k, grown.v

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of rows [start, end) across layers: (L, Hkv, end - start, hd) views."""
        return self.k[:, :, start:end], self.v[:, :, start:end]
