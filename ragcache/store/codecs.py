"""Which codec a deployment writes (RAGCACHE_KV_CODEC), by name:

    raw            today's blobs, in RAGCACHE_KV_DTYPE (lossless at float32)
    compact        this model's calibrated bit widths (`ragcache calibrate-codec`), else DEFAULT
    compact-kXvY   X bits for K and Y for V in every layer (2..4), e.g. compact-k3v3; `+k16:30` one more bit
                   for K in layers 16..29, `-v0:8` one less for V in layers 0..7 (ranges clamp like slices);
                   `+L0` layer 0 at X+1, Y+1 (compact-k3v3+L0); `+v1=8` V of layer 1 at 8 bits (2..8, K
                   likewise, set last; past 4 bits a symbol takes a byte: compact.py's WIDE frames); `+g64` K
                   in clipped blocks of 64 tokens, `+r` V rotated (compact.py), `+b` every scale in a byte
                   (scales.py), `+f` K's symbols by error feedback against this model's queries (feedback.py;
                   needs `ragcache calibrate-codec`), e.g. compact-k3v3+k16:30+L1+v1=8+g64+r+b+f

Decoding never needs the name: a compact blob carries its frames' scales and the encoder's widths.
The calibration of a model is a small JSON file in RAGCACHE_HOME/codec/, written once on dev data, and beside it
the queries' weighting that `+f` (and a calibrated `compact`) encodes K against.
"""
from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

from ..config import KV_CODEC, KV_CODEC_FORM
from ..errors import UserError
from .widths import Spec
from .feedback import KeyWeighting

DEFAULT = "compact-k3v3+k16:30+L1+g96+b"  # `compact` for a model never calibrated: 3.17 bits; K one bit more in
# layers 16..29, where the 10-passage fidelity is lost, paid for by scales at a byte each; layer 1, CacheBlend's
# check layer, one bit more: its deviation otherwise ranks tokens by their quantization error (BENCHMARKS.md)
log = logging.getLogger("ragcache.store")


def calibration_path(home: Path, fingerprint: str) -> Path:
    return home / "codec" / f"{fingerprint}.json"


def keys_path(home: Path, fingerprint: str) -> Path:
    return home / "codec" / f"{fingerprint}.keys.pt"


def _keys(home: Path, fingerprint: str, name: str) -> KeyWeighting:
    path = keys_path(home, fingerprint)
    try:
        return KeyWeighting.load(path)
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError) as e:  # by calibration
        raise UserError(f"codec {name}: K's symbols by feedback need this model's query weighting ({path}: "
                        f"{type(e).__name__}); run `ragcache calibrate-codec` first") from e


def spec_for(name: str, num_layers: int, home: Path, fingerprint: str) -> Spec | None:
    """The encoder's widths for codec `name` on this model; None for raw."""
    if name == "raw":
        return None
    if name == "compact":
        path = calibration_path(home, fingerprint)
        if path.exists():
            try:
                cal = json.loads(path.read_bytes())
                keys = _keys(home, fingerprint, name) if cal.get("feedback") else None
                return Spec("compact", tuple(map(int, cal["k_bits"])), tuple(map(int, cal["v_bits"])),
                            int(cal.get("k_group", 0)), bool(cal.get("v_rotate", False)),
                            bool(cal.get("byte_scales", False)), keys)  # older files: none of the four
            except (ValueError, KeyError, TypeError, AttributeError, UserError):  # a damaged file must not fail a write
                log.warning("%s is damaged: %s is written until `ragcache calibrate-codec` rewrites it", path, DEFAULT)
        return spec_for(DEFAULT, num_layers, home, fingerprint)
    m = KV_CODEC.fullmatch(name)
    if m is None or m.group(1) is None:
        raise ValueError(f"unknown KV codec {name!r}: {KV_CODEC_FORM}")
    shifts = tuple((t, 1 if sign == "+" else -1, int(a), int(b))
                   for sign, t, a, b in re.findall(r"([+-])([kv])(\d+):(\d+)", m.group(3)))
    boost = tuple(int(x) for x in re.findall(r"\+L(\d+)", m.group(4)))
    widths = tuple((t, int(l), int(w)) for t, l, w in re.findall(r"\+([kv])(\d+)=(\d)", m.group(5)))
    return Spec.uniform(name, num_layers, int(m.group(1)), int(m.group(2)), boost, int(m.group(6) or 0),
                        m.group(7) is not None, shifts, m.group(8) is not None,
                        _keys(home, fingerprint, name) if m.group(9) else None, widths)


def save_calibration(home: Path, fingerprint: str, spec: Spec, report: dict) -> Path:
    path = calibration_path(home, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    if spec.keys is not None:  # first: a calibration that names feedback always finds its weighting
        spec.keys.save(keys_path(home, fingerprint))
    tmp.write_text(json.dumps({"k_bits": list(spec.k_bits), "v_bits": list(spec.v_bits), "k_group": spec.k_group,
                               "v_rotate": spec.v_rotate, "byte_scales": spec.byte_scales,
                               "feedback": spec.keys is not None, **report}, indent=1))
    tmp.replace(path)
    return path
