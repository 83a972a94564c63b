"""Synthetic chunk-use traces and one blob tier replayed over them: what admission saves and writes.

    trace = make_trace(zipf_s=1.0, uses=100_000, popular=20_000, seed=0)
    simulate(trace, capacity_bytes, eviction="gdsf", admission="second-use") → Replay

A trace is the chunks a stream of requests uses, in order. Half of the distinct chunks in it are
one-hit wonders (used once, at random places: Mooncake's traces have over half); the other uses
follow a bounded Zipf(s) over `popular` chunks. Chunks hold 64–512 tokens; bytes are proportional
to tokens and a miss costs the chunk's prefill (`cost_of_tokens`; `prefill_flops` by default: a
simulation with nothing timed). The tier is the production code: store/policy.py evicts,
store/admission.py decides what is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..store.admission import Admission
from ..store.policy import make_policy


def prefill_flops(tokens: int, params: float = 135e6, layers: int = 30, width: int = 576) -> float:
    """A chunk's prefill in GFLOPs on SmolLM2: linear layers 2·params per token, causal attention 2·L·d·n²."""
    return (2 * params * tokens + 2 * layers * width * tokens * tokens) / 1e9


@dataclass
class Trace:
    uses: list[int]  # chunk ids in use order
    tokens: np.ndarray  # (chunks,) tokens per chunk id

    @property
    def one_hit_share(self) -> float:
        counts = np.bincount(self.uses)
        return float((counts == 1).sum() / (counts > 0).sum())


def make_trace(zipf_s: float, uses: int = 100_000, popular: int = 20_000, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, popular + 1) ** zipf_s
    hot = rng.choice(popular, size=uses, p=p / p.sum()).tolist()
    distinct = len(set(hot))
    wonders = list(range(popular, popular + distinct))  # as many used-once chunks as the hot part has chunks
    order = hot + wonders
    perm = rng.permutation(len(order))
    tokens = rng.integers(64, 513, size=popular + distinct)
    return Trace([order[i] for i in perm], tokens)


@dataclass
class Replay:
    saved: float  # prefill cost (seconds, or GFLOPs) the tier's hits saved
    total: float  # prefill cost of every use: what no cache would spend
    hits: int
    written: int  # bytes written into the tier

    @property
    def saved_share(self) -> float:
        return self.saved / self.total


def simulate(trace: Trace, capacity: int, eviction: str, admission: str, cost_of_tokens: Callable[[int], float],
             bytes_per_token: int, window: int = 100_000) -> Replay:
    policy, adm = make_policy(eviction), Admission(admission, window)
    held: dict[int, int] = {}  # chunk id → bytes
    used = hits = written = 0
    saved = total = 0.0
    for chunk in trace.uses:
        key = str(chunk)
        n = int(trace.tokens[chunk])
        size, cost = n * bytes_per_token, cost_of_tokens(n)
        total += cost
        if chunk in held:
            hits, saved = hits + 1, saved + cost
            policy.touch(key, size, cost)
            adm.on_hit(key)
            continue
        if not adm.on_miss(key) or size > capacity:
            continue
        while used + size > capacity:
            victim = policy.victim()
            policy.remove(victim)
            used -= held.pop(int(victim))
        held[chunk] = size
        used += size
        written += size
        policy.touch(key, size, cost)
    return Replay(saved, total, hits, written)


def corpus_bytes(trace: Trace, bytes_per_token: int) -> int:
    return int(trace.tokens[np.unique(trace.uses)].sum()) * bytes_per_token


def report(cost_of_tokens: Callable[[int], float], zipfs: list[float], bytes_per_token: int, uses: int = 100_000,
           capacities: tuple[float, ...] = (0.01, 0.10)) -> list[list]:
    """Every (Zipf s, capacity, eviction, admission): hit rate, prefill time saved, GB written, both ÷ LRU's."""
    rows = []
    for s in zipfs:
        trace = make_trace(s, uses)
        corpus = corpus_bytes(trace, bytes_per_token)
        for share in capacities:
            lru = None
            for eviction in ("lru", "gdsf"):
                for admission in ("all", "second-use"):
                    r = simulate(trace, int(corpus * share), eviction, admission, cost_of_tokens, bytes_per_token)
                    lru = lru or r
                    rows.append([s, f"{share:.0%}", eviction, admission, r.hits / len(trace.uses), r.saved_share,
                                 r.written / 1e9, r.saved / lru.saved, r.written / lru.written])
        print(f"  trace s={s}: {len(trace.uses)} uses of {len(set(trace.uses))} chunks, "
              f"{trace.one_hit_share:.0%} of them used once", flush=True)
    return rows
