"""Admission of chunks computed at query time, on small traces whose right answer is known."""
from __future__ import annotations

import numpy as np
import pytest

from ragcache.bench.trace import Trace, make_trace, simulate
from ragcache.store import TieredStore, encode
from ragcache.store.admission import Admission
from ragcache.store.disk import DiskTier
from ragcache.store.memory import MemoryTier

from .conftest import fake_chunk

A, B, C = 0, 1, 2


def _replay(uses, admission, capacity=10_000, window=100, eviction="lru"):
    trace = Trace(uses, np.array([100, 100, 100]))  # three chunks of 100 tokens, 1 byte and 1 s per token
    return simulate(trace, capacity, eviction, admission, cost_of_tokens=float, bytes_per_token=1, window=window)


def test_every_miss_is_written_without_admission_and_only_second_uses_with_it():
    everything = _replay([A, B, A, C, A, B], "all")
    assert (everything.hits, everything.written, everything.saved) == (3, 300, 300.0)
    # a, b declined; a again: written; c declined; a hit; b again: written
    second = _replay([A, B, A, C, A, B], "second-use")
    assert (second.hits, second.written, second.saved) == (1, 200, 100.0)


def test_a_second_use_outside_the_window_is_a_first_use_again():
    assert _replay([A, B, A], "second-use", window=1).written == 0
    assert _replay([A, B, A], "second-use", window=2).written == 100


def test_one_hit_wonders_are_never_written_and_do_not_push_out_the_hot_chunk():
    uses = [A, A, B, A, C, A]  # b and c are used once; the tier holds one chunk
    assert _replay(uses, "all", capacity=100).hits == 1  # b then c evict a
    kept = _replay(uses, "second-use", capacity=100)
    assert (kept.hits, kept.written) == (2, 100)  # a stays: b and c never get in


def test_a_declined_chunk_used_again_from_memory_is_stored_then():
    adm = Admission("second-use", window=10)
    assert not adm.on_miss("x")
    assert adm.on_hit("x")  # its second use, served from a memory tier: store it now
    assert not adm.on_hit("x")  # once
    assert Admission("all").on_miss("y") and not Admission("all").on_hit("y")


def test_kept_entries_stay_in_memory_and_never_reach_a_blob_tier(db, tmp_path):
    store = TieredStore(db, [MemoryTier("cpu", "cpu", 1 << 20)], [DiskTier(tmp_path / "kv", 1 << 30)])
    store.keep("k", encode(fake_chunk(1), "float32"))
    assert store.where("k") == ["cpu"] and store.get("k").tier == "cpu"
    assert not any((tmp_path / "kv").glob("*/k.safetensors"))


@pytest.mark.parametrize("s", [0.8, 1.2])
def test_synthetic_traces_hold_half_one_hit_wonders(s):
    trace = make_trace(s, uses=5000, popular=2000, seed=1)
    assert 0.5 <= trace.one_hit_share < 0.8
