"""`ragcache bench WHAT`: scripts whose printed output goes into BENCHMARKS.md with the command.

May import: config, errors, meta, database, store, corpus, parts, evaluation, serving, jobs, service (and blend, index).
"""
from __future__ import annotations

import importlib


def run_bench(settings, args) -> int:
    module = importlib.import_module(f"{__name__}.{args.what}")
    return module.run(settings, args)
