"""corpus: documents in, chunks out, and retrieval that stays fresh with SQL.

Files become documents and documents token chunks (`chunking`); chunks enter SQL new, unchanged or replaced
(`ingest`); `corpus.Corpus` adds, shows and deletes documents and retrieves over each namespace's FAISS index,
re-synced whenever any process changed what the namespace holds.

May import: config, errors, meta (and blend, index).
"""
