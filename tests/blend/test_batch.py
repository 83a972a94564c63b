"""Batched forward passes against each sequence run alone: decode (sequences joining and leaving
mid-way) and the selective recompute of several fused prefills (issue 13's exactness gates)."""
from __future__ import annotations

import pytest
import torch

from blend import CacheBlend, Epic, Full, Model, Reuse, Runner, compute_chunk, compute_prefix, fuse_and_prefill
from blend.batch import decode_batch, fuse_batch
from blend.select_query import A3, Adaptive, Probe
from tests.conftest import tiny_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def runner(request, tiny_models):
    if request.param == "smollm2":
        return request.getfixturevalue("smol_runner")
    if "qwen3" not in tiny_models:
        hf = tiny_hf_model("qwen3")
        tiny_models["qwen3"] = hf, Runner(Model.from_hf(hf, name="qwen3"))
    return tiny_models["qwen3"][1]


def _ids(runner: Runner, n: int, seed: int) -> torch.Tensor:
    vocab = runner.embed.shape[0]
    return torch.randint(4, min(vocab, 20000), (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(runner: Runner, ids: torch.Tensor, room: int):
    pre = runner.prefill(ids)
    cache = runner.new_cache(ids.numel() + room)
    cache.k[:, :, : ids.numel()], cache.v[:, :, : ids.numel()] = pre.k, pre.v
    cache.length = ids.numel()
    return cache, pre.logits


def _same_pick(a: torch.Tensor, b: torch.Tensor) -> None:
    """Greedy picks agree, or the two best logits are a near-tie (margin shown)."""
    if int(a.argmax()) != int(b.argmax()):
        top = b.topk(2).values
        margin = float(top[0] - top[1])
        assert margin < 1e-3, f"greedy picks differ with a logit margin of {margin}"


def test_batched_decode_matches_each_sequence_alone_as_they_join_and_leave(runner):
    lengths, joins, steps = [37, 5, 90, 12], [0, 0, 2, 4], [6, 3, 5, 4]  # sequence i runs steps[i] steps from joins[i]
    prompts = [_ids(runner, n, seed=i) for i, n in enumerate(lengths)]
    alone = []  # per sequence: (tokens fed, logits after each)
    for p, n in zip(prompts, steps):
        cache, logits = _prefilled(runner, p, n)
        fed, outs = [], []
        for _ in range(n):
            fed.append(int(logits.argmax()))
            logits = runner.forward_selected(cache, torch.tensor(fed[-1:]), torch.tensor([cache.length])).logits
            outs.append(logits)
        alone.append((fed, outs))
        runner.release(cache)
    caches, done = {}, [0] * len(prompts)
    for step in range(max(j + n for j, n in zip(joins, steps))):
        for i, j in enumerate(joins):
            if j == step:
                caches[i] = _prefilled(runner, prompts[i], steps[i])[0]
        live = [i for i in sorted(caches) if done[i] < steps[i]]
        if not live:
            continue
        logits = decode_batch(runner, [caches[i] for i in live], [alone[i][0][done[i]] for i in live])
        assert logits.shape == (len(live), runner.embed.shape[0])
        for row, i in enumerate(live):
            ref = alone[i][1][done[i]]
            assert torch.allclose(logits[row], ref, atol=TOL, rtol=TOL), (i, step, (logits[row] - ref).abs().max())
            _same_pick(logits[row], ref)
            done[i] += 1
            if done[i] == steps[i]:  # leaves the batch: its cache goes back at once
                runner.release(caches.pop(i))
    assert done == steps


def test_batched_recompute_matches_each_prefill_alone(runner):
    prefix = compute_prefix(runner, _ids(runner, 9, seed=10))
    requests = []
    for r, (policy, sizes) in enumerate([(CacheBlend(0.15), [60, 45, 80]), (Epic(4), [30, 70]),
                                         (Full(), [25, 40]), (Reuse(), [50]), (Probe(0.2), [40, 35]),
                                         (A3(0.2), [30, 50]), (Adaptive(0.8), [45, 30])]):
        chunks = [compute_chunk(runner, _ids(runner, n, seed=20 + 5 * r + c), prefix) for c, n in enumerate(sizes)]
        requests.append((prefix, chunks, _ids(runner, 7 + r, seed=40 + r), policy, 4))
    batched = fuse_batch(runner, requests)
    for req, got in zip(requests, batched):
        alone = fuse_and_prefill(runner, *req)
        assert torch.allclose(got.logits, alone.logits, atol=TOL, rtol=TOL), (req[3], (got.logits - alone.logits).abs().max())
        _same_pick(got.logits, alone.logits)
        assert [torch.equal(a, b) for a, b in zip(got.kv_rows, alone.kv_rows)] == [True] * runner.num_layers
        assert got.work_fraction == alone.work_fraction  # the query probe's pass counted in both
        n = alone.layout.total
        assert torch.allclose(got.cache.k[:, :, :n], alone.cache.k[:, :, :n], atol=TOL, rtol=TOL)
        for res in (got, alone):
            runner.release(res.cache)


def test_batched_full_recompute_reproduces_full_prefill(runner):
    """The gate of every model, batched: recomputing 100% of every request equals their full prefills."""
    prefix = compute_prefix(runner, _ids(runner, 6, seed=50))
    requests = []
    for r, sizes in enumerate([[40, 33], [70]]):
        chunks = [compute_chunk(runner, _ids(runner, n, seed=60 + 3 * r + c)) for c, n in enumerate(sizes)]
        policy = CacheBlend(1.0) if r == 0 else Adaptive(coverage=1.0, max_ratio=1.0)
        requests.append((prefix, chunks, _ids(runner, 5, seed=70 + r), policy, 0))
    for req, got in zip(requests, fuse_batch(runner, requests)):
        full = runner.prefill(got.token_ids)
        assert torch.allclose(got.logits, full.logits, atol=TOL, rtol=TOL)
        runner.release(got.cache)
