"""Retrieval coverage on a MuSiQue-format file: how often a passage holding the answer is in FAISS's top-k.

Every passage of the file (or, with `--window`, every piece of it) is one chunk in a flat index; a question is covered at k when one of
its top-k passages contains one of its gold answers (normalised as for F1). The file carries no
supporting-passage labels, so the passage the answer is read from stands in for them.
"""
from __future__ import annotations

import tempfile

import numpy as np

from index import Embedder, VectorIndex

from ..evaluation.evaluate import load_dataset
from ..evaluation.scores import normalize
from .timing import table


def run(settings, args) -> int:
    data = load_dataset(args.dataset, None)
    texts = sorted({c["text"] for item in data for c in item["ctxs"]})
    embedder = Embedder()
    tokens = [len(embedder.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    if args.window:  # chunks the embedder covers: what it embeds is all the model would read
        texts = [piece for t in texts for piece in _pieces(embedder.tokenizer, t, args.window)]
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
    print(f"{len(data)} questions, {len(tokens)} passages ({np.median(tokens):.0f} embedder tokens median, "
          f"{np.mean([t > 254 for t in tokens]):.0%} longer than one 256-token window)"
          + (f", indexed as {len(texts)} pieces of at most {args.window} tokens" if args.window else ""))
    rows = [[k, hits[k] / len(data)] for k in ks]
    print(table(rows, ["top-k", "questions with an answer-bearing passage retrieved"]))
    return 0


def _pieces(tokenizer, text: str, window: int) -> list[str]:
    """`text` cut into consecutive pieces of at most `window` tokens, each cut at a word's first token
    (a word longer than the window is cut inside)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, words = enc["offset_mapping"], enc.word_ids()
    starts, a = [], 0
    while a < len(spans):
        starts.append(a)
        b = a + window
        if b < len(spans):
            while b > a + 1 and words[b] == words[b - 1]:  # back to the start of the word the cut falls in
                b -= 1
            if b == a + 1:
                b = a + window
        a = b
    cuts = [spans[i][0] for i in starts] + [len(text)]
    return [text[x:y].strip() for x, y in zip(cuts, cuts[1:]) if text[x:y].strip()]
