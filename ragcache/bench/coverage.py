"""Retrieval coverage on a MuSiQue-format file: how often a passage holding the answer is in FAISS's top-k.

Every passage of the file is one chunk in a flat index; a question is covered at k when one of
its top-k passages contains one of its gold answers (normalised as for F1). The file carries no
supporting-passage labels, so the passage the answer is read from stands in for them.
"""
from __future__ import annotations

import tempfile

import numpy as np

from index import Embedder, VectorIndex

from ..evaluate import load_dataset
from ..metrics import normalize
from .timing import table


def run(settings, args) -> int:
    data = load_dataset(args.dataset, None)
    texts = sorted({c["text"] for item in data for c in item["ctxs"]})
    embedder = Embedder()
    tokens = [len(embedder.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    ks = args.passages
    hits = {k: 0 for k in ks}
    with tempfile.TemporaryDirectory() as tmp:
        index = VectorIndex(tmp, embedder.dim)
        index.add("bench", np.arange(len(texts)), embedder.embed(texts))
        for item in data:
            answers = [normalize(a) for a in item["answers"] if normalize(a)]
            found = [i for i, _ in index.search("bench", embedder.embed([item["question"]])[0], max(ks))]
            holds = [any(f" {a} " in f" {normalize(texts[i])} " for a in answers) for i in found]
            for k in ks:
                hits[k] += any(holds[:k])
    print(f"{len(data)} questions, {len(texts)} passages ({np.median(tokens):.0f} embedder tokens median, "
          f"{np.mean([t > 254 for t in tokens]):.0%} longer than one 256-token window)")
    rows = [[k, hits[k] / len(data)] for k in ks]
    print(table(rows, ["top-k", "questions with an answer-bearing passage retrieved"]))
    return 0
