"""Repair after the first token: the first token at reuse's speed, the rest at a probe's fidelity.

    policy = Deferred(0.2)                                   # label "deferred@0.2"
    fused = fuse_and_prefill(runner, prefix, chunks, suffix, policy, headroom)     # reuse's pass: TTFT
    token = pick(fused.logits)                                                     # sent at once
    fused = fuse_and_prefill(runner, prefix, chunks, after_first(suffix, token),   # the repair: probe@0.2 over
                             repair_of(policy), headroom - 1)                      # the prompt and that token

The first pass recomputes only the question (`Reuse`); once its token is out, the prompt and that token are
fused again from the same chunk KV by `Probe(ratio)`, and decoding goes on from the repaired cache. The
answer's tokens after the first see what probe@ratio would have given them, while the first arrives at
reuse's time-to-first-token; the repair's time sits between the first token and the second. APE on the
policy (`Reweighted(Deferred(r), rw)`) applies to both passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import Layout, Plan
from .reweight import Reweighted
from .select_query import Probe


@dataclass(frozen=True)
class Deferred:
    ratio: float = 0.2  # the repair's share of context rows (a probe's ratio)
    name = "deferred"
    reads_chunk_kv = True

    def __post_init__(self):
        Probe(self.ratio)  # its ratio check names a bad one

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        return Plan(layout.suffix())  # reuse's: the question alone

    @property
    def then(self) -> Probe:
        return Probe(self.ratio)


def repair_of(policy):
    """The policy that repairs after `policy`'s first token (its APE kept), or None when it repairs nothing."""
    base = getattr(policy, "policy", policy)  # a Reweighted's own policy
    if not isinstance(base, Deferred):
        return None
    return Reweighted(base.then, policy.reweight) if isinstance(policy, Reweighted) else base.then


def after_first(suffix: torch.Tensor, token: int) -> torch.Tensor:
    """suffix (S,) → (S + 1,): the question and the first token, the repair's suffix."""
    return torch.cat([suffix, torch.tensor([token], dtype=suffix.dtype, device=suffix.device)])
