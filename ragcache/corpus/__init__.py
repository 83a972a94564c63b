"""corpus: documents in, chunks out, and retrieval that stays fresh with SQL.

Files become documents (`readers`, each format's structure read by `formats`) and documents token chunks
along their headings and paragraphs (`chunking`); chunks enter SQL new, unchanged or replaced (`ingest`), a changed document's new chunks staged until they are
precomputed and then swapped in (`versions`);
`corpus.Corpus` adds, shows and deletes documents; `retrieval.Retriever` searches each namespace's FAISS
and BM25 indexes (alone or rank-fused), each re-synced whenever any process changed what the namespace holds.

May import: config, errors, meta, database (and blend, index).
"""
