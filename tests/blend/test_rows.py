"""The compiled passes between a decode step's products (`blend/kernels/cpu_rows.py`) against their torch
versions: RoPE bit for bit, the norm and the spread to float32 rounding, each row on its own."""
import pytest
import torch

from blend import kernels
from blend.kernels import reference


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(0)
    return lambda *shape: torch.randn(*shape, generator=g) * 3


def test_rope_of_a_few_rows_is_torchs_bit_for_bit(rows):
    qkv, cos, sin = rows(5, (9 + 2 * 3) * 64), rows(5, 1, 64), rows(5, 1, 64)
    got, want = kernels.split_rope(qkv, cos, sin, 9, 3), reference.split_rope(qkv, cos, sin, 9, 3)
    assert [t.shape for t in got] == [(5, 9, 64), (5, 3, 64), (5, 3, 64)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rms_norm_of_a_few_rows_matches_torchs(rows):
    x, w = rows(4, 576), rows(576)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    many = rows(kernels.ROWS + 1, 576)  # past the few rows: torch's own
    assert torch.equal(kernels.rms_norm(many, w, 1e-5), reference.rms_norm(many, w, 1e-5))


@pytest.mark.parametrize("made", ["plain", "norm", "silu_mul"])
def test_spread_rows_rebuild_their_input_row_by_row(rows, made):
    x, w = rows(6, 512), rows(512)
    x[2] = 0.5  # a constant row: span 1, nothing divided by zero
    args = {"plain": (), "norm": (w, 1e-5)}.get(made, ())
    u, ends = kernels.spread_rows(x, *args, silu_mul=made == "silu_mul")
    want = {"plain": x, "norm": reference.rms_norm(x, w, 1e-5), "silu_mul": reference.silu_mul(x)}[made]
    assert u.min() >= 0 and u.max() <= 1 and torch.all(u.amax(1)[ends[1, :, 0] != 1] == 1)
    assert torch.allclose(ends[0] + ends[1] * u, want, rtol=1e-5, atol=1e-5)
    alone = kernels.spread_rows(x[3:4], *args, silu_mul=made == "silu_mul")
    assert torch.equal(alone[0][0], u[3]) and torch.equal(alone[1][:, 0], ends[:, 3])


def test_unspread_rebuilds_the_product_of_the_rows_it_spread(rows):
    x, w = rows(3, 64), rows(32, 64)
    u, ends = kernels.spread_rows(x)
    y = kernels.unspread_(u @ w.T, ends, w.sum(1)[None])
    assert torch.allclose(y, x @ w.T, rtol=1e-4, atol=1e-3)
