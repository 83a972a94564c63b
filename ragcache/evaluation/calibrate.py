"""`ragcache calibrate`: the fastest mode that keeps fidelity within a KL target, stored per model."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..meta import ModelDefault
from .evaluate import EvalConfig, evaluate


@dataclass
class Choice:
    mode: str
    param: float | None
    kl: float
    speedup: float

    def line(self) -> str:
        label = self.mode if self.param is None else f"{self.mode}@{self.param:g}"
        return (f"default for this model: {label} (mean teacher-forced KL {self.kl:.4f} nats, "
                f"{self.speedup:.1f}× faster to first token than full prefill); `mode: auto` uses it")


def calibrate(service, cfg: EvalConfig, target_kl: float, progress: bool = True) -> Choice:
    if not target_kl >= 0:  # NaN too
        raise UserError("--target-kl must be >= 0")
    results = evaluate(service, cfg, progress)
    # a label with a "+" (a probe through fewer layers, APE) is measured but not a mode@param a request names
    fits = [(m["speedup_vs_full"], label, m["kl_tf"]) for label, m in results["modes"].items()
            if m["kl_tf"] <= target_kl and "+" not in label]
    speedup, label, measured = max(fits)  # full (KL 0) always fits
    mode, _, param = label.partition("@")
    choice = Choice(mode, float(param) if param else None, measured, speedup)
    with service.db.session() as s:
        s.merge(ModelDefault(fingerprint=service.model.fingerprint, mode=mode, param=choice.param,
                             target_kl=target_kl, measured_kl=measured, speedup=speedup, dataset=str(cfg.dataset)))
    return choice
