"""Per-namespace BM25 indexes over chunk ids (bm25s: Lucene scoring, k1 1.5, b 0.75; English stop words
and Snowball stemming through PyStemmer).

Texts are tokenized once, as they are added; the BM25 matrix of a namespace is rebuilt from its
token lists at the first search after a change (bm25s has no incremental add; the rebuild is the
"build" that `ragcache bench coverage` times per 10K chunks). In memory only: the caller keeps it in
step with its truth, as it does the FAISS index.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np


def _tokenizer():
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    return lambda texts: bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, return_ids=False,
                                        show_progress=False)


@dataclass
class _Part:
    vocab: dict[str, int] = field(default_factory=dict)  # grows only: a removed text's words stay, unmatched
    docs: dict[int, list[int]] = field(default_factory=dict)  # chunk id → its token ids
    model: object | None = None  # the BM25 of `ids`, None after a change
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


class LexicalIndex:
    def __init__(self):
        self._tokenize = _tokenizer()
        self._parts: dict[str, _Part] = {}
        self._lock = threading.RLock()

    def _part(self, namespace: str) -> _Part:
        return self._parts.setdefault(namespace, _Part())

    def add(self, namespace: str, ids, texts: list[str]) -> None:
        """Re-adding an id replaces its text."""
        tokens = self._tokenize(list(texts))  # outside the lock: the slow part
        with self._lock:
            part = self._part(namespace)
            for i, words in zip(ids, tokens):
                part.docs[int(i)] = [part.vocab.setdefault(w, len(part.vocab)) for w in words]
            part.model = None

    def remove(self, namespace: str, ids) -> None:
        with self._lock:
            part = self._part(namespace)
            for i in ids:
                part.docs.pop(int(i), None)
            part.model = None

    def ids(self, namespace: str) -> set[int]:
        with self._lock:
            return set(self._part(namespace).docs)

    def count(self, namespace: str) -> int:
        with self._lock:
            return len(self._part(namespace).docs)

    def build(self, namespace: str) -> None:
        """The BM25 matrix of what the namespace holds now (done by the first search after a change)."""
        import bm25s
        from bm25s.tokenization import Tokenized

        with self._lock:
            part = self._part(namespace)
            if part.model is not None or not part.docs:
                return
            part.ids = np.fromiter(part.docs, np.int64, len(part.docs))
            model = bm25s.BM25()
            model.index(Tokenized(ids=list(part.docs.values()), vocab=part.vocab), create_empty_token=False,
                        show_progress=False)
            part.model = model

    def search(self, namespace: str, query: str, k: int) -> list[tuple[int, float]]:
        """Up to k (id, score), best first; only chunks sharing a word with the query score."""
        words = self._tokenize([query])[0]
        with self._lock:
            self.build(namespace)
            part = self._part(namespace)
            q = [part.vocab[w] for w in words if w in part.vocab]
            if part.model is None or not q or k <= 0:
                return []
            scores = part.model.get_scores(q)  # (n,) float32, one per id
            ids = part.ids
        top = np.argpartition(-scores, min(k, len(scores)) - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(ids[i]), float(scores[i])) for i in top if scores[i] > 0]
