"""Chunk KV ⇄ stored form: storage dtype (float32/bfloat16/float16/int8), bytes, checksum, key.

int8 is symmetric with one float32 scale per (layer, head, token): |x − x̂| ≤ max|row| / 254.
The byte form is a safetensors blob; its xxh3-128 checksum lives in its copy's SQL row and is
checked on every load from disk or Redis.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import xxhash

from blend import ChunkKV, kernels

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
FORMAT = "ragcache-kv/1"


class CorruptBlob(Exception):
    """A stored blob failed its checksum or could not be parsed: drop it, recompute the chunk."""


@dataclass
class StoredKV:
    token_ids: torch.Tensor  # (n,) int64
    k: torch.Tensor  # (L, Hkv, n, hd) in the storage dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None  # (L, Hkv, n) float32 for int8, else None
    v_scale: torch.Tensor | None
    start: int
    context: str
    kv_dtype: str
    cost_s: float | None = None  # measured prefill (+ encode) seconds: what evicting it costs; not in the blob

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.token_ids, self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def to(self, device: torch.device | str, pin: bool = False) -> "StoredKV":
        def move(t):
            if t is None:
                return None
            t = t.to(device)
            return t.pin_memory() if pin else t

        return StoredKV(move(self.token_ids), move(self.k), move(self.v), move(self.k_scale), move(self.v_scale),
                        self.start, self.context, self.kv_dtype, self.cost_s)


def kv_key(fingerprint: str, token_ids: torch.Tensor, context: str, kv_dtype: str, salt: str) -> str:
    """(model, chunk tokens, how it was computed, storage dtype, tenant salt) → key. Never chained."""
    h = hashlib.blake2b(digest_size=16)
    for part in (fingerprint, context, kv_dtype, salt):
        h.update(part.encode() + b"\x00")
    h.update(token_ids.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (L, Hkv, n, hd) → int8 (L, Hkv, n, hd), scale (L, Hkv, n) float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def encode(chunk: ChunkKV, kv_dtype: str) -> StoredKV:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}")
    k, v = chunk.k.detach().cpu(), chunk.v.detach().cpu()
    if kv_dtype == "int8":
        (qk, sk), (qv, sv) = _quantize(k), _quantize(v)
        return StoredKV(chunk.token_ids.cpu(), qk, qv, sk, sv, chunk.start, chunk.context, kv_dtype)
    dt = KV_DTYPES[kv_dtype]
    return StoredKV(chunk.token_ids.cpu(), k.to(dt).contiguous(), v.to(dt).contiguous(), None, None, chunk.start,
                    chunk.context, kv_dtype)


def decode(entry: StoredKV, dtype: torch.dtype, device: torch.device) -> ChunkKV:
    """Back to the runner's dtype and device (int8 dequantized by a kernel on CUDA); `lossless` only when
    the stored tensors were already in that dtype."""
    def restore(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = x.to(device, non_blocking=True)
        if scale is None:
            return x.to(dtype)
        flat = kernels.dequantize_int8(x.flatten(0, 1).contiguous(), scale.to(device).flatten(0, 1).contiguous(), dtype)
        return flat.view(x.shape)

    lossless = entry.k_scale is None and entry.k.dtype == dtype
    return ChunkKV(entry.token_ids.cpu(), restore(entry.k, entry.k_scale), restore(entry.v, entry.v_scale),
                   entry.start, entry.context, lossless)


_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.int64: "I64"}
_DTYPES = {v: k for k, v in _CODES.items()}


def to_bytes(entry: StoredKV) -> bytes:
    """The safetensors format, written directly: one copy of the tensor bytes, no more."""
    tensors = {"token_ids": entry.token_ids, "k": entry.k, "v": entry.v}
    if entry.k_scale is not None:
        tensors.update(k_scale=entry.k_scale, v_scale=entry.v_scale)
    header: dict = {"__metadata__": {"format": FORMAT, "start": str(entry.start), "context": entry.context,
                                     "kv_dtype": entry.kv_dtype}}
    buffers, offset = [], 0
    for name, t in tensors.items():
        raw = t.detach().contiguous().cpu().view(torch.uint8).numpy()  # a view, not a copy
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        buffers.append(raw)
        offset += raw.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([len(head).to_bytes(8, "little"), head, *buffers])


def from_bytes(blob: bytes | bytearray) -> StoredKV:
    """Parse without copying: tensors are views of `blob` (pass a bytearray to get writable ones)."""
    if isinstance(blob, bytes):
        blob = bytearray(blob)  # torch wants writable memory
    try:
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(bytes(blob[8 : 8 + n]))
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise ValueError(f"unknown format {meta.get('format')!r}")
        base, t = 8 + n, {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            if base + b > len(blob):
                raise ValueError(f"{name} runs past the end of the blob")
            dtype = _DTYPES[info["dtype"]]
            count = (b - a) // torch.empty(0, dtype=dtype).element_size()
            t[name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=base + a).view(info["shape"])
        return StoredKV(t["token_ids"], t["k"], t["v"], t.get("k_scale"), t.get("v_scale"), int(meta["start"]),
                        meta["context"], meta["kv_dtype"])
    except Exception as e:  # any parse failure is corruption
        raise CorruptBlob(f"unreadable KV blob: {e}") from None


def checksum(blob: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(blob)
