"""The reranker's score reuses cached chunk KV, so it must equal the same computation done by a full forward
pass over [system prefix,] chunk and question; and it must prefer the passage that answers the question."""
from __future__ import annotations

import torch

from blend import compute_chunk, compute_prefix
from blend.likelihood import likelihood_ids, question_likelihood

TOL = 1e-4  # float32 log-probabilities

PASSAGES = ["The Eiffel Tower was designed by the engineering firm of Gustave Eiffel and finished in 1889.\n\n",
            "Penguins live almost exclusively in the Southern Hemisphere, most of them in Antarctica.\n\n",
            "The river Nile flows north through Egypt into the Mediterranean Sea.\n\n"]


def _enc(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"])


def test_scores_from_cached_kv_equal_a_full_forward_pass(smollm, smol_runner):
    runner, tok = smol_runner, smollm.tokenizer
    prefix = compute_prefix(runner, _enc(tok, "Read the passage, then the question."))
    chunks = ([compute_chunk(runner, _enc(tok, p), prefix) for p in PASSAGES]
              + [compute_chunk(runner, _enc(tok, p)) for p in PASSAGES])  # behind the prefix, and alone
    lead, question = likelihood_ids(tok, "When was the Eiffel Tower finished?")
    scores = question_likelihood(runner, prefix, chunks, lead, question)  # (6,) one batch
    assert scores.shape == (6,)
    for chunk, score in zip(chunks, scores):
        before = prefix.token_ids if chunk.start else torch.empty(0, dtype=torch.long)
        ids = torch.cat([before, chunk.token_ids, lead, question])
        logits = runner.forward_selected(runner.new_cache(len(ids)), ids, torch.arange(len(ids)),
                                         all_logits=True).logits  # (n, V) from scratch
        m = question.numel()
        full = torch.log_softmax(logits[-m - 1 : -1], -1).gather(1, question[:, None]).mean()
        assert abs(float(score) - float(full)) <= TOL
    assert int(scores[:3].argmax()) == 0 and int(scores[3:].argmax()) == 0  # the answering passage ranks first
