"""index: text → vectors (all-MiniLM-L6-v2, offline) and per-namespace FAISS indexes.

Never imports ragcache or api (DESIGN.md layering).
"""
from .embed import Embedder, EmbedderError
from .faiss_index import VectorIndex

__all__ = ["Embedder", "EmbedderError", "VectorIndex"]
