"""Layer-wise decoding beside the fused prefill gives the bits of decoding everything first, in every mode."""
from __future__ import annotations

import pytest
import torch

from blend import CacheBlend, Epic, Probe, Reuse, compute_chunk, compute_prefix, fuse_and_prefill
from blend.batch import fuse_batch
from blend.reweight import Reweight, Reweighted
from ragcache.store import CorruptBlob, decode, encode
from ragcache.store.widths import Spec
from ragcache.store.layers import decode_layerwise

CPU = torch.device("cpu")
MODES = {"reuse": Reuse(), "cacheblend": CacheBlend(ratio=0.15), "epic": Epic(k=16), "probe": Probe(0.1),
         "probe@4layers+ape": Reweighted(Probe(0.1, 0, 4), Reweight(1.0, 0.5))}


@pytest.fixture(scope="module")
def stored(smol_runner, smollm):
    """Three ~120-token chunks of real KV, computed behind the prefix, through the compact codec."""
    tok = smollm.tokenizer
    prefix = compute_prefix(smol_runner, torch.tensor(tok.encode("Answer from the passages.")))
    texts = ["The Nile flows north through Egypt into the Mediterranean Sea near Alexandria. " * 8,
             "Mount Kilimanjaro is a dormant volcano in Tanzania, the highest peak in Africa. " * 8,
             "The Danube passes through ten countries, more than any other river in the world. " * 8]
    spec = Spec.uniform("compact-k3v3", smol_runner.num_layers, 3, 3)
    entries = [encode(compute_chunk(smol_runner, torch.tensor(tok.encode(t))[:120], prefix), "float32", spec,
                      smol_runner.inv_freq) for t in texts]
    return prefix, entries, torch.tensor(tok.encode("Question: which river is longest?"))


def _same(a, b) -> None:
    assert torch.equal(a.logits, b.logits)
    n = a.layout.total
    assert torch.equal(a.cache.k[:, :, :n], b.cache.k[:, :, :n]) and torch.equal(a.cache.v[:, :, :n], b.cache.v[:, :, :n])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_layerwise_decode_is_bit_identical_to_decoding_first(stored, smol_runner, mode):
    prefix, entries, suffix = stored
    first = fuse_and_prefill(smol_runner, prefix, [decode(e, torch.float32, CPU) for e in entries], suffix,
                             MODES[mode])
    streamed = fuse_and_prefill(smol_runner, prefix, decode_layerwise(entries, torch.float32, CPU), suffix,
                                MODES[mode])
    _same(first, streamed)


def test_layerwise_decode_is_bit_identical_in_a_batch(stored, smol_runner):
    prefix, entries, suffix = stored
    requests = lambda load: [(prefix, load(entries), suffix, CacheBlend(ratio=0.15), 4),  # noqa: E731
                             (prefix, load(entries[::-1][:2]), suffix[:5], Epic(k=16), 4)]
    first = fuse_batch(smol_runner, requests(lambda es: [decode(e, torch.float32, CPU) for e in es]))
    streamed = fuse_batch(smol_runner, requests(lambda es: decode_layerwise(es, torch.float32, CPU)))
    for a, b in zip(first, streamed):
        _same(a, b)


def test_a_frame_that_fails_mid_stream_fails_the_prefill_where_it_waits(stored, smol_runner):
    prefix, entries, suffix = stored
    broken = list(entries)  # the same entries, one frame of one cut short
    broken[1] = type(entries[1])(**{**entries[1].__dict__, "frames": list(entries[1].frames)})
    broken[1].frames[9] = broken[1].frames[9][:-3]  # layer 4's V
    with pytest.raises(CorruptBlob):
        fuse_and_prefill(smol_runner, prefix, decode_layerwise(broken, torch.float32, CPU), suffix, Reuse())
