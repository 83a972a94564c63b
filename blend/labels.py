"""A policy's label, as results tables name it, and the policy a label names.

    cacheblend@0.15   epic@16   probe@0.1+layers@4   adaptive@0.9   reuse+ape@1,0.5

`mode@knob` (cacheblend, probe, a3, blendq: the share recomputed; epic: tokens per chunk; adaptive: the
attention coverage), then each knob that is not the policy's default: `+layers@n` a query probe through n
layers, `+epic@k` a probe's first k rows per chunk, `+window@w` a3's and blendq's smoothing, `+max@r`
adaptive's cap; `+ape@T,S` APE re-weighting. `parse(label(p)) == p` for every policy `ragcache eval` makes
(cacheblend's check layer, deviation and gradual filtering are not in a label: eval uses the defaults).
"""
from __future__ import annotations

from .reweight import Reweight, Reweighted
from .select import POLICIES
from .select_query import A3, Adaptive, Probe

_KNOB = {"cacheblend": "ratio", "probe": "ratio", "a3": "ratio", "blendq": "ratio", "epic": "k", "adaptive": "coverage",
        "deferred": "ratio"}
_EXTRA = {"layers": (Probe, Adaptive), "epic": (Probe,), "window": (A3,), "max": (Adaptive,)}  # +name@value
_FIELD = {"layers": "layers", "epic": "epic_k", "window": "window", "max": "max_ratio"}


def knob(policy) -> float | None:
    """The policy's one knob (a ratio, epic's k, adaptive's coverage), APE aside; None for a mode without one."""
    base = getattr(policy, "policy", policy)
    return getattr(base, _KNOB[base.name]) if base.name in _KNOB else None


def label(policy) -> str:
    if isinstance(policy, Reweighted):
        rw = policy.reweight
        return f"{label(policy.policy)}+{rw.label}"
    value = knob(policy)
    out = policy.name if value is None else f"{policy.name}@{value:g}"
    for name, kinds in _EXTRA.items():
        value = getattr(policy, _FIELD[name], None)
        if isinstance(policy, kinds) and value != getattr(type(policy), _FIELD[name]):
            out += f"+{name}@{value:g}"
    return out


def parse(text: str):
    """The policy `text` names; ValueError names what is wrong with it."""
    head, *extras = text.split("+")
    mode, _, knob = head.partition("@")
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r} in {text!r}: use one of {', '.join(POLICIES)}")
    params, reweight = {}, None
    try:
        if knob:
            if mode not in _KNOB:
                raise ValueError(f"{mode} takes no knob")
            params[_KNOB[mode]] = int(knob) if mode == "epic" else float(knob)
        for extra in extras:
            name, _, value = extra.partition("@")
            if name in _EXTRA and issubclass(POLICIES[mode], _EXTRA[name]) and _FIELD[name] not in params:
                params[_FIELD[name]] = float(value) if name == "max" else int(value)
            elif name == "ape" and reweight is None:
                t, s = value.split(",")
                reweight = Reweight(float(t), float(s))
            else:
                raise ValueError(f"unknown part {extra!r}")
        policy = POLICIES[mode](**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad policy label {text!r}: {e}") from None
    if reweight is not None and reweight.active and policy.reads_chunk_kv:
        return Reweighted(policy, reweight)
    return policy
