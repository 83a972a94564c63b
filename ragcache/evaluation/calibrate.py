"""`ragcache calibrate`: every mode measured on dev data, stored per model; the fastest within a KL target
is what `mode: auto` serves, and a request's own `target_kl` picks again among the same points. With APE
variants measured (`--ape T,S`, repeatable; the server's own is always among them), the (T, S) of the lowest mean
KL over the same modes is stored too, if it is lower than the server's own on the same questions beyond chance
(paired.py; a pick on 10 questions that was not did not carry to others), else the server's own: the server
re-weights with it wherever its settings name no APE of their own."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from blend.labels import knob, label, parse
from blend.reweight import Reweighted

from ..errors import UserError
from ..meta import ModelDefault
from .evaluate import EvalConfig, evaluate
from .paired import p_lower

OFF = (1.0, 1.0)  # APE's identity: plain attention
ALPHA = 0.05  # a measured APE displaces the server's own only where lower on the same questions beyond this chance


@dataclass
class ApePick:
    """The APE (temperature, factor) the server is to use: the lowest mean KL measured where it is lower than the
    server's own on the same questions beyond chance (paired.py), else the server's own."""
    ape: tuple[float, float]
    lowest: tuple[float, float]  # the lowest mean KL measured (ties: the server's)
    server: tuple[float, float]  # the settings' APE (OFF: none), always among those measured
    mean: dict[tuple[float, float], float]  # mean teacher-forced KL per APE measured
    p: float  # one-sided p of the lowest's KL being under the server's by chance (1 where the server's is lowest)
    n: int  # questions

    def line(self) -> str:
        lowest, name = self.lowest, _name(self.ape)
        if lowest == self.server:
            why = f"the server's own, the lowest mean KL of the {len(self.mean)} measured ({self.mean[lowest]:.4f})"
        elif self.ape == lowest:
            why = (f"mean KL {self.mean[lowest]:.4f} against the server's {self.mean[self.server]:.4f}, lower on the "
                   f"same {self.n} questions beyond chance: p = {self.p:.3f}")
        else:
            why = (f"the server's own, kept: {_name(lowest)} measured {self.mean[lowest]:.4f} against "
                   f"{self.mean[self.server]:.4f}, but on {self.n} questions that is within chance (p = {self.p:.3f} "
                   f"≥ {ALPHA:g}); more questions can tell them apart")
        return f"APE for this model: {name} ({why}); the server uses it unless RAGCACHE_APE_TEMPERATURE/FACTOR are set"


def _name(ape: tuple[float, float]) -> str:
    return "none" if ape == OFF else f"temperature {ape[0]:g}, factor {ape[1]:g}"


@dataclass
class Choice:
    label: str
    kl: float
    speedup: float
    ape: ApePick | None = None

    def line(self) -> str:
        out = (f"default for this model: {self.label} (mean teacher-forced KL {self.kl:.4f} nats, "
               f"{self.speedup:.1f}× faster to first token than full prefill); `mode: auto` uses it")
        return out if self.ape is None else out + "\n" + self.ape.line()


def calibrate(service, cfg: EvalConfig, target_kl: float, progress: bool = True) -> Choice:
    if not target_kl >= 0:  # NaN too
        raise UserError("--target-kl must be >= 0")
    server = (service.settings.ape_temperature, service.settings.ape_factor)
    if cfg.ape and server != OFF and server not in cfg.ape:  # the server's own APE is what a variant must beat
        cfg = replace(cfg, ape=[*cfg.ape, server])
    results = evaluate(service, cfg, progress)
    points = [{"label": label, "kl": m["kl_tf"], "speedup": m["speedup_vs_full"]}
              for label, m in results["modes"].items()]
    ape = pick_ape(results["per_question"], server)
    row = ModelDefault(fingerprint=service.model.fingerprint, target_kl=target_kl, dataset=str(cfg.dataset),
                       points=json.dumps(points), ape=None if ape is None else f"{ape.ape[0]:g},{ape.ape[1]:g}",
                       chunk_prefill=cfg.chunk_prefill)
    label = row.fastest(target_kl)  # full (KL 0) always fits
    chosen = results["modes"][label]
    policy = parse(label)  # the columns from before schema 7: the mode and its knob, for an older reader
    row.mode, row.param = policy.name, knob(policy)
    row.measured_kl, row.speedup = chosen["kl_tf"], chosen["speedup_vs_full"]
    with service.db.session() as s:
        s.merge(row)
    return Choice(label, chosen["kl_tf"], chosen["speedup_vs_full"], ape)


def ape_kls(per_question: list[dict]) -> dict[tuple[float, float], list[float]]:
    """Per APE (temperature, factor) measured (OFF: none), each question's mean teacher-forced KL over the modes
    measured with every APE and without; {} when no APE variant was measured. `per_question`: the eval's."""
    by: dict[tuple[float, float], dict[str, list[float]]] = {}  # (T, S) → {mode without APE: KL per question}
    for question in per_question:
        for text, m in question["modes"].items():
            policy = parse(text)
            ape, mode = ((policy.reweight.temperature, policy.reweight.factor), label(policy.policy)) \
                if isinstance(policy, Reweighted) else (OFF, text)
            by.setdefault(ape, {}).setdefault(mode, []).append(m["kl_tf"])
    common = set.intersection(*(set(modes) for modes in by.values())) if len(by) > 1 else set()
    return {ape: [sum(q) / len(common) for q in zip(*(modes[m] for m in sorted(common)))]
            for ape, modes in by.items()} if common else {}


def pick_ape(per_question: list[dict], server: tuple[float, float]) -> ApePick | None:
    """The APE to serve (ApePick); None when no APE variant was measured."""
    kls = ape_kls(per_question)
    if not kls:
        return None
    mean = {ape: sum(v) / len(v) for ape, v in kls.items()}
    lowest = min(mean, key=lambda ape: (mean[ape], ape != server))
    if server not in kls:  # not measured (a caller other than calibrate): nothing to hold it against
        return ApePick(lowest, lowest, lowest, mean, 1.0, len(per_question))
    p = 1.0 if lowest == server else p_lower([a - b for a, b in zip(kls[lowest], kls[server])])
    return ApePick(lowest if p < ALPHA else server, lowest, server, mean, p, len(per_question))
