"""evaluation: quality against latency, offline.

`evaluate` runs every mode against full prefill on a MuSiQue-format file (fidelity, gold F1, TTFT); `scores`
holds the metrics (F1, KL), `plot` the Pareto plot, `results` where a run's results go (and reads the home's
latest back), `calibrate` stores the fastest mode within a KL target.

May import: config, errors, meta, database, store, corpus, lead (and blend, index).
"""
