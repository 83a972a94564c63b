"""A candidate's relevance to a question, read off its cached chunk KV by the reranker a deployment picks.

    scores = relevance(runner, prefix, chunks, tokenizer, tail, question, "attention")   # (B,): higher first

- `attention` (attention_rank.py): the question's attention on each candidate over a content-free
  question's, every candidate side by side in one pass of the two questions' rows;
- `likelihood` (likelihood.py, UPR): the mean log-probability of the question after each candidate, one
  pass of the question's rows per candidate.
Both ask the question as a request does: behind "Question: ", then the chat template's `tail`.
"""
from __future__ import annotations

import torch

from .attention_rank import attention_scores
from .chunk import ChunkKV, PrefixKV
from .likelihood import likelihood_ids, question_likelihood
from .prompt import QUESTION, as_ids, encode
from .runner import Runner

RERANKERS = ("attention", "likelihood")
NULL_QUESTION = "N/A"  # the content-free question the attention is measured against


def relevance(runner: Runner, prefix: PrefixKV | None, chunks: list[ChunkKV], tokenizer, tail: list[int],
              question: str, reranker: str) -> torch.Tensor:
    """chunks computed behind `prefix` (or alone, prefix None) → (B,) float32 scores, higher more relevant."""
    if reranker == "likelihood":
        return question_likelihood(runner, prefix, chunks, *likelihood_ids(tokenizer, question))
    if reranker != "attention":
        raise ValueError(f"reranker must be one of {', '.join(RERANKERS)}")
    asked = lambda text: as_ids(encode(tokenizer, QUESTION + text) + tail)  # noqa: E731
    return attention_scores(runner, prefix, chunks, asked(question), asked(NULL_QUESTION))
