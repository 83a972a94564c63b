"""Chunk KV ⇄ stored form: a codec (`raw` in a storage dtype, or `compact`), bytes, checksum, key.

raw: float32/bfloat16/float16, or int8 symmetric with one float32 scale per (layer, head, token):
|x − x̂| ≤ max|row| / 254. compact (compact.py): 2–4 bits per element before zstd, a frame per layer
and tensor. The byte form is a safetensors blob that records its codec (blobs written before codecs
existed have none: raw), so a store may hold both. Its xxh3-128 checksum lives in its copy's SQL row
and is checked on every load: over the whole blob (raw), or over its head (compact), which holds
each frame's own xxh3-64, so a frame is checked before it is used, even alone.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from blend import ChunkKV, kernels
from blend.rope import delta_cos_sin

from .compact import Decoder, encode_frames
from .widths import Spec

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
    codec: str = "raw"  # or the compact variant's name: then k, v are None and `frames` hold them
    frames: list | None = None  # compact: 2·L frames (bytes or memoryviews): K of layer 0, V of layer 0, …
    shape: tuple[int, ...] | None = None  # compact: (L, Hkv, n, hd)

    @property
    def nbytes(self) -> int:
        frames = sum(len(f) for f in self.frames) if self.frames is not None else 0
        return frames + sum(t.nbytes for t in (self.token_ids, self.k, self.v, self.k_scale, self.v_scale)
                            if t is not None)

    def to(self, device: torch.device | str, pin: bool = False) -> "StoredKV":
        if self.frames is not None:  # compact bytes stay in host memory, decoded on each use
            return self

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


def rotate_k(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """k (L, Hkv, n, hd) float32 rotated by delta (n,) positions, into a new tensor."""
    cos, sin = delta_cos_sin(delta, inv_freq)
    out = torch.empty_like(k)
    kernels.realign_rope_(out.flatten(0, 1), cos, sin, src=k.flatten(0, 1))
    return out


def encode(chunk: ChunkKV, kv_dtype: str, spec: Spec | None = None, inv_freq: torch.Tensor | None = None) -> StoredKV:
    """The stored form: raw in `kv_dtype`, or compact with `spec` (K un-rotated with `inv_freq` first)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}")
    k, v = chunk.k.detach().cpu(), chunk.v.detach().cpu()
    if spec is not None:
        n = chunk.token_ids.shape[0]
        k = rotate_k(k.float(), -torch.arange(chunk.start, chunk.start + n), inv_freq)  # back to before RoPE
        return StoredKV(chunk.token_ids.cpu(), None, None, None, None, chunk.start, chunk.context, kv_dtype,
                        codec=spec.name, frames=encode_frames(k, v, spec), shape=tuple(k.shape))
    if kv_dtype == "int8":
        (qk, sk), (qv, sv) = _quantize(k), _quantize(v)
        return StoredKV(chunk.token_ids.cpu(), qk, qv, sk, sv, chunk.start, chunk.context, kv_dtype)
    dt = KV_DTYPES[kv_dtype]
    return StoredKV(chunk.token_ids.cpu(), k.to(dt).contiguous(), v.to(dt).contiguous(), None, None, chunk.start,
                    chunk.context, kv_dtype)


def decode(entry: StoredKV, dtype: torch.dtype, device: torch.device) -> ChunkKV:
    """Back to the runner's dtype and device (int8 dequantized by a kernel on CUDA); `lossless` only when
    the stored tensors were already in that dtype. A compact entry's K comes back before RoPE."""
    if entry.frames is not None:
        k, v = torch.empty(entry.shape), torch.empty(entry.shape)  # (L, Hkv, n, hd) float32
        noise = torch.empty(entry.shape[0], 2, entry.shape[2])  # (L, 2, n)
        decoder = Decoder()
        for l in range(entry.shape[0]):
            decode_layer(decoder, entry, l, k[l], v[l], noise[l])
        return ChunkKV(entry.token_ids.cpu(), k.to(device, dtype), v.to(device, dtype), entry.start, entry.context,
                       lossless=False, k_pre_rope=True, noise=noise)

    def restore(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = x.to(device, non_blocking=True)
        if scale is None:
            return x.to(dtype)
        flat = kernels.dequantize_int8(x.flatten(0, 1).contiguous(), scale.to(device).flatten(0, 1).contiguous(), dtype)
        return flat.view(x.shape)

    lossless = entry.k_scale is None and entry.k.dtype == dtype
    return ChunkKV(entry.token_ids.cpu(), restore(entry.k, entry.k_scale), restore(entry.v, entry.v_scale),
                   entry.start, entry.context, lossless)


def decode_layer(decoder: Decoder, entry: StoredKV, l: int, k_out: torch.Tensor, v_out: torch.Tensor,
                 noise: torch.Tensor) -> None:
    """Layer l of a compact entry into k_out (pre-RoPE), v_out (Hkv, n, hd) float32 and its rounding error into
    noise (2, n) (`Decoder.frame_into`); a bad frame is CorruptBlob."""
    try:
        decoder.layer(entry.frames[2 * l], entry.frames[2 * l + 1], k_out, v_out, noise)
    except Exception as e:  # noqa: BLE001 — zstd's or ours: the frame is unusable
        raise CorruptBlob(f"layer {l} of a compact KV blob does not decode: {e}") from None


_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.int64: "I64",
          torch.uint8: "U8"}
_DTYPES = {v: k for k, v in _CODES.items()}


def to_bytes(entry: StoredKV) -> bytes:
    """The safetensors format, written directly: one copy of the tensor bytes, no more. A compact
    entry's frames are one U8 tensor, last, their ends and xxh3-64 sums in the header."""
    meta = {"format": FORMAT, "start": str(entry.start), "context": entry.context, "kv_dtype": entry.kv_dtype}
    if entry.frames is not None:
        ends = np.cumsum([len(f) for f in entry.frames]).tolist()
        meta.update(codec=entry.codec, shape=json.dumps(entry.shape), frame_ends=json.dumps(ends),
                    frame_sums=json.dumps([xxhash.xxh3_64_hexdigest(f) for f in entry.frames]))
        tensors = {"token_ids": entry.token_ids,
                   "frames": torch.frombuffer(bytearray(b"".join(entry.frames)), dtype=torch.uint8)}
    else:
        tensors = {"token_ids": entry.token_ids, "k": entry.k, "v": entry.v}
        if entry.k_scale is not None:
            tensors.update(k_scale=entry.k_scale, v_scale=entry.v_scale)
    header: dict = {"__metadata__": meta}
    buffers, offset = [], 0
    for name, t in tensors.items():
        raw = t.detach().contiguous().cpu().view(torch.uint8).numpy()  # a view, not a copy
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        buffers.append(raw)
        offset += raw.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([len(head).to_bytes(8, "little"), head, *buffers])


def _header(blob) -> tuple[dict, dict, int]:
    """(tensor infos, metadata, where the tensor bytes start)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(bytes(blob[8 : 8 + n]))
    meta = header.pop("__metadata__")
    if meta.get("format") != FORMAT:
        raise ValueError(f"unknown format {meta.get('format')!r}")
    return header, meta, 8 + n


def head_length(blob) -> int:
    """Bytes the SQL checksum covers: the whole blob (raw), or up to a compact blob's frames."""
    try:
        header, meta, base = _header(blob[:8 + int.from_bytes(blob[:8], "little")])
        return base + header["frames"]["data_offsets"][0] if "codec" in meta else len(blob)
    except Exception:  # noqa: BLE001 — unparsable: the whole blob, whose sum will not match
        return len(blob)


def from_bytes(blob: bytes | bytearray) -> StoredKV:
    """Parse without copying: tensors (and compact frames) are views of `blob` (pass a bytearray to get
    writable ones). Every compact frame is checked against its sum in the header."""
    if isinstance(blob, bytes):
        blob = bytearray(blob)  # torch wants writable memory
    try:
        header, meta, base = _header(blob)
        t = {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            if base + b > len(blob):
                raise ValueError(f"{name} runs past the end of the blob")
            dtype = _DTYPES[info["dtype"]]
            count = (b - a) // torch.empty(0, dtype=dtype).element_size()
            t[name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=base + a).view(info["shape"])
        common = (int(meta["start"]), meta["context"], meta["kv_dtype"])
        if "codec" not in meta:
            return StoredKV(t["token_ids"], t["k"], t["v"], t.get("k_scale"), t.get("v_scale"), *common)
        frames = split_frames(memoryview(blob)[base + header["frames"]["data_offsets"][0]:], meta)
        return StoredKV(t["token_ids"], None, None, None, None, *common, codec=meta["codec"], frames=frames,
                        shape=tuple(json.loads(meta["shape"])))
    except Exception as e:  # any parse failure is corruption
        raise CorruptBlob(f"unreadable KV blob: {e}") from None


def split_frames(data: memoryview, meta: dict) -> list[memoryview]:
    """A compact blob's frame bytes → its frames, each checked against its xxh3-64 (ValueError if bad)."""
    ends, sums = json.loads(meta["frame_ends"]), json.loads(meta["frame_sums"])
    frames = [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    for i, (frame, want) in enumerate(zip(frames, sums)):
        if xxhash.xxh3_64_hexdigest(frame) != want:
            raise ValueError(f"frame {i} fails its checksum")
    return frames


def checksum(blob: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(blob)[: head_length(blob)])
