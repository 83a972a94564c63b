"""Per-namespace BM25 indexes over chunk ids: bm25s's tokenizer (English stop words, words of 2+ characters)
with PyStemmer's Snowball stemmer, and Lucene's BM25 (k1 1.5, b 0.75) — the scores of `bm25s.BM25()`, which a
test holds this to.

A text is tokenized and counted once, when it is added; a namespace's score matrix (token → postings of
(doc, score), numpy, CSC) is rebuilt from those counts at the first search after a change (one sort of
the postings; bm25s's own build loops over documents in Python and is 2–3× slower). In memory only: the
caller keeps it in step with its truth, as it does the FAISS index.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

K1, B = 1.5, 0.75


def _tokenizer():
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    return lambda texts: bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, return_ids=False,
                                        show_progress=False)


@dataclass
class _Matrix:
    ids: np.ndarray  # (n,) int64 chunk ids, one per document column
    indptr: np.ndarray  # (V + 1,) postings of token t: [indptr[t], indptr[t + 1])
    docs: np.ndarray  # (nnz,) int32 document column
    scores: np.ndarray  # (nnz,) float32 idf · tf saturation


@dataclass
class _Part:
    vocab: dict[str, int] = field(default_factory=dict)  # grows only: a removed text's words stay, unmatched
    docs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # id → (tokens, counts) int32
    matrix: _Matrix | None = None  # None after a change


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
                ids_ = np.fromiter((part.vocab.setdefault(w, len(part.vocab)) for w in words), np.int32, len(words))
                part.docs[int(i)] = tuple(a.astype(np.int32) for a in np.unique(ids_, return_counts=True))
            part.matrix = None

    def remove(self, namespace: str, ids) -> None:
        with self._lock:
            part = self._part(namespace)
            for i in ids:
                part.docs.pop(int(i), None)
            part.matrix = None

    def ids(self, namespace: str) -> set[int]:
        with self._lock:
            return set(self._part(namespace).docs)

    def count(self, namespace: str) -> int:
        with self._lock:
            return len(self._part(namespace).docs)

    def build(self, namespace: str) -> None:
        """The score matrix of what the namespace holds now (done by the first search after a change)."""
        with self._lock:
            part = self._part(namespace)
            if part.matrix is None and part.docs:
                part.matrix = _build(part.docs, len(part.vocab))

    def search(self, namespace: str, query: str, k: int) -> list[tuple[int, float]]:
        """Up to k (id, score), best first; only chunks sharing a word with the query score."""
        words = self._tokenize([query])[0]
        with self._lock:
            self.build(namespace)
            part = self._part(namespace)
            m, q = part.matrix, [part.vocab[w] for w in words if w in part.vocab]
        if m is None or not q or k <= 0:
            return []
        scores = np.zeros(len(m.ids), np.float32)  # (n,)
        for t in q:  # a document appears once in a token's postings: plain fancy-index adds are exact
            a, b = m.indptr[t], m.indptr[t + 1]
            scores[m.docs[a:b]] += m.scores[a:b]
        top = np.argpartition(-scores, min(k, len(scores)) - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(m.ids[i]), float(scores[i])) for i in top if scores[i] > 0]


def _build(docs: dict[int, tuple[np.ndarray, np.ndarray]], vocab_size: int) -> _Matrix:
    ids = np.fromiter(docs, np.int64, len(docs))
    tokens = np.concatenate([t for t, _ in docs.values()])  # (nnz,)
    tf = np.concatenate([c for _, c in docs.values()]).astype(np.float32)
    width = np.fromiter((len(t) for t, _ in docs.values()), np.int64, len(docs))
    col = np.repeat(np.arange(len(docs), dtype=np.int32), width)  # (nnz,) the document of each posting
    length = np.bincount(col, weights=tf, minlength=len(docs))  # (n,) tokens per document
    df = np.bincount(tokens, minlength=vocab_size)
    idf = np.log1p((len(docs) - df + 0.5) / (df + 0.5)).astype(np.float32)  # Lucene's
    norm = (K1 * (1 - B + B * length / length.mean())).astype(np.float32)
    scores = idf[tokens] * tf / (tf + norm[col])
    order = np.argsort(tokens, kind="stable")
    indptr = np.concatenate([[0], np.cumsum(df)])
    return _Matrix(ids, indptr, col[order], scores[order])
