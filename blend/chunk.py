"""Per-chunk KV, computed once: alone (positions 0..n-1) or behind the shared system prefix."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from .runner import Runner

ALONE = ""  # ChunkKV.context of a chunk computed with nothing before it


def ids_key(token_ids: torch.Tensor | list[int]) -> str:
    """A stable hash of token ids: names a prefix, keys a chunk."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    return xxhash.xxh3_128_hexdigest(",".join(map(str, ids)).encode())


@dataclass
class PrefixKV:
    """The exact system prefix: reused as a prefix cache, never approximated."""

    token_ids: torch.Tensor  # (P,)
    k: torch.Tensor  # (L, Hkv, P, hd) post-RoPE at 0..P-1
    v: torch.Tensor  # (L, Hkv, P, hd)

    @property
    def key(self) -> str:
        return ids_key(self.token_ids)

    def __len__(self) -> int:
        return self.token_ids.shape[0]


@dataclass
class ChunkKV:
    """One chunk's K (post-RoPE) and V at the positions it was computed at."""

    token_ids: torch.Tensor  # (n,)
    k: torch.Tensor | None  # (L, Hkv, n, hd) post-RoPE at start..start+n-1; None: tokens only (full)
    v: torch.Tensor | None  # (L, Hkv, n, hd)
    start: int  # 0 when computed alone, P when behind a P-token prefix
    context: str  # ALONE, or the key of the prefix it was computed behind
    lossless: bool = True  # False: k/v went through a lossy store format (int8, a narrower float, compact)
    k_pre_rope: bool = False  # True: k is before RoPE (a compact blob's), rotated to its place when fused
    ready: object | None = None  # layers still arriving on another thread: ready.wait(l) returns once layer l is in
    # (L, 2, n) float32: each token's expected squared rounding error of K and V from a lossy store, summed over
    # heads and hd (what it adds to cacheblend's deviation); layer l is in once ready.wait(l) returns. None: unknown
    noise: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def is_exact_at(self, offset: int, before: str) -> bool:
        """True when this KV is what a full prefill would compute here: same place, same context.

        `before` is the key of the prefix the chunk would follow (ALONE when nothing precedes it).
        Exact means exact bits: KV that went through a lossy format never is.
        """
        return self.lossless and offset == self.start and before == self.context


def tokens_only(token_ids: torch.Tensor) -> ChunkKV:
    """A chunk for a policy that recomputes it whole (`reads_chunk_kv` False): no KV to load."""
    return ChunkKV(token_ids, None, None, 0, ALONE)


def compute_prefix(runner: Runner, token_ids: torch.Tensor) -> PrefixKV:
    pre = runner.prefill(token_ids)
    return PrefixKV(token_ids.cpu(), pre.k, pre.v)


def compute_chunk(runner: Runner, token_ids: torch.Tensor, prefix: PrefixKV | None = None) -> ChunkKV:
    """Prefill a chunk alone, or behind `prefix` (reusing its KV) keeping only the chunk's rows."""
    token_ids = token_ids.cpu()
    if prefix is None:
        pre = runner.prefill(token_ids)
        return ChunkKV(token_ids, pre.k, pre.v, 0, ALONE)
    p, n = len(prefix), token_ids.shape[0]
    cache = runner.new_cache(p + n)
    cache.k[:, :, :p], cache.v[:, :, :p] = prefix.k, prefix.v
    cache.length = p
    runner.forward_selected(cache, token_ids, torch.arange(p, p + n))
    k, v = cache.rows(p, p + n)
    return ChunkKV(token_ids, k.clone(), v.clone(), p, prefix.key)
