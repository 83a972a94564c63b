"""The attention reranker reads cached chunk KV, so its scores must equal transformers' own attention over
the same sequence written out whole: the prefix, every candidate at the positions it was computed at (each
seeing only the prefix and itself), then the question after the longest; and it must prefer the passage
that answers the question."""
from __future__ import annotations

import pytest
import torch

from blend import compute_chunk, compute_prefix
from blend.attention_rank import attention_scores, layer_range
from blend.likelihood import likelihood_ids, question_likelihood
from blend.prompt import QUESTION, as_ids, chat_frame, encode
from blend.relevance import NULL_QUESTION, relevance

TOL = 1e-4


def _reference(hf, prefix: torch.Tensor, chunks: list[torch.Tensor], question: torch.Tensor,
               lo: int, hi: int) -> torch.Tensor:
    """(C,) the question's attention on each chunk, renormalised over the chunks' keys, summed over heads
    and layers [lo, hi), averaged over its rows, by one eager forward pass with explicit positions and mask."""
    p, lens = prefix.numel(), [c.numel() for c in chunks]
    ids = torch.cat([prefix, *chunks, question])
    t, m = ids.numel(), question.numel()
    at = p + max(lens)
    pos = torch.cat([torch.arange(p), *[torch.arange(p, p + n) for n in lens], torch.arange(at, at + m)])
    seen = torch.zeros(t, t, dtype=torch.bool)
    seen[:p, :p] = torch.ones(p, p).tril().bool()
    off = p
    for n in lens:
        seen[off : off + n, :p] = True
        seen[off : off + n, off : off + n] = torch.ones(n, n).tril().bool()
        off += n
    seen[off:, :off] = True
    seen[off:, off:] = torch.ones(m, m).tril().bool()
    mask = torch.zeros(t, t).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    attn = hf(ids[None], position_ids=pos[None], attention_mask=mask, output_attentions=True).attentions
    spans, off = [], p
    for n in lens:
        spans.append((off, off + n))
        off += n
    total = torch.zeros(len(chunks))
    for a in attn[lo:hi]:
        rows = a[0, :, off:, p:off]  # (H, m, keys of every chunk)
        rows = rows / rows.sum(-1, keepdim=True)
        total += torch.stack([rows[..., x - p : y - p].sum() for x, y in spans])
    return total / m


@pytest.fixture
def eager(arch):
    hf, runner = arch
    before = hf.config._attn_implementation
    hf.config._attn_implementation = "eager"
    yield hf, runner
    hf.config._attn_implementation = before


def test_scores_from_cached_kv_equal_one_eager_forward_pass(eager):
    hf, runner = eager
    vocab = runner.embed.shape[0]
    g = torch.Generator().manual_seed(3)
    prefix_ids = torch.randint(4, vocab, (9,), generator=g)
    chunk_ids = [torch.randint(4, vocab, (n,), generator=g) for n in (23, 40, 31)]
    question, null = torch.randint(4, vocab, (7,), generator=g), torch.randint(4, vocab, (5,), generator=g)
    prefix = compute_prefix(runner, prefix_ids)
    chunks = [compute_chunk(runner, c, prefix) for c in chunk_ids]
    scores = attention_scores(runner, prefix, chunks, question, null)  # (3,)
    lo, hi = layer_range(runner.num_layers)
    with torch.inference_mode():
        expected = (_reference(hf, prefix_ids, chunk_ids, question, lo, hi)
                    / _reference(hf, prefix_ids, chunk_ids, null, lo, hi))
    assert scores.shape == (3,) and torch.allclose(scores, expected, rtol=TOL, atol=TOL), (scores, expected)
    alone = [compute_chunk(runner, c) for c in chunk_ids]  # computed alone, at 0, with no prefix
    with torch.inference_mode():
        expected = (_reference(hf, prefix_ids[:0], chunk_ids, question, lo, hi)
                    / _reference(hf, prefix_ids[:0], chunk_ids, null, lo, hi))
    assert torch.allclose(attention_scores(runner, None, alone, question, null), expected, rtol=TOL, atol=TOL)


def test_the_passage_that_answers_ranks_first(smollm, smol_runner):
    tok, runner = smollm.tokenizer, smol_runner
    enc = lambda text: torch.tensor(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prefix = compute_prefix(runner, enc("Read the passages, then answer the question."))
    passages = ["Penguins live almost exclusively in the Southern Hemisphere, most of them in Antarctica.\n\n",
                "The Eiffel Tower was designed by the engineering firm of Gustave Eiffel and finished in 1889.\n\n",
                "The river Nile flows north through Egypt into the Mediterranean Sea.\n\n"]
    chunks = [compute_chunk(runner, enc(p), prefix) for p in passages]
    scores = attention_scores(runner, prefix, chunks, enc("Question: When was the Eiffel Tower finished?"),
                              enc("Question: N/A"))
    assert int(scores.argmax()) == 1, scores


def test_relevance_asks_the_question_as_a_request_does_with_either_reranker(smollm, smol_runner):
    tok, runner = smollm.tokenizer, smol_runner
    frame = chat_frame(tok, "Answer from the passages.")
    prefix = compute_prefix(runner, as_ids(frame.head))
    passages = ("Rome is in Italy.\n\n", "Oslo is cold.\n\n")
    chunks = [compute_chunk(runner, as_ids(encode(tok, p)), prefix) for p in passages]
    question = "Where is Rome?"
    asked = lambda text: as_ids(encode(tok, QUESTION + text) + frame.tail)  # noqa: E731
    attention = relevance(runner, prefix, chunks, tok, frame.tail, question, "attention")
    assert torch.equal(attention, attention_scores(runner, prefix, chunks, asked(question), asked(NULL_QUESTION)))
    likelihood = relevance(runner, prefix, chunks, tok, frame.tail, question, "likelihood")
    assert torch.equal(likelihood, question_likelihood(runner, prefix, chunks, *likelihood_ids(tok, question)))
    with pytest.raises(ValueError, match="reranker must be one of attention, likelihood"):
        relevance(runner, prefix, chunks, tok, frame.tail, question, "bm25")
