"""`ragcache bench WHAT`: scripts whose printed output goes into BENCHMARKS.md with the command."""
from __future__ import annotations

import importlib


def run_bench(settings, args) -> int:
    module = importlib.import_module(f"{__name__}.{args.what}")
    return module.run(settings, args)
