"""K's symbols by error feedback (`+f`): on real KV the queries' weighted error falls, the decoder is unchanged, an
isotropic weighting changes nothing, and a codec that needs a calibration says so."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from blend import compute_chunk, compute_prefix
from ragcache.errors import UserError
from ragcache.evaluation.key_weighting import query_moments
from ragcache.store import decode, encode
from ragcache.store.codec import from_bytes, rotate_k, to_bytes
from ragcache.store.codecs import DEFAULT, calibration_path, keys_path, spec_for
from ragcache.store.feedback import KeyWeighting

PASSAGE = ("The Danube rises in the Black Forest and flows east through ten countries, more than any other river, "
           "to its delta on the Black Sea. Vienna, Budapest and Belgrade stand on its banks. ")
QUESTION = "Question: Into which sea does the Danube flow?\nAnswer:"
CODEC = "compact-k3v3+k16:30+L1+g96+b"


@pytest.fixture(scope="module")
def measured(smol_runner, smollm):
    """A real ~250-token chunk behind a prefix, and H from the queries of a prompt that holds it and a question."""
    tok = smollm.tokenizer
    head = torch.tensor(tok.encode("Read the passages."))
    ids = torch.tensor(tok.encode(PASSAGE * 6))[:250]
    prompt = torch.cat([head, ids, torch.tensor(tok.encode(QUESTION))])
    h = query_moments(smol_runner, [(prompt, len(head) + len(ids))])
    return compute_chunk(smol_runner, ids, compute_prefix(smol_runner, head)), h


def _coded_k(chunk, spec, runner) -> torch.Tensor:
    return decode(from_bytes(to_bytes(encode(chunk, "float32", spec, runner.inv_freq))), torch.float32,
                  torch.device("cpu")).k  # (L, Hkv, n, hd) before RoPE


def test_query_moments_are_symmetric_positive_and_of_trace_one(measured, smol_runner):
    _, h = measured
    assert h.shape == (smol_runner.num_layers, smol_runner.num_kv_heads, smol_runner.head_dim, smol_runner.head_dim)
    assert torch.allclose(h, h.transpose(-1, -2))
    assert torch.allclose(torch.diagonal(h, dim1=-2, dim2=-1).sum(-1), torch.ones(h.shape[:2], dtype=h.dtype))
    assert torch.linalg.eigvalsh(h).min() > -1e-9


def test_feedback_lowers_the_query_weighted_k_error_on_real_kv_and_keeps_each_element_in_its_range(measured,
                                                                                                   smol_runner,
                                                                                                   tmp_path):
    chunk, h = measured
    plain = spec_for(CODEC, smol_runner.num_layers, tmp_path, "fp")
    fed = dataclasses.replace(plain, keys=KeyWeighting.of(h))
    n = len(chunk)
    k = rotate_k(chunk.k, -torch.arange(chunk.start, chunk.start + n), smol_runner.inv_freq).double()
    near, back = _coded_k(chunk, plain, smol_runner).double(), _coded_k(chunk, fed, smol_runner).double()

    def weighted(x):  # Σ over layers, heads, tokens of Δkᵀ H Δk
        d = x - k
        return float(torch.einsum("lhni,lhij,lhnj->", d, h, d))

    assert weighted(back) < 0.8 * weighted(near), (weighted(back), weighted(near))
    assert not torch.equal(back, near)
    g = plain.k_group
    for s in range(0, n, g):  # each element inside its block's channel range, widened by the grid's rounding up
        blk, got = k[:, :, s : s + g], back[:, :, s : s + g]
        lo, hi = blk.amin(2, keepdim=True), blk.amax(2, keepdim=True)
        slack = (hi - lo) * 0.05 + 1e-4
        assert bool(((got >= lo - slack) & (got <= hi + slack)).all())


def test_an_isotropic_weighting_writes_the_nearest_symbols_bit_for_bit(measured, smol_runner, tmp_path):
    chunk, _ = measured
    plain = spec_for(CODEC, smol_runner.num_layers, tmp_path, "fp")
    eye = torch.eye(smol_runner.head_dim, dtype=torch.float64).expand(smol_runner.num_layers, smol_runner.num_kv_heads,
                                                                      -1, -1)
    fed = dataclasses.replace(plain, keys=KeyWeighting.of(eye))
    a, b = (encode(chunk, "float32", s, smol_runner.inv_freq).frames for s in (plain, fed))
    assert a == b


def test_a_feedback_codec_needs_its_calibration_and_a_calibrated_compact_falls_back_without_it(measured, smol_runner,
                                                                                               tmp_path, caplog):
    _, h = measured
    layers = smol_runner.num_layers
    with pytest.raises(UserError, match="calibrate-codec"):
        spec_for(CODEC + "+f", layers, tmp_path, "fp")
    path = keys_path(tmp_path, "fp")
    KeyWeighting.of(h).save(path)
    spec = spec_for(CODEC + "+f", layers, tmp_path, "fp")
    assert spec.keys is not None and torch.equal(spec.keys.h, h.double())
    assert dataclasses.replace(spec, name=CODEC) == spec_for(CODEC, layers, tmp_path, "fp")  # the weighting is not
    # compared: the same widths, blocks and scales
    cal = calibration_path(tmp_path, "fp")
    cal.write_text(json.dumps({"k_bits": list(spec.k_bits), "v_bits": list(spec.v_bits), "k_group": 96,
                               "byte_scales": True, "feedback": True}))
    assert spec_for("compact", layers, tmp_path, "fp").keys is not None
    path.write_bytes(b"not a tensor file")
    with pytest.raises(UserError, match="calibrate-codec"):
        spec_for(CODEC + "+f", layers, tmp_path, "fp")
    fallback = spec_for("compact", layers, tmp_path, "fp")
    assert fallback == spec_for(DEFAULT, layers, tmp_path, "fp") and fallback.keys is None
    assert "damaged" in caplog.text


def test_the_feedback_kernel_carries_each_error_onto_the_channels_after_it():
    """Two channels, H with a strong shared direction: rounding both to nearest errs along it; feedback rounds the
    second the other way, so the weighted error (along (1, 1)) is what the grid allows."""
    h = torch.tensor([[1.0, 0.99], [0.99, 1.0]], dtype=torch.float64)[None, None]
    w = KeyWeighting.of(h)
    k = torch.tensor([[[0.4, 0.4]]])  # (H=1, n=1, hd=2); grid 0, 1, 2, 3 (lo 0, step 1)
    lo, step = np.zeros((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32)
    got = w.symbols(0, k, lo, step, 1, 3)
    assert sorted(got.flatten().tolist()) == [0, 1]  # nearest would be [0, 0]: 0.8 along (1, 1) lost


def test_a_constant_group_with_a_zero_step_codes_its_lo():
    """float16 scales keep a constant group's step 0 (the decoder gives lo): feedback must not divide by it."""
    w = KeyWeighting.of(torch.eye(2, dtype=torch.float64)[None, None] + 0.5)
    k = torch.tensor([[[1.0, 0.3], [1.0, 2.6]]])  # channel 0 constant over the block
    lo, step = np.array([[[1.0, 0.0]]], np.float32), np.array([[[0.0, 1.0]]], np.float32)
    got = w.symbols(0, k, lo, step, 2, 3)
    assert got[0, :, 0].tolist() == [0, 0] and got[0, :, 1].tolist() == [0, 3]
