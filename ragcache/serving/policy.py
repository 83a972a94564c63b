"""Which repair policy a request gets: its mode and knobs, else the settings', else what `ragcache calibrate`
measured for this model (`auto`, `adaptive` with a target KL), with APE where the policy reads chunk KV.

    policy = policy_for(parts, "probe", ratio=0.1)     # Reweighted(Probe(0.1), Reweight(1, 0.5)) by default
    policy = fixed_policy("epic", None, 8, settings)   # a mode's policy without calibration or APE
"""
from __future__ import annotations

from blend import make_policy
from blend.labels import parse
from blend.reweight import Reweight, Reweighted

from ..config import RATIO_MODES, Settings
from ..errors import UserError
from ..meta import ModelDefault


def _calibrated(default: ModelDefault, target_kl: float, family: str | None):
    """The policy calibrate measured fastest within `target_kl`, as measured; None when there is none it can
    serve (not measured, or points this version cannot read: the row's mode and knob serve instead)."""
    try:
        label = default.fastest(target_kl, family)
        return None if label is None else parse(label)
    except (ValueError, TypeError, KeyError):  # a damaged or foreign `points`: never a 500 per request
        return None


def fixed_policy(mode: str, ratio: float | None, k: int | None, s: Settings, probe_layers: bool = True):
    """The policy of a mode that is not chosen per request (not auto), its knobs from the request or else the
    settings; UserError names an unknown mode or a knob out of range. `probe_layers`: the configured probe
    depth (auto serves what calibrate measured instead)."""
    knobs = {"cacheblend": {"ratio": s.cacheblend_ratio if ratio is None else ratio},
             "probe": {"ratio": s.probe_ratio if ratio is None else ratio},
             "deferred": {"ratio": s.deferred_ratio if ratio is None else ratio},
             "epic": {"k": s.epic_k if k is None else k}}.get(mode, {})
    if mode in RATIO_MODES and mode not in ("cacheblend", "probe", "deferred") and ratio is not None:
        knobs = {"ratio": ratio}  # else the policy's own default
    if mode == "probe" and probe_layers and s.probe_layers:
        knobs["layers"] = s.probe_layers
    try:
        return make_policy(mode, **knobs)
    except ValueError as e:  # an unknown mode or a knob out of range, named by blend
        raise UserError(str(e)) from None


def within_depth(s: Settings, layers: int) -> None:
    """UserError for a probe set to run through more layers than the model has: it would run through all of them,
    under a label that says otherwise."""
    if s.probe_layers > layers:
        raise UserError(f"setting probe_layers: {s.probe_layers} is past this model's {layers} layers (0: all of them)")


def policy_for(parts, mode: str, ratio: float | None = None, k: int | None = None, target_kl: float | None = None):
    """A selection policy. `auto` serves the mode `ragcache calibrate` measured fastest within `target_kl`
    (else within the calibration's own target) exactly as measured, APE and probe depth included;
    `adaptive` takes the coverage measured to reach it."""
    s = parts.settings
    asked = mode
    if target_kl is not None and mode not in ("auto", "adaptive"):
        raise UserError(f"target_kl applies to mode auto or adaptive, not {mode}")
    ape_named = bool({"ape_temperature", "ape_factor"} & s.model_fields_set)
    default = _model_default(parts) if mode in ("auto", "adaptive") or not ape_named else None  # one read
    if mode == "auto" or (mode == "adaptive" and target_kl is not None):
        target = target_kl if target_kl is not None or default is None else default.target_kl
        policy = None if default is None else _calibrated(default, target, None if mode == "auto" else mode)
        if policy is not None:
            return policy
        if target_kl is not None:
            raise UserError(f"target_kl needs this model's {mode} mode measured: run `ragcache calibrate` first "
                            "(or leave target_kl out)")
        if default is None:  # nothing calibrated: the configured mode, or the built-in one
            mode = asked = s.mode if s.mode != "auto" else Settings.model_fields["mode"].default
        else:  # a calibration from before schema 7: its mode and knob
            mode = default.mode
            ratio = default.param if mode in RATIO_MODES else ratio
            k = int(default.param) if mode == "epic" and default.param is not None else k
    configured_probe = mode == "probe" and asked == "probe"  # at the configured depth (auto: as calibrated)
    if configured_probe:
        within_depth(s, parts.runner.num_layers)
    policy = fixed_policy(mode, ratio, k, s, probe_layers=configured_probe)
    ape = _ape(parts, None if ape_named else default)
    return Reweighted(policy, ape) if ape.active and policy.reads_chunk_kv else policy


def _model_default(parts) -> ModelDefault | None:
    """What `ragcache calibrate` stored for this model, where it measured chunk KV computed as this server's
    is (read per request: another process may calibrate)."""
    with parts.db.session() as ss:
        row = ss.get(ModelDefault, parts.model.fingerprint)
    return row if row is not None and row.measured_for(parts.settings.chunk_prefill) else None


def _ape(parts, default: ModelDefault | None) -> Reweight:
    """The APE `ragcache calibrate` measured best for this model where `default` holds one; else the
    settings' (RAGCACHE_APE_TEMPERATURE/FACTOR, or the built-in default). The caller passes None when
    the settings name an APE: a named setting wins."""
    if default is not None:
        try:
            return Reweight(*map(float, default.ape.split(",")))
        except (AttributeError, TypeError, ValueError):  # none calibrated, or a damaged value: the default
            pass
    s = parts.settings
    return Reweight(s.ape_temperature, s.ape_factor)
