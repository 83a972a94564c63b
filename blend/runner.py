"""Our own forward pass over a Llama-family model's weights (llama, mistral, qwen2, qwen3).

Two entry points share one transformer block:
- `prefill`: a fresh sequence at given positions, causal among its own rows;
- `forward_selected`: recompute only some rows of a sequence whose per-layer KV is already in
  a `KVCache`, writing their new K/V back; the row set may shrink at chosen layers (CacheBlend).
Decoding is `forward_selected` of one new row at the end of the cache.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import kernels
from .cache import KVCache
from .linear import Weights, make_weights
from .model import Model
from .rope import RopeTable, rope_frequencies

SPARE_CACHES = 2  # released caches a runner keeps of each dtype, so that the next prefills write into warm pages


@dataclass(frozen=True)
class Check:
    """What a row filter sees at a check layer, after the rows' new K/V are written."""

    layer: int
    rows: torch.Tensor  # (n,) ascending
    dev_k: torch.Tensor  # (n,) float32 ||new − cached||² over heads and hd
    dev_v: torch.Tensor  # (n,)
    q: torch.Tensor  # (n, H, hd) the rows' queries, post-RoPE
    k: torch.Tensor  # (Hkv, capacity, hd) this layer's cache K, the rows' new K written
    scale: float

    def question_mass(self, query_from: int, keys: tuple[int, int]) -> torch.Tensor:
        """Attention of rows ≥ `query_from` on keys [a, b) (all before them), softmax over those keys,
        summed over rows and heads → (b − a,) float32."""
        return kernels.attention_mass(self.q[self.rows >= query_from], self.k[:, keys[0] : keys[1]], self.scale)


# a check → indices into check.rows to keep, ascending (the last must stay), or None: keep all
RowFilter = Callable[[Check], torch.Tensor | None]


@dataclass
class Pass:
    """A `forward_selected` under way: what `Runner.advance` carries from one layer to the next."""

    cache: KVCache
    rows: torch.Tensor  # (n,) ascending: the rows still going on
    x: torch.Tensor  # (n, D) their hidden states entering `layer`
    cos: torch.Tensor  # (n, 1, hd) RoPE of their positions
    sin: torch.Tensor
    plan: object  # kernels.attention_plan(rows)
    deviation_layers: frozenset[int]
    row_filter: RowFilter | None
    all_logits: bool
    layers: int  # run through this many layers
    first: int  # rows[0] and rows[-1] + 1, kept here: no device sync per layer
    end: int
    layer: int = 0  # the next layer to run
    kv_rows: list[torch.Tensor] = field(default_factory=list)
    out_rows: list[torch.Tensor] = field(default_factory=list)
    deviations: dict = field(default_factory=dict)


@dataclass
class Prefill:
    logits: torch.Tensor  # (V,) float32, the last row's
    k: torch.Tensor  # (L, Hkv, n, hd), post-RoPE at the given positions
    v: torch.Tensor  # (L, Hkv, n, hd)


@dataclass
class Selected:
    logits: torch.Tensor  # (V,) for the last row, or (m, V) for every final row with all_logits
    kv_rows: list[torch.Tensor]  # per layer: rows whose K/V were recomputed (same tensor while unchanged)
    out_rows: list[torch.Tensor]  # per layer: rows whose attention and MLP ran (fewer at a filtering layer)
    deviations: dict = field(default_factory=dict)  # check layer → (rows (n,), ||ΔK||² (n,), ||ΔV||² (n,))


class Runner:
    def __init__(self, model: Model, decode_weights: str = "model"):
        """`decode_weights`: the matrices `blend.batch.decode_batch` multiplies by (`linear.DECODE_WEIGHTS`)."""
        cfg = model.config
        self.model = model
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.max_positions = _max_positions(cfg)
        self.device, self.dtype = model.device, model.dtype
        s = model.state
        self.embed = s["model.embed_tokens.weight"]  # (V, D)
        self.norm = s["model.norm.weight"]
        self.w = make_weights(s, self.num_layers)  # prefill and recompute
        self.decode_w = self.w if decode_weights == "model" else make_weights(s, self.num_layers, decode_weights)
        inv_freq, scaling = rope_frequencies(cfg)
        self.inv_freq = inv_freq
        self.rope = RopeTable(inv_freq, scaling, self.dtype, self.device)
        self._spare: list[KVCache] = []  # released caches, reused to skip fresh-page faults
        self._spare_lock = threading.Lock()

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for `capacity` rows at `dtype` (the model's by default): a released one of that dtype and
        fitting size, else a new one. A spare made under inference mode goes only to a caller inside it: torch
        refuses writes to it anywhere else."""
        dtype = dtype or self.dtype
        writable = torch.is_inference_mode_enabled()
        with self._spare_lock:
            for i, spare in enumerate(self._spare):
                if (spare.dtype == dtype and capacity <= spare.capacity <= 2 * capacity
                        and (writable or not spare.k.is_inference())):
                    return self._spare.pop(i)
        return KVCache.empty(self.num_layers, self.num_kv_heads, self.head_dim, capacity, dtype, self.device)

    def release(self, cache: KVCache) -> None:
        """Hand a cache back for reuse; the caller must not touch it (or views of it) afterwards. SPARE_CACHES are
        kept of each dtype: working caches (the model's) and compact ones (a running sequence's)."""
        with self._spare_lock:
            if sum(s.dtype == cache.dtype for s in self._spare) < SPARE_CACHES:
                self._spare.append(KVCache(cache.k, cache.v, 0, cache.k_scale, cache.v_scale))

    def compact(self, cache: KVCache, dtype: torch.dtype) -> KVCache:
        """A fused cache as a running sequence keeps it, at `dtype` (`KVCache.compact`), written into a released
        compact cache where one fits (fresh pages cost ~3x the int8 pass itself on a 2-core VM: BENCHMARKS.md);
        a working cache left behind goes back for reuse."""
        if dtype == cache.dtype:
            return cache
        kept = cache.compact(dtype, self.new_cache(cache.capacity, dtype))
        self.release(cache)
        return kept

    # ---- the transformer block -------------------------------------------------------------

    def _qkv(self, ws: Weights, l: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (n, D), cos/sin (n, 1, hd) of the rows' positions → q (n, H, hd), k (n, Hkv, hd) post-RoPE, v."""
        w = ws.layers[l]
        n, hd = x.shape[0], self.head_dim
        qkv = ws.norm_linear(x, w.ln1, self.eps, w.wqkv, w.bqkv)
        if w.q_norm is None:
            return kernels.split_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
        q, k, v = q.view(n, -1, hd), k.view(n, -1, hd), v.view(n, -1, hd)  # qwen3: each head normed first
        q, k = kernels.rms_norm(q, w.q_norm, self.eps), kernels.rms_norm(k, w.k_norm, self.eps)
        return kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin), v

    def _finish(self, ws: Weights, l: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP. x (n, D), attn (n, H, hd) → (n, D)."""
        w = ws.layers[l]
        x = x + ws.linear(attn.reshape(x.shape[0], -1), w.wo)
        return x + ws.act_linear(ws.norm_linear(x, w.ln2, self.eps, w.wgu), w.wd)

    def _logits(self, ws: Weights, x: torch.Tensor) -> torch.Tensor:
        return ws.norm_linear(x, self.norm, self.eps, ws.lm_head).float()

    # ---- entry points ----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, positions: torch.Tensor | None = None) -> Prefill:
        """token_ids (n,) at positions (n,) ascending (default 0..n-1), causal among themselves."""
        token_ids = token_ids.to(self.device)
        n = token_ids.shape[0]
        pos = torch.arange(n, device=self.device) if positions is None else positions.to(self.device)
        self._check_positions(pos)
        k_out = torch.empty(self.num_layers, self.num_kv_heads, n, self.head_dim, dtype=self.dtype, device=self.device)
        v_out = torch.empty_like(k_out)
        local = torch.arange(n, device=self.device)  # causal order = row order
        plan, (cos, sin) = kernels.attention_plan(local), self.rope(pos)
        x = self.embed[token_ids]
        for l in range(self.num_layers):
            q, k, v = self._qkv(self.w, l, x, cos, sin)
            k_out[l] = k.transpose(0, 1)
            v_out[l] = v.transpose(0, 1)
            x = self._finish(self.w, l, x, kernels.selected_attention(q, k_out[l], v_out[l], local, self.scale, plan))
        return Prefill(self._logits(self.w, x[-1:])[0], k_out, v_out)

    @torch.inference_mode()
    def forward_selected(self, cache: KVCache, token_ids: torch.Tensor, rows: torch.Tensor, *,
                         deviation_layers: frozenset[int] = frozenset(), row_filter: RowFilter | None = None,
                         all_logits: bool = False, layers: int | None = None) -> Selected:
        """Recompute `rows` (n,) ascending, whose tokens are `token_ids` (n,), against `cache`.

        Row r is at position r and sees every row ≤ r. Recomputed K/V overwrite the cache.
        Rows past cache.length extend it (decode). At each layer in `deviation_layers` the
        per-row ||new − cached||² of K and V is measured as they are written; `row_filter` then
        picks the rows that go on. The others' K/V at that layer are fresh, but their attention
        and MLP are skipped there: no later layer would read their output. `layers`: run only the
        first that many (a probe: its logits are empty).
        """
        return self.advance(self.start_selected(cache, token_ids, rows, deviation_layers=deviation_layers,
                                                row_filter=row_filter, all_logits=all_logits, layers=layers))

    @torch.inference_mode()
    def start_selected(self, cache: KVCache, token_ids: torch.Tensor, rows: torch.Tensor, *,
                       deviation_layers: frozenset[int] = frozenset(), row_filter: RowFilter | None = None,
                       all_logits: bool = False, layers: int | None = None) -> Pass:
        """`forward_selected`'s arguments → its pass before the first layer, for `advance` to run."""
        rows = rows.to(self.device)
        end = int(rows[-1]) + 1
        self._check_positions(rows[-1:])
        cache.reserve(end)
        cache.length = max(cache.length, end)
        return Pass(cache, rows, self.embed[token_ids.to(self.device)], *self.rope(rows), kernels.attention_plan(rows),
                    deviation_layers, row_filter, all_logits, self.num_layers if layers is None else layers,
                    int(rows[0]), end)

    @torch.inference_mode()
    def advance(self, p: Pass, budget: float = math.inf) -> Selected | None:
        """Run `p`'s next layers, at least one, while their row-layers (rows × layers) stay within
        `budget`; → its `Selected` once the last layer ran, else None. Layer by layer over all the
        rows, as one `forward_selected` does: a pass advanced in any budgets gives the same bits."""
        spent = 0
        while p.layer < p.layers and (spent == 0 or spent + p.rows.numel() <= budget):
            spent += p.rows.numel()
            self._layer_of(p)
        if p.layer < p.layers:
            return None
        if p.layers < self.num_layers:
            return Selected(torch.empty(0), p.kv_rows, p.out_rows, p.deviations)
        logits = self._logits(self.w, p.x) if p.all_logits else self._logits(self.w, p.x[-1:])[0]
        return Selected(logits, p.kv_rows, p.out_rows, p.deviations)

    def _layer_of(self, p: Pass) -> None:
        """One layer of a pass: its rows' K/V written (measured and filtered at a deviation layer),
        then their attention and MLP."""
        l, rows = p.layer, p.rows
        p.kv_rows.append(rows)
        q, k, v = self._qkv(self.w, l, p.x, p.cos, p.sin)
        ck, cv = p.cache.placed(l)  # (Hkv, capacity, hd)
        if l in p.deviation_layers:  # a fused prefill's: its cache is at the model's dtype
            dev = kernels.deviation_scatter_(ck, rows, k), kernels.deviation_scatter_(cv, rows, v)
            p.deviations[l] = (rows, *dev)
            keep = None if p.row_filter is None else p.row_filter(Check(l, rows, *dev, q, ck, self.scale))
            if keep is not None and keep.shape[0] != rows.shape[0]:
                p.rows, p.x, q, p.cos, p.sin = rows[keep], p.x[keep], q[keep], p.cos[keep], p.sin[keep]
                p.plan, p.first, p.end = kernels.attention_plan(p.rows), int(p.rows[0]), int(p.rows[-1]) + 1
        else:
            p.cache.write(l, rows, k, v, p.first, p.end)
        p.out_rows.append(p.rows)
        if p.cache.reweight is None:
            k, v, *scales = p.cache.layer(l, p.end)
            attn = kernels.selected_attention(q, k, v, p.rows, self.scale, p.plan, scales)
        else:  # APE (blend/reweight.py)
            k, v = p.cache.float_layer(l, p.end, q.dtype)
            attn = p.cache.reweight.attention(l, rows, q, k, v, p.rows, self.scale, p.plan)
        p.x = self._finish(self.w, l, p.x, attn)
        p.layer += 1

    def row_work(self) -> tuple[int, int]:
        """Multiply-adds per row and layer: (q/k/v projections, everything after them)."""
        hd, d = self.head_dim, self.w.layers[0].wqkv.shape[1]
        inter = self.w.layers[0].wd.shape[1]
        return (self.num_heads + 2 * self.num_kv_heads) * hd * d, self.num_heads * hd * d + 3 * d * inter

    def _check_positions(self, pos: torch.Tensor) -> None:
        if pos.numel() and int(pos.max()) >= self.max_positions:
            raise ValueError(f"position {int(pos.max())} exceeds the model's limit of {self.max_positions}")


def _max_positions(cfg) -> int:
    """Longest sequence served exactly: the context length, or the sliding window if one applies."""
    limit = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    uses_window = cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
    return min(limit, window) if window and uses_window else limit
