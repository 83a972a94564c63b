"""Embedder and FAISS index: add, search, remove, persist, namespaces; retrieval on MuSiQue."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from index import Embedder, VectorIndex

DATA = Path(__file__).resolve().parents[2] / "demo" / "data" / "musique_dev.json"
RECALL_AT_10_BOUND = 0.95  # measured: 1.000 (every question's own passages in its top 10 of 466)


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder()


def _unit(n: int, dim: int = 8, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_embeddings_are_unit_length_and_semantic(embedder):
    v = embedder.embed(["The cat sat on the mat.", "A feline rested on a rug.", "Stock markets fell sharply."])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3


def test_the_embedder_equals_transformers_pipeline_and_never_imports_it(embedder):
    """index/bert.py is BERT's forward pass without transformers: on texts that pad each other in one batch, one
    past MAX_TOKENS (cut, its [SEP] kept), an empty one and non-ASCII ones it gives transformers' token ids and
    mean-pooled embeddings; and a process that embeds never imports transformers (~3 s of every start)."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModel, AutoTokenizer

    from index.embed import MAX_TOKENS, model_dir

    data = json.loads(DATA.read_text())
    texts = ([c["text"] for c in data[0]["ctxs"][:6]] + [d["question"] for d in data[:6]]
             + ["", "Ünïcödé café — naïve 東京 ﬁ", "word " * 600, " ".join(data[1]["ctxs"][0]["text"].split()[:300])])
    tok = AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    batch = tok(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    assert [e.ids for e in embedder._batches.encode_batch(texts)] == batch["input_ids"].tolist()
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(model_dir(), local_files_only=True).eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    theirs = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    assert np.abs(embedder.embed(texts) - theirs).max() < 1e-5
    probe = "import sys; from index import Embedder; Embedder().embed(['x']); print('transformers' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == "False", found.stderr


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_add_search_remove_persist_reload(tmp_path, kind):
    idx = VectorIndex(tmp_path, 8, kind, nlist=2)
    vecs = _unit(100)
    idx.add("a", np.arange(100, 200), vecs)
    assert idx.search("a", vecs[7], 1)[0][0] == 107
    idx.add("a", np.array([107]), vecs[8:9])  # re-adding replaces, never duplicates
    assert idx.count("a") == 100
    idx.remove("a", np.array([108, 150]))
    assert idx.count("a") == 98 and 150 not in idx.ids("a")
    idx.save("a")
    again = VectorIndex(tmp_path, 8, kind, nlist=2)
    assert again.ids("a") == idx.ids("a")
    top = [i for i, _ in again.search("a", vecs[8], 2)]
    assert 107 in top and 108 not in top


def test_a_query_never_crosses_namespaces(tmp_path):
    idx = VectorIndex(tmp_path, 8)
    vecs = _unit(10)
    idx.add("tenant-a", np.arange(10), vecs)
    idx.add("tenant-b", np.arange(100, 101), vecs[:1])
    assert {i for i, _ in idx.search("tenant-b", vecs[3], 10)} == {100}
    assert idx.search("tenant-c", vecs[3], 10) == []


def test_recall_at_10_on_all_musique_passages(tmp_path, embedder):
    data = json.loads(DATA.read_text())
    texts = sorted({c["text"] for q in data for c in q["ctxs"]})
    ids = {t: i for i, t in enumerate(texts)}
    idx = VectorIndex(tmp_path, embedder.dim)
    idx.add("musique", np.arange(len(texts)), embedder.embed(texts))
    queries = embedder.embed([q["question"] for q in data])
    recalls = []
    for q, v in zip(data, queries):
        own = {ids[c["text"]] for c in q["ctxs"]}
        recalls.append(len(own & {i for i, _ in idx.search("musique", v, 10)}) / len(own))
    print(f"recall@10 over {len(data)} questions, {len(texts)} passages: {np.mean(recalls):.3f}")
    assert np.mean(recalls) >= RECALL_AT_10_BOUND


def test_a_damaged_partition_file_starts_afresh_and_dead_namespaces_are_dropped(tmp_path):
    idx = VectorIndex(tmp_path, 8)
    for ns in ("a", "gone"):
        idx.add(ns, np.arange(3), np.eye(3, 8, dtype=np.float32))
        idx.save(ns)
    (tmp_path / "a.flat.faiss").write_bytes(b"\x00garbage" * 10)
    again = VectorIndex(tmp_path, 8)
    assert again.count("a") == 0 and again.search("a", np.ones(8, np.float32), 2) == []  # refilled by a sync
    assert again.keep_only(["a"]) == ["gone.flat.faiss"] and not (tmp_path / "gone.flat.faiss").exists()
    assert (tmp_path / "a.flat.faiss").exists()
