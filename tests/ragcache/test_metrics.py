"""Metric functions against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from ragcache.evaluation.scores import best_f1, f1, kl, normalize


def test_normalize_drops_case_punctuation_and_articles():
    assert normalize("The  Exeter College, Oxford!") == "exeter college oxford"
    assert normalize("An apple a day") == "apple day"


def test_f1_by_hand():
    # pred: {exeter, college, oxford}, ref: {exeter, college} → P = 2/3, R = 1 → F1 = 0.8
    assert f1("Exeter College, Oxford", "the Exeter College") == pytest.approx(0.8)
    assert f1("Charles County", "charles county") == 1.0
    assert f1("Paris", "London") == 0.0
    assert f1("", "") == 1.0 and f1("", "x") == 0.0
    assert best_f1("Stanley", ["Stanley, North Dakota", "Stanley"]) == 1.0
    assert best_f1("x", []) == 0.0


def test_kl_by_hand():
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl(p, q).item() == pytest.approx(expected)
    logits = torch.randn(3, 100)
    assert torch.all(kl(logits, logits) == 0)
    assert torch.all(kl(logits, logits + 5.0) < 1e-12)  # a shift of the logits is the same distribution
