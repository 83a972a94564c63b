"""A compact frame's scales at a byte each (codecs named `+b`): the step on a log grid, lo in quarter steps
from a center.

    step = grid(base)[e]                          # e uint8 a group; grid (256,) float32 = base · 2^(i/32)
    lo   = center + (m + dither) · step / 4       # m int8 a group; center 0 for V, c · grid[255] per K channel
    dither = frac(i · golden ratio)               # i: the V token's or K channel's index (its blocks share it)

A frame's `base` (float32) puts its largest min–max step at the top of the grid, so a group's step is its
own rounded up by at most 2^(1/32) (2.2%); a group 2^(255/32) ≈ 250× finer than the frame's largest takes
the grid's first step, still that much finer. lo is the group's own within an eighth of a step, so every
element of its range is within half a step of a level, as with float16 scales. A K channel's center (c
int8, once per chunk) is its midrange over the chunk, so a channel that sits far from zero, as K's outlier
channels do, keeps its blocks' m small.

The dither offsets each V token's and K channel's lo by a fixed fraction of a quarter step (no bits: the
decoder computes it). Without it the levels of groups that share a step sit on one lattice, and a channel
that is nearly constant across tokens is rounded the same way in every one of them: errors that attention's
sum over tokens adds up instead of averaging out (measured: ΔKL at 4 passages, BENCHMARKS.md).

Against float16 lo and step: 16 bits a group instead of 32 (V: 0.25 bits an element at hd = 64 instead of
0.5), plus 8 bits a K channel per chunk. A frame with a group whose m does not fit a byte (lo more than 32
steps from its center) is written with float16 scales instead (the encoder's `nibbles.place_best` says which).
"""
from __future__ import annotations

import numpy as np
import torch

PER_OCTAVE = 32
TOP = 255  # the largest code
OCTAVES = np.exp2(np.arange(TOP + 1) / PER_OCTAVE)  # (256,) float64, read only
OCTAVES.flags.writeable = False


def grid(base: float) -> np.ndarray:
    """(256,) float32 steps, ascending; the encoder and the decoder compute it alike from the stored base."""
    return (np.float64(np.float32(base)) * OCTAVES).astype(np.float32)


def base_for(largest_step: float) -> np.float32:
    """The base whose grid's top step is at least `largest_step` (a frame's largest min–max step)."""
    if not largest_step > 0:
        return np.float32(1.0)  # a frame of constants: any step serves
    return np.float32(largest_step * (1 + 2.0**-18) / 2.0 ** (TOP / PER_OCTAVE))


def centers(lo: torch.Tensor, hi: torch.Tensor, steps: np.ndarray) -> np.ndarray:
    """A K frame's channel centers: lo, hi (H, 1, hd) its range over the chunk → c (H, 1, hd) int8, the
    midrange in whole top steps."""
    return (((lo + hi) / 2) / float(steps[TOP])).round().clamp(-127, 127).to(torch.int8).numpy()


def values(steps: np.ndarray, e: np.ndarray, m: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A frame's codes e uint8, m int8 (H, B, W) a group each → lo, step float32 of that shape; c (H, 1, hd) int8
    K centers, None for V. The encoder (nibbles.place_best) computed its symbols from these same floats: both
    sides run the same compiled operations (nibbles._lo, nibbles._dither)."""
    from . import nibbles  # numba compiles it on first use

    lo, step = np.empty(e.shape, np.float32), np.empty(e.shape, np.float32)
    nibbles.byte_scales(e, m, np.empty((0, 1, 0), np.int8) if c is None else c, steps, lo, step)
    return lo, step
