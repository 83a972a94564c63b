"""Decode weights (`RAGCACHE_DECODE_WEIGHTS`): each kind's decode step on the bundled model's real weights
against the float32 matrices', and the bytes it says it reads."""
from __future__ import annotations

import pytest
import torch

from blend import KVCache
from blend.batch import Rows, forward_batch
from blend.linear import DECODE_WEIGHTS, make_weights
from blend.prompt import as_ids, encode

PROMPT = ("Passage: The Eiffel Tower was completed in 1889 for the World's Fair in Paris, France.\n"
          "Question: In which city is the Eiffel Tower?\nAnswer: The Eiffel Tower is in")


@pytest.fixture(scope="module")
def prompt(smollm, smol_runner):
    ids = as_ids(encode(smollm.tokenizer, PROMPT))
    pre = smol_runner.prefill(ids[:-1])
    return ids, pre


def _step(runner, prompt, ws) -> torch.Tensor:
    """The prompt's last token decoded after its prefilled KV, through `ws` → logits (V,)."""
    ids, pre = prompt
    cache = KVCache.empty(runner.num_layers, runner.num_kv_heads, runner.head_dim, ids.numel(), runner.dtype, "cpu")
    cache.k[:, :, : ids.numel() - 1], cache.v[:, :, : ids.numel() - 1] = pre.k, pre.v
    cache.length = ids.numel() - 1
    return forward_batch(runner, [Rows(cache, ids[-1:], torch.tensor([cache.length]))], ws)[0].logits


@pytest.mark.parametrize("kind, bound, size", [("float16", 1e-3, 1 / 2), ("int8", 5e-2, 1 / 4), ("int4", 1e-4, None)])
def test_a_decode_step_through_each_kind_of_weights_is_within_its_bound_of_float32(
        smollm, smol_runner, prompt, kind, bound, size):
    """int4 packs the bundled GGUF's Q4_1 and Q8_0 weights without loss: its bound is float32 rounding's."""
    ws = make_weights(smollm.state, smol_runner.num_layers, kind)
    if size is None:  # blocks 4 bits a weight and two fp16 a group of 32; the LM head 8 bits and one fp16
        head = smollm.state["lm_head.weight"].numel()
        blocks = smol_runner.w.bytes / 4 - head
        assert ws.bytes == blocks * (0.5 + 4 / 32) + head * (1 + 2 / 32)
    else:
        assert ws.bytes == smol_runner.w.bytes * size
    ref, got = _step(smol_runner, prompt, smol_runner.w), _step(smol_runner, prompt, ws)
    error = float((got - ref).norm() / ref.norm())
    assert error < bound, f"{kind} logits {error:.4f} from float32's (relative)"
    assert int(got.argmax()) == int(ref.argmax()) == smollm.tokenizer.encode(" Paris")[0]


def test_an_unknown_kind_of_decode_weights_is_refused_by_name(smollm, smol_runner):
    assert "int4" in DECODE_WEIGHTS
    with pytest.raises(ValueError, match="model, float16, int8, int4"):
        make_weights(smollm.state, smol_runner.num_layers, "int2")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_decode_weights_give_a_sequence_in_a_batch_what_it_gets_alone(smollm, smol_runner, prompt, kind):
    """fbgemm quantizes a product's input over the whole batch; each row spread to its own range keeps one
    sequence's rounding from depending on the others (here a second sequence with far larger activations).
    int4's products are row by row (weight-only), four rows at a time or one."""
    ws = make_weights(smollm.state, smol_runner.num_layers, kind)
    ids, pre = prompt
    other = torch.full((40,), int(ids[3]))  # one token repeated: activations unlike the prompt's

    def rows(cache_ids, kv):
        n = cache_ids.numel() - 1
        cache = KVCache.empty(smol_runner.num_layers, smol_runner.num_kv_heads, smol_runner.head_dim, n + 1,
                              smol_runner.dtype, "cpu")
        cache.k[:, :, :n], cache.v[:, :, :n] = kv.k, kv.v
        cache.length = n
        return Rows(cache, cache_ids[-1:], torch.tensor([n]))

    alone = [forward_batch(smol_runner, [rows(i, kv)], ws)[0].logits
             for i, kv in ((ids, pre), (other, smol_runner.prefill(other[:-1])))]
    together = forward_batch(smol_runner, [rows(ids, pre), rows(other, smol_runner.prefill(other[:-1]))], ws)
    for a, t in zip(alone, together):
        assert torch.allclose(a, t.logits, rtol=0, atol=1e-4), float((a - t.logits).abs().max())
