"""A compact frame's scales at a byte each (codecs named `+b`): the step on a log grid, lo in quarter steps
from a center.

    step = grid(base)[e]                          # e uint8 a group; grid (256,) float32 = base · 2^(i/32)
    lo   = center + (m + dither) · step / 4       # m int8 a group; center 0 for V, c · grid[255] per K channel

A frame's `base` (float32) puts its largest min–max step at the top of the grid, so a group's step is its
own rounded up by at most 2^(1/32) (2.2%); a group 2^(255/32) ≈ 250× finer than the frame's largest takes
the grid's first step, still that much finer. lo is the group's own within an eighth of a step, so every
element of its range is within half a step of a level, as with float16 scales. A K channel's center (c
int8, once per chunk) is its midrange over the chunk, so a channel that sits far from zero, as K's outlier
channels do, keeps its blocks' m small.

`dither` offsets each V token's and K channel's lo by a fixed fraction of a quarter step (no bits: the
decoder computes it). Without it the levels of groups that share a step sit on one lattice, and a channel
that is nearly constant across tokens is rounded the same way in every one of them: errors that attention's
sum over tokens adds up instead of averaging out (measured: ΔKL at 4 passages, BENCHMARKS.md).

Against float16 lo and step: 16 bits a group instead of 32 (V: 0.25 bits an element at hd = 64 instead of
0.5), plus 8 bits a K channel per chunk. A frame with a group whose m does not fit a byte (lo more than 32
steps from its center) is written with float16 scales instead (`place` says which).
"""
from __future__ import annotations

import numpy as np
import torch

PER_OCTAVE = 32
TOP = 255  # the largest code
QUARTERS = 4  # lo's unit: a quarter of the group's step
_OCTAVES = np.exp2(np.arange(TOP + 1) / PER_OCTAVE)  # (256,) float64, read only
_OCTAVES.flags.writeable = False


def grid(base: float) -> np.ndarray:
    """(256,) float32 steps, ascending; the encoder and the decoder compute it alike from the stored base."""
    return (np.float64(np.float32(base)) * _OCTAVES).astype(np.float32)


def base_for(largest_step: float) -> np.float32:
    """The base whose grid's top step is at least `largest_step` (a frame's largest min–max step)."""
    if not largest_step > 0:
        return np.float32(1.0)  # a frame of constants: any step serves
    return np.float32(largest_step * (1 + 2.0**-18) / 2.0 ** (TOP / PER_OCTAVE))


def centers(lo: torch.Tensor, hi: torch.Tensor, steps: np.ndarray) -> np.ndarray:
    """A K frame's channel centers: lo, hi (H, 1, hd) its range over the chunk → c (H, 1, hd) int8, the
    midrange in whole top steps."""
    return (((lo + hi) / 2) / float(steps[TOP])).round().clamp(-127, 127).to(torch.int8).numpy()


def dither(shape: tuple[int, ...], k: bool) -> np.ndarray:
    """Groups of `shape` → float32 in [0, 1) of that shape: each group's offset of lo in quarter steps,
    frac(i · golden ratio) for the i-th V token or K channel (a K channel's blocks share it)."""
    own = (shape[-3], 1, shape[-1]) if k else shape  # K: (H, 1, hd), whatever leads
    d = np.arange(int(np.prod(own)), dtype=np.float64) * 0.6180339887498949 % 1.0
    return np.broadcast_to(d.astype(np.float32).reshape(own), shape)


def values(steps: np.ndarray, e: np.ndarray, m: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Codes e uint8, m int8 (…, H, B, W) → lo, step float32 of that shape; c (H, 1, hd) int8 K centers, None for
    V. The encoder computes its symbols from these, so both sides use the same floats: one compiled loop a frame
    (nibbles.byte_scales, its dither as `dither`), where numpy took five passes and most of a frame's overhead."""
    from . import nibbles  # numba compiles it on first use

    shape, rows = e.shape, (-1, *e.shape[-2:])  # rows: the leading dims (candidates, heads) as one
    lo, step = np.empty(shape, np.float32), np.empty(shape, np.float32)
    cc = (np.empty((0, 1, 0), np.int8) if c is None
          else np.ascontiguousarray(np.broadcast_to(c, (*shape[:-2], 1, shape[-1]))).reshape(-1, 1, shape[-1]))
    nibbles.byte_scales(np.ascontiguousarray(e).reshape(rows), np.ascontiguousarray(m).reshape(rows), cc, steps,
                        shape[-3] * shape[-1], lo.reshape(rows), step.reshape(rows))
    return lo, step


def place(lo: torch.Tensor, hi: torch.Tensor, top: int, steps: np.ndarray, c: np.ndarray | None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranges [lo, hi] (any shape) float32 at `top` + 1 levels → codes e (uint8), m (int8) and whether m fits a
    byte (bool), each of lo's shape: the first grid step that covers the range, lo at the nearest quarter step."""
    table = torch.from_numpy(steps)
    e = torch.searchsorted(table, ((hi - lo) / top).contiguous()).clamp_(max=TOP)
    step = table[e]
    center = 0.0 if c is None else torch.from_numpy(c).float() * float(steps[TOP])
    m = torch.round(QUARTERS * (lo - center) / step - torch.from_numpy(dither(tuple(lo.shape), c is not None).copy()))
    fits = (m >= -128) & (m <= 127)
    return e.to(torch.uint8), m.clamp_(-128, 127).to(torch.int8), fits
