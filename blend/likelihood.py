"""Query likelihood against cached chunk KV: how likely a question is after each candidate passage.

    scores = question_likelihood(runner, prefix, chunk_kvs, lead_ids, question_ids)   # (B,) float32

The score of a chunk is the mean log-probability of the question's tokens when they follow it (the
unsupervised passage re-ranking of Sachan et al., 2022, UPR). Each chunk's KV is already computed, at
the place it was computed (alone, or behind the system prefix), so a candidate costs only the lead
and question rows through the model against its own cache; all candidates run as one batch
(`forward_batch`). Nothing is approximated: the score equals the same computation by a full forward
pass over [prefix,] chunk, lead and question (a test holds it to that).
"""
from __future__ import annotations

import torch

from .batch import Rows, forward_batch
from .chunk import ChunkKV, PrefixKV
from .runner import Runner


@torch.inference_mode()
def question_likelihood(runner: Runner, prefix: PrefixKV | None, chunks: list[ChunkKV], lead_ids: torch.Tensor,
                        question_ids: torch.Tensor) -> torch.Tensor:
    """chunks: KV computed alone (start 0) or behind `prefix` (start len(prefix)); lead_ids (a,), at least
    one token between the chunk and the question; question_ids (m,) → (B,) mean log p(question | chunk)."""
    tail = torch.cat([lead_ids, question_ids]).cpu()  # (a + m,)
    a = lead_ids.numel()
    items = []
    for c in chunks:
        before = prefix if c.start else None
        start = len(before) if before is not None else 0
        assert c.k is not None and c.start == start and c.context == (before.key if before else ""), \
            "a chunk's KV is read at the place and behind the prefix it was computed at"
        end = start + len(c)
        cache = runner.new_cache(end + tail.numel())
        if before is not None:
            cache.k[:, :, :start], cache.v[:, :, :start] = before.k, before.v
        cache.k[:, :, start:end], cache.v[:, :, start:end] = c.k, c.v
        cache.length = end
        items.append(Rows(cache, tail, torch.arange(end, end + tail.numel())))
    outs = forward_batch(runner, items, all_logits=True)
    target = question_ids.to(runner.device)
    scores = []
    for it, out in zip(items, outs):
        logp = torch.log_softmax(out.logits[a - 1 : -1], dim=-1)  # (m, V): before each question token
        scores.append(logp.gather(1, target[:, None]).mean())
        runner.release(it.cache)
    return torch.stack(scores).float().cpu()


LEAD = "Question:"  # between the passage and the question, as the prompt puts it


def likelihood_ids(tokenizer, question: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lead ids (a,), question ids (m,)) for `question_likelihood`: "Question:" then " " + the question."""
    enc = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa: E731
    return enc(LEAD), enc(" " + question.strip())
