"""The per-sequence KV cache that fusion fills and decoding extends."""
from __future__ import annotations

import torch

from . import kernels


class KVCache:
    """Per-layer K (post-RoPE) and V of one sequence. Row i holds absolute position i.

    k, v: (L, Hkv, capacity, hd); rows [0, length) are valid. They hold the model's dtype while
    fusion works on them; a running sequence may keep them compact (`compact`): bfloat16, or int8
    with one float32 scale per (layer, head, row) in k_scale, v_scale (L, Hkv, capacity).
    `reweight`: set by fusion when the question's attention to cached context is re-weighted
    (`blend.reweight.Stale`), else None. `pending`: set by fusion while chunk layers still arrive on another
    thread; reading a layer (`placed`, `layer`) places its chunk KV first.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None):
        assert k.shape == v.shape and k.dim() == 4, (k.shape, v.shape)
        assert (k.dtype == torch.int8) == (k_scale is not None), "int8 K/V need their scales, floats none"
        self.k, self.v, self.length = k, v, length
        self.k_scale, self.v_scale = k_scale, v_scale
        self.reweight = None
        self.pending = None  # set by fusion while chunk layers are still arriving: pending(l) places layer l

    def placed(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's K and V (Hkv, capacity, hd) for a fused prefill to write, its chunk KV placed first if it was
        still arriving."""
        if self.pending is not None:
            self.pending(l)
        return self.k[l], self.v[l]

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        scales = [torch.empty(shape[:3], dtype=torch.float32, device=device) for _ in "kv"] if dtype == torch.int8 \
            else [None, None]
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device), 0,
                   *scales)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """What K and V are stored as."""
        return self.k.dtype

    def reserve(self, n: int) -> None:
        """Make room for n rows (grows by copying, at least doubling)."""
        if n <= self.capacity:
            return
        grown = KVCache.empty(self.k.shape[0], self.k.shape[1], self.k.shape[3], max(n, 2 * self.capacity),
                              self.k.dtype, self.k.device)
        for old, new in zip(self._parts(), grown._parts()):
            new[:, :, : self.length] = old[:, :, : self.length]
        self.k, self.v, self.k_scale, self.v_scale = grown.k, grown.v, grown.k_scale, grown.v_scale

    def _parts(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of rows [start, end) across layers: (L, Hkv, end - start, hd) views (a float cache's)."""
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def layer(self, l: int, end: int) -> tuple[torch.Tensor, ...]:
        """Layer l's rows [0, end) for attention: (k, v) (Hkv, end, hd), then (k_scale, v_scale) (Hkv, end)
        when int8."""
        if self.pending is not None:
            self.pending(l)
        out = (self.k[l][:, :end], self.v[l][:, :end])
        return out if self.k_scale is None else (*out, self.k_scale[l][:, :end], self.v_scale[l][:, :end])

    def float_layer(self, l: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's rows [0, end) as `dtype` K, V (Hkv, end, hd): views when stored so, else widened copies
        (APE's re-weighted pass reads a compact cache this way)."""
        k, v, *scales = self.layer(l, end)
        if k.dtype == dtype:
            return k, v
        ks, vs = scales or (None, None)
        return kernels.widen(k, ks, dtype), kernels.widen(v, vs, dtype)

    def write(self, l: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, end: int) -> None:
        """New K/V (n, Hkv, hd) of `rows` (ascending, from `first` to `end` - 1) into layer l at the cache's
        precision: a plain slice write when the rows are contiguous."""
        for dst, scale, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scale is not None and end - first == rows.shape[0]:
                kernels.write_int8_(dst[l], scale[l], new, first)
                continue
            new = new.transpose(0, 1)  # (Hkv, n, hd)
            parts = [(dst[l], new)] if scale is None else zip((dst[l], scale[l]), kernels.quantize_int8(new))
            for d, x in parts:
                if end - first == rows.shape[0]:
                    d[:, first:end] = x
                else:
                    d.index_copy_(1, rows, x.to(d.dtype))

    def compact(self, dtype: torch.dtype, out: "KVCache | None" = None) -> "KVCache":
        """Rows [0, length) at `dtype` (bfloat16, or int8 with per-row scales) in `out` (an empty cache at `dtype`
        with room for them), else a new cache of the same capacity; `reweight` goes along. The same cache when it
        already is at `dtype`."""
        if dtype == self.dtype:
            return self
        if out is None:
            out = KVCache.empty(self.k.shape[0], self.k.shape[1], self.k.shape[3], self.capacity, dtype, self.k.device)
        assert out.dtype == dtype and out.capacity >= self.length and out.k.shape[:2] == self.k.shape[:2], out.k.shape
        n = self.length
        for src, dst, scale in ((self.k, out.k, out.k_scale), (self.v, out.v, out.v_scale)):
            if scale is None:
                dst[:, :, :n] = src[:, :, :n]
            else:
                kernels.quantize_int8_into(src, dst, scale, n)  # rows 0..n of (L, Hkv, capacity, hd)
        out.length, out.reweight = n, self.reweight
        return out

    def bytes_per_row(self) -> int:
        """Bytes one row takes across every layer: K and V, and their scales when int8."""
        return self.bytes_per_row_of(self.k.shape[0], self.k.shape[1], self.k.shape[3], self.dtype)

    @staticmethod
    def bytes_per_row_of(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        scales = 4 if dtype == torch.int8 else 0  # one float32 per (layer, head, row), for K and for V
        return 2 * num_layers * num_kv_heads * (head_dim * dtype.itemsize + scales)
