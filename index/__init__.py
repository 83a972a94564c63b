"""index: text → vectors (all-MiniLM-L6-v2, offline), per-namespace FAISS indexes, per-namespace BM25
indexes (bm25s) and the fusion of their rankings.

Never imports ragcache or api (DESIGN.md layering).
"""
from .embed import Embedder, EmbedderError
from .faiss_index import VectorIndex
from .fusion import convex, rrf
from .lexical import LexicalIndex

__all__ = ["Embedder", "EmbedderError", "LexicalIndex", "VectorIndex", "convex", "rrf"]
