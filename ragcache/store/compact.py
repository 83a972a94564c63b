"""The compact KV codec: a chunk's KV at 2–3 bits per element, one independent frame per layer and tensor.

    frames = encode_frames(k_pre_rope, v, spec)      # (L, Hkv, n, hd) float → list of 2·L bytes objects
    k_l, v_l = decode_layer(frames[2l], frames[2l+1], spec.k_bits[l], spec.v_bits[l], shape)

K is quantized before RoPE (its channels keep one range over the chunk; the fused prefill rotates
every row to its new place anyway), per (head, channel) over the chunk's tokens; V per (head, token)
over its channels. Both asymmetric (min–max) at the layer's bit width, 2–4 bits, the symbols of a
row packed two per byte (channel j in the low nibble, channel j + hd/2 in the high one, so unpacking
writes contiguous halves), then zstd: its Huffman stage codes the nibbles near their entropy (a
3-bit symbol costs ~2.3 bits). A frame is [u32 payload length][lo, step as float16][zstd payload];
it decodes alone, so a layer can be used before the next one has arrived.

Error bound (per element, before float16 rounding of the scales): |x − x̂| ≤ step / 2, where
step = (max − min) / (2^bits − 1) of its group.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

LEVEL = 3  # zstd: decoding speed does not depend on it; higher levels find nothing more in nibbles
_HEAD = struct.Struct("<I")


@dataclass(frozen=True)
class Spec:
    """Bits per layer for K and V (2..4); `name` is what the blob records."""

    name: str
    k_bits: tuple[int, ...]
    v_bits: tuple[int, ...]

    def __post_init__(self):
        if len(self.k_bits) != len(self.v_bits) or not all(2 <= b <= 4 for b in (*self.k_bits, *self.v_bits)):
            raise ValueError(f"codec {self.name}: one bit width per layer for K and V, each 2..4")

    @classmethod
    def uniform(cls, name: str, layers: int, k_bits: int, v_bits: int, boost: tuple[int, ...] = ()) -> "Spec":
        """The same widths everywhere, one more bit (at most 4) in the `boost` layers."""
        k = tuple(min(4, k_bits + (l in boost)) for l in range(layers))
        v = tuple(min(4, v_bits + (l in boost)) for l in range(layers))
        return cls(name, k, v)

    def mean_bits(self) -> float:
        return (sum(self.k_bits) + sum(self.v_bits)) / (2 * len(self.k_bits))


def _quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (H, n, hd) float, groups along `dim` → symbols (H, n, hd) uint8, lo and step float16 (the
    group shape, `dim` of size 1). The symbols are computed from the float16-rounded lo and step:
    what the decoder will use."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    top = (1 << bits) - 1
    step = ((hi - lo) / top).half()
    step = torch.where(step > 0, step, torch.ones_like(step))
    lo = lo.half()
    q = ((x - lo.float()) / step.float()).round_().clamp_(0, top).to(torch.uint8)
    return q.numpy(), lo.numpy(), step.numpy()


def _frame(x: torch.Tensor, bits: int, dim: int, cctx: zstandard.ZstdCompressor) -> bytes:
    q, lo, step = _quantize(x, bits, dim)
    half = q.shape[-1] // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # (H, n, hd/2): one byte, two symbols
    payload = cctx.compress(np.ascontiguousarray(packed).tobytes())
    return b"".join([_HEAD.pack(len(payload)), lo.tobytes(), step.tobytes(), payload])


def encode_frames(k: torch.Tensor, v: torch.Tensor, spec: Spec) -> list[bytes]:
    """k (pre-RoPE), v (L, Hkv, n, hd) → 2·L frames: k of layer 0, v of layer 0, k of layer 1, …"""
    if k.shape[-1] % 2:
        raise ValueError("the compact codec needs an even head dim")
    if k.shape[0] != len(spec.k_bits):
        raise ValueError(f"codec {spec.name} has bits for {len(spec.k_bits)} layers, this model {k.shape[0]}")
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    frames = []
    for l in range(k.shape[0]):
        frames.append(_frame(k[l], spec.k_bits[l], 1, cctx))  # K: per (head, channel), over tokens
        frames.append(_frame(v[l], spec.v_bits[l], 2, cctx))  # V: per (head, token), over channels
    return frames


class Decoder:
    """Frames back to float tensors; one per thread (a zstd context is not shared)."""

    def __init__(self):
        self._dctx = zstandard.ZstdDecompressor()

    def frame_into(self, frame: bytes | memoryview, out: torch.Tensor, per_token: bool) -> None:
        """One frame into out (H, n, hd), float32 (or bfloat16 on CUDA): per_token is V's grouping, else K's. On a CUDA `out` the
        zstd stage runs on the CPU and the unpacking on the GPU."""
        h, n, hd = out.shape
        groups = h * n if per_token else h * hd
        (size,) = _HEAD.unpack_from(frame, 0)
        head = _HEAD.size + 4 * groups
        if len(frame) != head + size:
            raise ValueError("frame length does not match its header")
        scales = np.frombuffer(frame, dtype=np.float16, count=2 * groups, offset=_HEAD.size)
        shape = (h, n, 1) if per_token else (h, 1, hd)
        lo = torch.from_numpy(scales[:groups].astype(np.float32)).view(shape).to(out.device)
        step = torch.from_numpy(scales[groups:].astype(np.float32)).view(shape).to(out.device)
        raw = self._dctx.decompress(memoryview(frame)[head:], max_output_size=h * n * hd // 2)
        if len(raw) != h * n * hd // 2:
            raise ValueError("frame payload has the wrong size")
        packed = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(h, n, hd // 2).to(out.device)
        half = hd // 2
        out[..., :half] = packed & 15  # uint8 → float as it is written
        out[..., half:] = packed >> 4
        out.mul_(step).add_(lo)

    def layer(self, k_frame, v_frame, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Layer frames into k_out (pre-RoPE), v_out (Hkv, n, hd) float32."""
        self.frame_into(k_frame, k_out, per_token=False)
        self.frame_into(v_frame, v_out, per_token=True)
