"""int4 decode weights over int8 caches: every block of a step in one compiled call (`kernels.step_layers`)
against the same step taken layer by layer, on the real model and each tiny shape the 4-bit groups fit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from blend import KVCache, kernels
from blend.batch import Rows, forward_batch
from blend.kernels import cpu_step
from blend.linear import make_weights


def _caches(runner, lengths: list[int]) -> list[KVCache]:
    """One int8 cache a length, each holding the prefill of its own tokens, room for a step."""
    torch.manual_seed(1)
    out = []
    for n in lengths:
        pre = runner.prefill(torch.randint(4, runner.embed.shape[0], (n,)))
        cache = KVCache(pre.k, pre.v, n)
        cache.reserve(n + 1)
        out.append(cache.compact(torch.int8))
    return out


def _step(runner, ws, caches: list[KVCache]) -> torch.Tensor:
    items = [Rows(c, torch.tensor([7 + i]), torch.tensor([c.length])) for i, c in enumerate(caches)]
    return torch.stack([s.logits for s in forward_batch(runner, items, ws)])  # (B, V)


def test_every_block_in_one_call_is_the_step_taken_layer_by_layer(arch, monkeypatch):
    """The same passes in the same order: layer 0's K/V codes bit for bit, the rest within SiLU's rounding
    (the compiled SiLU's exp is not torch's); five sequences, so the products take four rows and then one."""
    _, runner = arch
    ws = make_weights(runner.model.state, runner.num_layers, "int4")
    if runner.w.layers[0].q_norm is not None:  # qwen3 norms each head: its step stays layer by layer
        assert ws.stack is None
        return
    assert ws.stack is not None
    calls = []
    monkeypatch.setattr(kernels, "step_layers", lambda *a: calls.append(1) or cpu_step.layers(*a))
    lengths = [300, 41, 1, 129, 700]
    fused, apart = _caches(runner, lengths), _caches(runner, lengths)
    got = _step(runner, ws, fused)
    want = _step(runner, dataclasses.replace(ws, stack=None), apart)
    assert calls == [1]
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for f, a in zip(fused, apart):
        assert f.length == a.length
        new = slice(a.length - 1, a.length)
        assert torch.equal(f.k[:, :, : a.length - 1], a.k[:, :, : a.length - 1])  # nothing else touched
        assert torch.equal(f.k[0, :, new], a.k[0, :, new]) and torch.equal(f.v[0, :, new], a.v[0, :, new])
        for x, y in ((f.k, a.k), (f.v, a.v)):
            assert int((x[:, :, new].int() - y[:, :, new].int()).abs().max()) <= 1


def test_a_sequence_in_a_one_call_batch_gets_what_it_gets_alone(smollm, smol_runner):
    ws = make_weights(smollm.state, smol_runner.num_layers, "int4")
    lengths = [200, 30, 90, 400, 60]
    together = _step(smol_runner, ws, _caches(smol_runner, lengths))
    for i, c in enumerate(_caches(smol_runner, lengths)):
        alone = forward_batch(smol_runner, [Rows(c, torch.tensor([7 + i]), torch.tensor([c.length]))], ws)[0].logits
        assert torch.allclose(alone, together[i], rtol=0, atol=1e-4), float((alone - together[i]).abs().max())


def test_the_compiled_silu_is_torchs_within_float_rounding():
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(4000) * 6, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0,
                                                            100.0, -100.0, 1e4, -1e4])])
    gu = torch.stack([torch.cat([gate, torch.randn(gate.numel())]), torch.cat([-gate, torch.randn(gate.numel())])])
    got = torch.from_numpy(cpu_step._silu_mul(gu.numpy(), gate.numel()))
    want = torch.nn.functional.silu(gu[:, : gate.numel()]) * gu[:, gate.numel():]
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30), float(((got - want).abs() / want.abs()).max())
