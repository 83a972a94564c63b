"""Per-namespace FAISS indexes over chunk ids: add, search, remove, persist, reload.

One index file per namespace under `root`: a query names its namespace and can only ever
search that partition. Inner product over unit vectors (cosine). Kinds:
- flat (default): exact;
- ivf: IVF-Flat once a namespace holds 40 × nlist vectors (exact flat until then);
- hnsw: graph search; FAISS cannot delete from HNSW, so a removal rebuilds the partition.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import faiss
import numpy as np

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
log = logging.getLogger("index")


class VectorIndex:
    def __init__(self, root: Path, dim: int, kind: str = "flat", nlist: int = 256, hnsw_m: int = 32):
        if kind not in ("flat", "ivf", "hnsw"):
            raise ValueError("index kind must be flat, ivf or hnsw")
        self.root, self.dim, self.kind, self.nlist, self.hnsw_m = Path(root), dim, kind, nlist, hnsw_m
        self.root.mkdir(parents=True, exist_ok=True)
        self._parts: dict[str, faiss.Index] = {}
        self._lock = threading.RLock()

    def _path(self, namespace: str) -> Path:
        return self.root / f"{_SAFE.sub('_', namespace)}.{self.kind}.faiss"

    def _new(self, vectors: np.ndarray | None = None):
        """An empty partition: IDMap2 over flat or HNSW; IVF-Flat (which keeps ids itself) once trained."""
        if self.kind == "ivf" and vectors is not None and len(vectors) >= 40 * self.nlist:
            quantizer = faiss.IndexFlatIP(self.dim)
            ivf = faiss.IndexIVFFlat(quantizer, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT)
            quantizer.this.disown()  # the IVF index owns and frees its quantizer
            ivf.own_fields = True
            ivf.train(vectors)
            ivf.nprobe = max(1, self.nlist // 4)
            return ivf
        if self.kind == "hnsw":
            base = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction, base.hnsw.efSearch = 200, 128
        else:
            base = faiss.IndexFlatIP(self.dim)
        base.this.disown()  # the id map owns the base index
        wrapped = faiss.IndexIDMap2(base)
        wrapped.own_fields = True
        return wrapped

    def _part(self, namespace: str) -> faiss.Index:
        with self._lock:
            if namespace not in self._parts:
                path = self._path(namespace)
                self._parts[namespace] = self._read(path) if path.is_file() else self._new()
            return self._parts[namespace]

    def _read(self, path: Path) -> faiss.Index:
        """The saved partition; a damaged one (or of another dimension) is started afresh: the index is
        a cache of SQL, so the caller's next sync refills it from the stored embeddings."""
        try:
            part = faiss.read_index(str(path))
            if part.d == self.dim:
                return part
        except RuntimeError:
            pass
        log.warning("%s is damaged or of another model: rebuilt from the database", path)
        return self._new()

    def keep_only(self, namespaces) -> list[str]:
        """Partitions (in memory and on disk) of every namespace not in `namespaces` dropped; their files."""
        keep = {self._path(ns).name for ns in namespaces}
        with self._lock:
            for ns in [ns for ns in self._parts if self._path(ns).name not in keep]:
                del self._parts[ns]
            gone = [p for p in self.root.glob(f"*.{self.kind}.faiss") if p.name not in keep]
            for path in gone:
                path.unlink(missing_ok=True)
        return [p.name for p in gone]

    def add(self, namespace: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """ids (n,) int64, vectors (n, dim) float32. Re-adding an id replaces its vector."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        assert vectors.shape == (len(ids), self.dim), (vectors.shape, len(ids), self.dim)
        with self._lock:
            self.remove(namespace, ids)
            part = self._part(namespace)
            if self.kind == "ivf" and isinstance(part, faiss.IndexIDMap2) and part.ntotal + len(ids) >= 40 * self.nlist:
                have_ids, have = self._contents(part)  # enough vectors to train: switch to IVF
                ids, vectors = np.concatenate([have_ids, ids]), np.concatenate([have, vectors])
                part = self._parts[namespace] = self._new(vectors)
            part.add_with_ids(vectors, ids)

    def remove(self, namespace: str, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        with self._lock:
            part = self._part(namespace)
            if part.ntotal == 0 or len(ids) == 0:
                return
            if self.kind != "hnsw":
                part.remove_ids(ids)
                return
            have_ids = self._ids(part)
            keep = ~np.isin(have_ids, ids)
            if keep.all():  # none of them held: nothing to rebuild
                return
            have = part.index.reconstruct_n(0, part.ntotal)  # HNSW cannot delete: rebuild without them
            fresh = self._new()
            if keep.any():
                fresh.add_with_ids(have[keep], have_ids[keep])
            self._parts[namespace] = fresh

    @classmethod
    def _contents(cls, part: faiss.IndexIDMap2) -> tuple[np.ndarray, np.ndarray]:
        vecs = part.index.reconstruct_n(0, part.ntotal) if part.ntotal else np.empty((0, part.d), np.float32)
        return cls._ids(part), vecs

    @staticmethod
    def _ids(part) -> np.ndarray:
        if isinstance(part, faiss.IndexIDMap2):
            return faiss.vector_to_array(part.id_map).astype(np.int64)
        lists = part.invlists  # IVF keeps the ids in its inverted lists
        chunks = [faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy() for i in range(part.nlist)
                  if lists.list_size(i)]
        return np.concatenate(chunks).astype(np.int64) if chunks else np.empty(0, np.int64)

    def search(self, namespace: str, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """query (dim,) → up to k (id, score), best first. Under the lock: an add or remove never races it."""
        with self._lock:
            part = self._part(namespace)
            if part.ntotal == 0 or k <= 0:
                return []
            scores, ids = part.search(np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1),
                                      min(k, part.ntotal))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i != -1]

    def ids(self, namespace: str) -> set[int]:
        with self._lock:
            return set(self._ids(self._part(namespace)).tolist())

    def count(self, namespace: str) -> int:
        with self._lock:
            return self._part(namespace).ntotal

    def save(self, namespace: str) -> None:
        """Atomically: write a temp file, fsync, rename."""
        with self._lock:
            part = self._part(namespace)
            path = self._path(namespace)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            faiss.write_index(part, str(tmp))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
