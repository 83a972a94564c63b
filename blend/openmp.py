"""How torch's OpenMP workers wait, set before torch loads its runtime (libgomp reads it once): `blend`
imports this module first, so any use of blend sets it. A value set outside the process stays.

After each parallel op torch's workers spin GOMP_SPINCOUNT times before they sleep. libgomp's default,
300,000, lasts milliseconds, and a spinning worker holds the core that numba's workers need next: the int8
attention of a decode step runs on them after each fbgemm product. How short the spin must be differs by
core, measured on two 2-core hosts with int8 KV and int8 decode weights (BENCHMARKS.md):
- Sapphire Rapids (Intel): a step of 16 sequences 164 → 104 ms at 50,000, 16 HTTP clients 77 → 113 tokens/s,
  one client alone unchanged (30,000 cost it ~8%, 10,000 ~17% in process);
- Zen 4 (AMD EPYC, `pause` ~24 ns): 50,000 still left a step of 16 at 80–90 ms; at 10,000 it takes 55–57 ms,
  16 HTTP clients 124–129 → 168–186 tokens/s, one client's reuse unchanged.
float32 serving unchanged on both (on the AMD host measured for one client). A Zen 3 EPYC (AVX2, `pause` ~28 ns)
was measured too: its runs' own spread was wider than any count's effect, so AMD keeps one count.
"""
import os

from . import cpuinfo

BY_VENDOR = {"AuthenticAMD": "10000"}
DEFAULT = "50000"


def spincount(path: str = cpuinfo.PATH) -> str:
    """This host's spin count: by its CPU's vendor, DEFAULT where the cpuinfo at `path` does not say."""
    return BY_VENDOR.get(cpuinfo.vendor(cpuinfo.read(path)), DEFAULT)


os.environ.setdefault("GOMP_SPINCOUNT", spincount())
