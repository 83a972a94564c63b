"""`ragcache calibrate`: every mode measured on dev data, stored per model; the fastest within a KL target
is what `mode: auto` serves, and a request's own `target_kl` picks again among the same points. With APE
variants measured (`--ape T,S`, repeatable), the (T, S) of the lowest mean KL over the same modes is stored
too: the server re-weights with it wherever its settings name no APE of their own."""
from __future__ import annotations

import json
from dataclasses import dataclass

from blend.labels import knob, label, parse
from blend.reweight import Reweighted

from ..errors import UserError
from ..meta import ModelDefault
from .evaluate import EvalConfig, evaluate

OFF = (1.0, 1.0)  # APE's identity: plain attention


@dataclass
class Choice:
    label: str
    kl: float
    speedup: float
    ape: tuple[float, float] | None = None

    def line(self) -> str:
        out = (f"default for this model: {self.label} (mean teacher-forced KL {self.kl:.4f} nats, "
               f"{self.speedup:.1f}× faster to first token than full prefill); `mode: auto` uses it")
        if self.ape is not None:
            out += (f"\nAPE for this model: temperature {self.ape[0]:g}, factor {self.ape[1]:g} (lowest mean KL of the "
                    "variants measured); the server uses it unless RAGCACHE_APE_TEMPERATURE/FACTOR are set")
        return out


def calibrate(service, cfg: EvalConfig, target_kl: float, progress: bool = True) -> Choice:
    if not target_kl >= 0:  # NaN too
        raise UserError("--target-kl must be >= 0")
    results = evaluate(service, cfg, progress)
    points = [{"label": label, "kl": m["kl_tf"], "speedup": m["speedup_vs_full"]}
              for label, m in results["modes"].items()]
    ape = best_ape({p["label"]: p["kl"] for p in points})
    row = ModelDefault(fingerprint=service.model.fingerprint, target_kl=target_kl, dataset=str(cfg.dataset),
                       points=json.dumps(points), ape=None if ape is None else f"{ape[0]:g},{ape[1]:g}",
                       chunk_prefill=cfg.chunk_prefill)
    label = row.fastest(target_kl)  # full (KL 0) always fits
    chosen = results["modes"][label]
    policy = parse(label)  # the columns from before schema 7: the mode and its knob, for an older reader
    row.mode, row.param = policy.name, knob(policy)
    row.measured_kl, row.speedup = chosen["kl_tf"], chosen["speedup_vs_full"]
    with service.db.session() as s:
        s.merge(row)
    return Choice(label, chosen["kl_tf"], chosen["speedup_vs_full"], ape)


def best_ape(kls: dict[str, float]) -> tuple[float, float] | None:
    """The APE (temperature, factor) of the lowest mean KL over the modes measured with every APE variant and
    without (no APE, (1, 1), is a candidate too); None when no APE variant was measured."""
    by: dict[tuple[float, float], dict[str, float]] = {}  # (T, S) → {mode without APE: its KL with it}
    for text, kl in kls.items():
        policy = parse(text)
        if isinstance(policy, Reweighted):
            by.setdefault((policy.reweight.temperature, policy.reweight.factor), {})[label(policy.policy)] = kl
        else:
            by.setdefault(OFF, {})[text] = kl
    if len(by) < 2:
        return None
    common = set.intersection(*(set(modes) for modes in by.values()))
    if not common:
        return None
    return min(by, key=lambda ts: (sum(by[ts][m] for m in common) / len(common), ts != OFF))
