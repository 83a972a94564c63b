"""`ragcache calibrate`: every mode measured on dev data, stored per model; the fastest within a KL target
is what `mode: auto` serves, and a request's own `target_kl` picks again among the same points."""
from __future__ import annotations

import json
from dataclasses import dataclass

from blend.labels import knob, parse

from ..errors import UserError
from ..meta import ModelDefault
from .evaluate import EvalConfig, evaluate


@dataclass
class Choice:
    label: str
    kl: float
    speedup: float

    def line(self) -> str:
        return (f"default for this model: {self.label} (mean teacher-forced KL {self.kl:.4f} nats, "
                f"{self.speedup:.1f}× faster to first token than full prefill); `mode: auto` uses it")


def calibrate(service, cfg: EvalConfig, target_kl: float, progress: bool = True) -> Choice:
    if not target_kl >= 0:  # NaN too
        raise UserError("--target-kl must be >= 0")
    results = evaluate(service, cfg, progress)
    points = [{"label": label, "kl": m["kl_tf"], "speedup": m["speedup_vs_full"]}
              for label, m in results["modes"].items()]
    row = ModelDefault(fingerprint=service.model.fingerprint, target_kl=target_kl, dataset=str(cfg.dataset),
                       points=json.dumps(points))
    label = row.fastest(target_kl)  # full (KL 0) always fits
    chosen = results["modes"][label]
    policy = parse(label)  # the columns from before schema 7: the mode and its knob, for an older reader
    row.mode, row.param = policy.name, knob(policy)
    row.measured_kl, row.speedup = chosen["kl_tf"], chosen["speedup_vs_full"]
    with service.db.session() as s:
        s.merge(row)
    return Choice(label, chosen["kl_tf"], chosen["speedup_vs_full"])
