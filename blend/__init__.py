"""blend: our model runner, chunk-KV fusion with RoPE re-alignment, recompute selection, kernels.

Never imports ragcache or api (DESIGN.md layering).
"""
from . import hugepages, openmp, vectors  # first: they must run before torch and numba load
from .cache import KVCache
from .chunk import ALONE, ChunkKV, PrefixKV, compute_chunk, compute_prefix, ids_key, tokens_only
from .deferred import Deferred, after_first, repair_of
from .fuse import FusedResult, fuse_and_prefill
from .model import Model, ModelError, load_model
from .runner import Runner
from .select import A3, Adaptive, BlendQ, CacheBlend, Epic, Full, Prefix, Probe, Reuse, make_policy

__all__ = [
    "A3", "ALONE", "Adaptive", "BlendQ", "CacheBlend", "ChunkKV", "Deferred", "Epic", "Full", "FusedResult", "KVCache",
    "Model", "ModelError", "Prefix", "PrefixKV", "Probe", "Reuse", "Runner", "after_first", "compute_chunk",
    "compute_prefix", "fuse_and_prefill", "ids_key", "load_model", "make_policy", "repair_of", "tokens_only",
]
