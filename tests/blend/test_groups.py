"""int4 decode weights' kernel (`blend/kernels/cpu_groups.py`): 4- and 8-bit groups of 32 packed without loss
from the bundled GGUF's own formats, the compiled product against `unpack` (its oracle) in float64, a row the
same alone as in a batch, and the odd shapes and groups."""
from __future__ import annotations

import pytest
import torch

from blend.kernels import cpu_groups


def test_the_bundled_weights_pack_without_loss(smollm):
    """SmolLM2's blocks ship as Q4_1 and its LM head as Q8_0: packing their dequantized floats gives them back
    bit for bit."""
    s = smollm.state
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        assert torch.equal(cpu_groups.unpack(cpu_groups.pack(s[name], 4)), s[name]), name
    head = s["lm_head.weight"][:4096]
    assert torch.equal(cpu_groups.unpack(cpu_groups.pack(head, 8)), head)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features, in_features", [(192, 576), (100, 64)])  # 100: a padded tile
def test_the_product_is_the_unpacked_matrix_s(bits, out_features, in_features):
    torch.manual_seed(bits)
    w = torch.randn(out_features, in_features) * 0.05
    w[3, :32] = 0  # a zero group
    w[5, 32:64] = 0.25  # a constant group: step 0
    w[7, :32] = torch.randn(32) * 1e-6  # steps below float16's normals
    g = cpu_groups.pack(w, bits)
    full = cpu_groups.unpack(g)
    assert full.shape == w.shape
    assert (full - w).abs().max() <= (w.abs().amax() / (7 if bits == 4 else 127)) * 0.51 + 1e-6  # half a step
    x = torch.randn(9, in_features)
    y = cpu_groups.linear(x, g)
    ref = (x.double() @ full.double().t()).float()
    assert y.shape == (9, out_features)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), float((y - ref).abs().max())
    alone = torch.cat([cpu_groups.linear(x[r : r + 1], g) for r in range(9)])  # rows 0-7 went four at a time
    assert torch.allclose(alone, y, rtol=0, atol=1e-6), float((alone - y).abs().max())


def test_in_features_off_the_group_size_are_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_groups.pack(torch.randn(64, 48), 4)
