"""Answer quality and fidelity metrics: SQuAD-normalised F1, KL divergence of next-token distributions."""
from __future__ import annotations

import re
import string
from collections import Counter

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1(prediction: str, reference: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: list[str]) -> float:
    """Max over the gold answers, as SQuAD scores."""
    return max((f1(prediction, r) for r in references), default=0.0)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) in nats for logits (..., V) → (...). Zero for identical distributions."""
    p_log = torch.log_softmax(p_logits.double(), dim=-1)
    q_log = torch.log_softmax(q_logits.double(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0.0)
