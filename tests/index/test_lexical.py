"""The BM25 index (stemming, stop words, add/replace/remove per namespace) and the fusion of two rankings."""
from __future__ import annotations

from index import LexicalIndex, convex, rrf


def test_bm25_stems_scores_replaces_and_removes_per_namespace():
    idx = LexicalIndex()
    idx.add("a", [1, 2, 3], ["Paris is the capital of France.", "Berlin lies on the Spree in Germany.",
                             "The capitals of Italy and Spain are Rome and Madrid."])
    idx.add("b", [9], ["Paris, Texas, is a small city."])
    found = idx.search("a", "What is the capital of France?", 5)
    assert [i for i, _ in found][:2] == [1, 3]  # "capitals" stems to what "capital" does
    assert all(s > 0 for _, s in found) and found[0][1] > found[1][1]
    assert idx.search("a", "the of is", 5) == []  # only stop words: nothing scores
    assert [i for i, _ in idx.search("b", "Paris", 5)] == [9]  # namespaces never mix
    idx.add("a", [1], ["Lyon is a city in France."])  # re-adding replaces the text
    assert 1 not in [i for i, _ in idx.search("a", "capital", 5)]
    idx.remove("a", [1, 3])
    assert idx.ids("a") == {2} and idx.search("a", "France capital", 5) == []
    assert idx.search("a", "Spree", 5)[0][0] == 2


def test_rank_fusion_and_convex_mix():
    dense = [(1, 0.9), (2, 0.8), (3, 0.1)]
    lexical = [(3, 12.0), (2, 11.0), (4, 1.0)]
    fused = rrf([dense, [(2, 5.0), (4, 4.0), (5, 3.0)]], 3)
    assert [i for i, _ in fused] == [2, 1, 4]  # in both lists beats first in one alone
    assert abs(fused[0][1] - (1 / 62 + 1 / 61)) < 1e-12
    assert [i for i, _ in convex(dense, lexical, 1.0, 2)] == [1, 2]  # all dense
    assert [i for i, _ in convex(dense, lexical, 0.0, 2)] == [3, 2]  # all lexical
    assert convex(dense, [], 0.5, 1) == [(1, 0.5)]


def test_scores_are_bm25s_lucene_scores():
    import bm25s
    import Stemmer

    texts = ["The harbour was dredged in 1901 and again in 1911.", "A harbour master kept the harbour books.",
             "Ships carried grain, timber and salt.", "Salt from the marshes was the harbour's first trade."]
    idx = LexicalIndex()
    idx.add("a", [10, 11, 12, 13], texts)
    stemmer = Stemmer.Stemmer("english")
    ref = bm25s.BM25()
    ref.index(bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False), show_progress=False)
    for query in ("harbour salt", "dredged harbour 1911", "timber"):
        q = bm25s.tokenize([query], stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)[0]
        want = ref.get_scores(q)
        got = dict(idx.search("a", query, 4))
        assert all(abs(got.get(10 + i, 0.0) - float(w)) < 1e-5 for i, w in enumerate(want)), (query, got, want)
