"""Token generation from a filled KV cache: greedy or sampled (temperature, top-p)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .cache import KVCache
from .runner import Runner


GREEDY_BELOW = 1e-4


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """logits (V,) → the next token id. Temperatures under GREEDY_BELOW are greedy (dividing by them overflows)."""
    if sampling.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        outside = sorted_p.cumsum(0) - sorted_p >= sampling.top_p  # smallest set reaching top_p
        sorted_p[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def decode_steps(runner: Runner, cache: KVCache, first_logits: torch.Tensor, sampling: Sampling,
                 stop_ids: frozenset[int]) -> Iterator[int]:
    """Generate after the cache's last row, one id at a time (a stream); stops before a stop token.

    The consumer may stop iterating at any step (a cancelled request): nothing is left half done.
    """
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator()
        generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    cache.reserve(cache.length + sampling.max_new_tokens)
    logits, n = first_logits, 0
    while True:
        token = pick(logits, sampling, generator)
        if token in stop_ids:
            return
        yield token
        n += 1
        if n == sampling.max_new_tokens:
            return
        row = torch.tensor([cache.length], device=runner.device)
        logits = runner.forward_selected(cache, torch.tensor([token]), row).logits


def decode(runner: Runner, cache: KVCache, first_logits: torch.Tensor, sampling: Sampling,
           stop_ids: frozenset[int]) -> list[int]:
    """All of `decode_steps`: the new ids without the stop token."""
    return list(decode_steps(runner, cache, first_logits, sampling, stop_ids))
