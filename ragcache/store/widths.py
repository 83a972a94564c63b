"""The compact codec's widths: bits per layer for K and V, and the form of its frames (compact.py), as a codec name or
a calibration says them (codecs.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .feedback import KeyWeighting


@dataclass(frozen=True)
class Spec:
    """Bits per layer for K and V (2..8), K's token block (0: the whole chunk, unclipped), V's rotation,
    scales at a byte each (scales.py), K's symbols by error feedback against `keys` (feedback.py; None:
    nearest); `name` is what the blob records."""

    name: str
    k_bits: tuple[int, ...]
    v_bits: tuple[int, ...]
    k_group: int = 0
    v_rotate: bool = False
    byte_scales: bool = False
    keys: KeyWeighting | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if len(self.k_bits) != len(self.v_bits) or not all(2 <= b <= 8 for b in (*self.k_bits, *self.v_bits)):
            raise ValueError(f"codec {self.name}: one bit width per layer for K and V, each 2..8")
        if self.k_group < 0:
            raise ValueError(f"codec {self.name}: K's token block must be positive (0: the whole chunk)")

    @classmethod
    def uniform(cls, name: str, layers: int, k_bits: int, v_bits: int, boost: tuple[int, ...] = (),
                k_group: int = 0, v_rotate: bool = False, shifts: tuple[tuple[str, int, int, int], ...] = (),
                byte_scales: bool = False, keys: KeyWeighting | None = None,
                widths: tuple[tuple[str, int, int], ...] = ()) -> "Spec":
        """k_bits, v_bits in every layer; each shift (tensor "k" or "v", +1 or -1, layers a..b-1, clamped like a
        slice) moves that tensor's width by one in its layers (within 2..4); a `boost` layer has one more bit
        than k_bits, v_bits for both (at most 4), whatever the shifts; each of `widths` (tensor, layer, bits 2..8)
        sets that one tensor's width last (a layer past the model's is ignored, as a boost's is)."""
        width = {"k": [k_bits] * layers, "v": [v_bits] * layers}
        for tensor, delta, a, b in shifts:
            for l in range(layers)[a:b]:
                width[tensor][l] = min(4, max(2, width[tensor][l] + delta))
        for l in boost:
            if 0 <= l < layers:
                width["k"][l], width["v"][l] = min(4, k_bits + 1), min(4, v_bits + 1)
        for tensor, l, bits in widths:
            if 0 <= l < layers:
                width[tensor][l] = bits
        return cls(name, tuple(width["k"]), tuple(width["v"]), k_group, v_rotate, byte_scales, keys)

    def mean_bits(self) -> float:
        return (sum(self.k_bits) + sum(self.v_bits)) / (2 * len(self.k_bits))
