"""The compact KV codec: a chunk's KV at ~3 bits per element, one independent frame per layer and tensor.

    frames = encode_frames(k_pre_rope, v, spec)      # (L, Hkv, n, hd) float → list of 2·L bytes objects
    Decoder().layer(frames[2l], frames[2l+1], k_out, v_out)   # (Hkv, n, hd) each

K is quantized before RoPE (its channels keep one range; the fused prefill rotates every row to its new
place anyway), per (head, channel) over a block of tokens; V per (head, token) over its channels. Both
asymmetric at the layer's bit width, 2–8 bits; up to 4 the symbols of a row are packed two per byte (channel j
in the low nibble, channel j + hd/2 in the high one, so unpacking writes contiguous halves), wider ones take a
byte each (WIDE); then zstd: its Huffman stage codes the symbols near their entropy (a 3-bit symbol costs ~2.3
bits).

A spec with `k_group` G > 0 (names with +gG) quantizes K per block of G tokens (the last one shorter), its
range clipped where that lowers the block's squared error: a chunk-wide channel range is set by a few
outlier tokens, and K's error is what moves the model's output (measured: BENCHMARKS.md). `v_rotate`
(+r) quantizes V after a Hadamard rotation of its channels (orthonormal, its own inverse), which spreads
an outlier channel over all of them; the decoder rotates back. `byte_scales` (+b) writes each group's lo
and step in a byte each instead of two float16s (scales.py: half the scales' bits). `keys` (+f) chooses K's
symbols by error feedback against the queries that read them (feedback.py): the same scales and frames, so
the decoder cannot tell. Plain kXvY specs write the first format: K over the whole chunk, plain min–max.

A frame is [u32 payload length | kind << 28][u32 G: K_BLOCKS only][scales][zstd payload]; its kind's bits
say K in blocks of G tokens (K_BLOCKS), V rotated (V_ROTATED), a byte a symbol (WIDE), and the scales:
float16 lo then step a group, or with BYTES a float32 base, a K frame's channel centers (int8) and then e
(uint8) and m (int8) a group (a wide frame's lo rarely fits m's ±32 steps: it falls back to float16); kind 0
is the first format. A frame decodes alone, so a layer can be used before the next one
has arrived; frames of every kind decode, so old blobs stay readable.

Error bound (per element, before float16 rounding of the scales): |x − x̂| ≤ step / 2, where
step = (max − min) / (2^bits − 1) of its group; with clipping (+g), an element outside the group's clipped
range [lo, lo + step·(2^bits − 1)] is off by its distance to it plus step / 2 (the range is never shrunk
below half: CLIP); with +r the bound holds for the rotated V, and so for its L2 norm per token; with +b the
step is the group's rounded up on the frame's grid (≤ 2.2% over it, or the grid's first step: scales.py); with
+f a K element is only within its group's [lo, lo + step·(2^bits − 1)]: its symbol is not its nearest.
"""
from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from . import scales
from .widths import Spec

LEVEL = 3  # zstd: decoding speed does not depend on it; higher levels find nothing more in nibbles
_U32 = struct.Struct("<I")
_KIND = 28  # a frame's kind sits above its payload length (< 256 MiB)
LEGACY, K_BLOCKS, V_ROTATED, BYTES, WIDE = 0, 1, 2, 4, 8  # bits of a frame's kind
CLIP = torch.linspace(1.0, 0.5, 11)  # fractions of a group's range tried around its middle (encode only)


def hadamard(hd: int) -> torch.Tensor:
    """(hd, hd) float32 orthonormal and symmetric: its own inverse. hd a power of two."""
    if hd & (hd - 1):
        raise ValueError("rotating V needs a power-of-two head dim")
    h = torch.ones(1, 1)
    while h.shape[0] < hd:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / hd**0.5


def _quantize(x: torch.Tensor, bits: int, dim: int, clip: bool, steps: np.ndarray | None = None,
              c: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """x (H, n, hd) float, groups along `dim` → symbols (H, n, hd) uint8 and the scales: lo and step float16
    (the group shape, `dim` of size 1), or with a byte grid `steps` (scales.py; c: K's centers) codes e uint8
    and m int8 — None where an m does not fit a byte. With `clip`, each group's range is the CLIP fraction of
    it with the least squared error at the scales the frame will hold: a range chosen at exact scales and then
    put on the byte grid lost K's fidelity (BENCHMARKS.md). The symbols are computed from those scales."""
    x = x.float()
    top = (1 << bits) - 1
    if steps is not None:
        return _placed(x, top, dim, (CLIP if clip else CLIP[:1]).numpy(), steps, c)
    lo0, hi0 = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    half = (hi0 - lo0) * (CLIP if clip else CLIP[:1]).view(-1, 1, 1, 1) / 2
    lo, hi = (lo0 + hi0) / 2 - half, (lo0 + hi0) / 2 + half  # (C, *group): the ranges tried
    lo, step = lo.half(), ((hi - lo) / top).half()
    lo, step = _best(x, dim, top, lo, torch.where(step > 0, step, torch.ones_like(step)), [lo, step])
    return _symbols(x, lo, step, top), [lo.numpy(), step.numpy()]


def _placed(x: torch.Tensor, top: int, dim: int, clip: np.ndarray, steps: np.ndarray, c: np.ndarray | None
            ) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """`_quantize` on the byte grid, in one compiled pass (nibbles.place_best): each group on the last axis."""
    from . import nibbles  # numba compiles it on first use

    rows = np.ascontiguousarray(x.transpose(1, 2).numpy() if dim == 1 else x.numpy())  # K (H, hd, n), V (H, n, hd)
    centers = (np.zeros(rows.shape[:2], np.float32) if c is None
               else np.ascontiguousarray(c[:, 0, :].astype(np.float32) * steps[scales.TOP]))
    e, m = np.empty(rows.shape[:2], np.uint8), np.empty(rows.shape[:2], np.int8)
    q = np.empty(rows.shape, np.uint8)
    if not nibbles.place_best(rows, top, steps, clip, centers, e, m, q):
        return None
    if dim == 1:  # back to (H, n, hd) and the codes' (H, 1, hd)
        return np.ascontiguousarray(q.transpose(0, 2, 1)), [e[:, None, :], m[:, None, :]]
    return q, [e[..., None], m[..., None]]


def _best(x: torch.Tensor, dim: int, top: int, lo: torch.Tensor, step: torch.Tensor, codes: list[torch.Tensor]
          ) -> list[torch.Tensor]:
    """Candidates lo, step (C, *group) for x (H, n, hd) → of `codes` (C, *group) each, the candidate with the
    least squared error per group (the first of equals), (*group) each."""
    lo, step = lo.float(), step.float()
    q = ((x - lo) / step).round_().clamp_(0, top)  # (C, H, n, hd)
    best = (q.mul_(step).add_(lo).sub_(x)).square_().sum(dim + 1, keepdim=True).argmin(0, keepdim=True)
    return [t.gather(0, best).squeeze(0) for t in codes]


def _symbols(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, top: int) -> np.ndarray:
    return ((x - lo.float()) / step.float()).round_().clamp_(0, top).to(torch.uint8).numpy()


def _frame(kind: int, q: np.ndarray, parts: list[np.ndarray], cctx: zstandard.ZstdCompressor, bits: int,
           group: int = 0) -> bytes:
    if bits > 4:
        kind, packed = kind | WIDE, q  # (H, n, hd): a byte a symbol
    else:
        half = q.shape[-1] // 2
        packed = q[..., :half] | (q[..., half:] << 4)  # (H, n, hd/2): one byte, two symbols
    payload = cctx.compress(np.ascontiguousarray(packed).tobytes())
    head = _U32.pack(len(payload) | kind << _KIND) + (_U32.pack(group) if kind & K_BLOCKS else b"")
    return b"".join([head, *(np.ascontiguousarray(p).tobytes() for p in parts), payload])


def _joined(parts: list[tuple[np.ndarray, list[np.ndarray]]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """K blocks' symbols and scales, each concatenated along tokens (scales: (H, blocks, hd))."""
    return (np.concatenate([p[0] for p in parts], axis=1),
            [np.concatenate([p[1][i] for p in parts], axis=1) for i in range(len(parts[0][1]))])


def _k_frame(k: torch.Tensor, bits: int, group: int, byte_scales: bool, cctx, keys: tuple | None = None) -> bytes:
    """k (H, n, hd) pre-RoPE → a frame: per (head, channel) over the chunk, or over blocks of `group` tokens; with
    `keys` (weighting, layer) the symbols chosen by error feedback under the scales nearest rounding chose."""
    k = k.float()
    blocks = [k[:, s : s + group] for s in range(0, k.shape[1], group)] if group else [k]
    kind, top, head = K_BLOCKS if group else LEGACY, (1 << bits) - 1, None
    if byte_scales:
        base = scales.base_for(max(float((b.amax(1) - b.amin(1)).max()) for b in blocks) / top)
        steps = scales.grid(base)
        c = scales.centers(k.amin(1, keepdim=True), k.amax(1, keepdim=True), steps)  # (H, 1, hd) int8
        parts = [_quantize(b, bits, 1, bool(group), steps, c) for b in blocks]
        if all(p is not None for p in parts):
            q, codes = _joined(parts)
            kind, head = kind | BYTES, [np.array([base]), c, *codes]
    if head is None:
        q, head = _joined([_quantize(b, bits, 1, bool(group)) for b in blocks])
    if keys is not None:  # the scales as the decoder computes them, only where feedback needs them
        lo, step = scales.values(steps, *head[2:], head[1]) if kind & BYTES else [x.astype(np.float32) for x in head]
        q = keys[0].symbols(keys[1], k, lo, step, group or k.shape[1], top)
    return _frame(kind, q, head, cctx, bits, group)


def _v_frame(v: torch.Tensor, bits: int, rotate: torch.Tensor | None, byte_scales: bool, cctx) -> bytes:
    """v (H, n, hd) → a frame: per (head, token) over its channels, rotated first with `rotate` (hd, hd)."""
    x = v.float() @ rotate if rotate is not None else v.float()
    kind = LEGACY if rotate is None else V_ROTATED
    if byte_scales:
        base = scales.base_for(float((x.amax(2) - x.amin(2)).max()) / ((1 << bits) - 1))
        got = _quantize(x, bits, 2, False, scales.grid(base))
        if got is not None:
            return _frame(kind | BYTES, got[0], [np.array([base]), *got[1]], cctx, bits)
    return _frame(kind, *_quantize(x, bits, 2, False), cctx, bits)


def encode_frames(k: torch.Tensor, v: torch.Tensor, spec: Spec) -> list[bytes]:
    """k (pre-RoPE), v (L, Hkv, n, hd) → 2·L frames: k of layer 0, v of layer 0, k of layer 1, …"""
    if k.shape[-1] % 2:
        raise ValueError("the compact codec needs an even head dim")
    if k.shape[0] != len(spec.k_bits):
        raise ValueError(f"codec {spec.name} has bits for {len(spec.k_bits)} layers, this model {k.shape[0]}")
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    rotate = hadamard(k.shape[-1]) if spec.v_rotate else None
    frames = []
    for l in range(k.shape[0]):
        keys = None if spec.keys is None else (spec.keys, l)
        frames.append(_k_frame(k[l], spec.k_bits[l], spec.k_group, spec.byte_scales, cctx, keys))
        frames.append(_v_frame(v[l], spec.v_bits[l], rotate, spec.byte_scales, cctx))
    return frames


class Decoder:
    """Frames back to float tensors; one per thread (a zstd context is not shared)."""

    def __init__(self):
        self._dctx = zstandard.ZstdDecompressor()
        self._rotations: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _rotation(self, hd: int, device: torch.device) -> torch.Tensor:
        if (hd, device) not in self._rotations:
            self._rotations[hd, device] = hadamard(hd).to(device)
        return self._rotations[hd, device]

    def frame_into(self, frame: bytes | memoryview, out: torch.Tensor, per_token: bool,
                   noise: torch.Tensor | None = None) -> None:
        """One frame into out (H, n, hd), float32 (or bfloat16 on CUDA): per_token is V's grouping, else K's.
        On a CUDA `out` the zstd stage runs on the CPU and the unpacking on the GPU. `noise` (n,) float32 CPU,
        when given, gets each token's expected squared rounding error summed over heads and channels (step²/12
        an element; a rotation keeps it; K's clipped outliers err more, uncounted)."""
        from . import nibbles  # numba compiles it on first use

        h, n, hd = out.shape
        (word,) = _U32.unpack_from(frame, 0)
        size, kind = word & ((1 << _KIND) - 1), word >> _KIND
        if kind & ~(BYTES | WIDE) not in ((LEGACY, V_ROTATED) if per_token else (LEGACY, K_BLOCKS)):
            raise ValueError(f"a {'V' if per_token else 'K'} frame of kind {kind}")
        group = _U32.unpack_from(frame, _U32.size)[0] if kind & K_BLOCKS else n
        if group <= 0:
            raise ValueError("a K frame with an empty token block")
        blocks = -(-n // group)
        shape = (h, n, 1) if per_token else (h, blocks, hd)
        groups = shape[0] * shape[1] * shape[2]
        start = _U32.size * (2 if kind & K_BLOCKS else 1)
        centers = 0 if per_token or not kind & BYTES else h * hd
        head = start + (4 + centers + 2 * groups if kind & BYTES else 4 * groups)
        if len(frame) != head + size:
            raise ValueError("frame length does not match its header")
        if kind & BYTES:  # scales.py: a float32 base, K's centers, then e and m a group
            base = np.frombuffer(frame, dtype=np.float32, count=1, offset=start)[0]
            c = np.frombuffer(frame, dtype=np.int8, count=centers, offset=start + 4).reshape(h, 1, hd) if centers else None
            e, m = (np.frombuffer(frame, dtype=t, count=groups, offset=start + 4 + centers + i * groups).reshape(shape)
                    for i, t in enumerate((np.uint8, np.int8)))
        else:
            f16 = np.frombuffer(frame, dtype=np.float16, count=2 * groups, offset=start).astype(np.float32)
            lo, step = f16[:groups].reshape(shape), f16[groups:].reshape(shape)
        width = hd if kind & WIDE else hd // 2  # symbols a row: a byte each, or two a byte
        raw = self._dctx.decompress(memoryview(frame)[head:], max_output_size=h * n * width)
        if len(raw) != h * n * width:
            raise ValueError("frame payload has the wrong size")
        packed = np.frombuffer(raw, dtype=np.uint8).reshape(h, n, width)
        err = np.empty(0, np.float32) if noise is None else noise.numpy()
        on_cpu = out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
        if on_cpu and kind & BYTES:  # scales, symbols and noise in one compiled call
            nibbles.byte_frame(base, scales.OCTAVES, e, m, np.empty((0, 1, 0), np.int8) if c is None else c, packed,
                               group, per_token, out.numpy(), err)
        else:
            if kind & BYTES:
                lo, step = scales.values(scales.grid(base), e, m, c)
            if on_cpu:
                nibbles.frame(packed, lo, step, group, per_token, out.numpy(), err)
            else:
                self._unpack(packed, lo, step, per_token, group, out)
                if noise is not None:
                    nibbles.noise(step, per_token, hd, group, err)
        if kind & V_ROTATED:
            out.copy_(out @ self._rotation(hd, out.device).to(out.dtype))

    @staticmethod
    def _unpack(packed: np.ndarray, lo: np.ndarray, step: np.ndarray, per_token: bool, group: int,
                out: torch.Tensor) -> None:
        """`nibbles`' work in torch, on the output's device: packed (H, n, hd/2) symbols two a byte, or (H, n, hd)
        a byte each, × step + lo, the scales (H, n, 1) per token or (H, blocks, hd) per channel block of `group`
        tokens, into out (H, n, hd)."""
        h, n, hd = out.shape
        lo, step = (torch.from_numpy(x).to(out.device) for x in (lo, step))
        packed = torch.from_numpy(packed.copy()).to(out.device)  # frombuffer's view of bytes is read-only
        if packed.shape[-1] == hd:
            out.copy_(packed)  # uint8 → float as it is written
        else:
            out[..., : hd // 2] = packed & 15
            out[..., hd // 2 :] = packed >> 4
        if per_token or step.shape[1] == 1:
            out.mul_(step).add_(lo)  # (h, n, 1) per token, (h, 1, hd) per channel: broadcast
        else:
            full = n // group * group  # whole blocks as one strided view, the shorter last one alone
            body = out[:, :full].view(h, n // group, group, hd)
            body.mul_(step[:, : n // group, None]).add_(lo[:, : n // group, None])
            if full < n:
                out[:, full:].mul_(step[:, -1:]).add_(lo[:, -1:])

    def layer(self, k_frame, v_frame, k_out: torch.Tensor, v_out: torch.Tensor, noise: torch.Tensor | None = None
              ) -> None:
        """Layer frames into k_out (pre-RoPE), v_out (Hkv, n, hd) float32; `noise` (2, n): K's and V's
        expected squared rounding error per token (see `frame_into`)."""
        self.frame_into(k_frame, k_out, per_token=False, noise=None if noise is None else noise[0])
        self.frame_into(v_frame, v_out, per_token=True, noise=None if noise is None else noise[1])
