"""How torch's OpenMP workers wait, set before torch loads its runtime (libgomp reads it once): `blend`
imports this module first, so any use of blend sets it. A value set outside the process stays.

After each parallel op torch's workers spin GOMP_SPINCOUNT times before they sleep. libgomp's default,
300,000, lasts milliseconds where `pause` is slow (~140 cycles on Intel cores since Skylake), and a spinning
worker holds the core that numba's workers need next: the int8 attention of a decode step runs on them after
each fbgemm product. On a 2-core Sapphire Rapids host, int8 KV and int8 decode weights: a step of 16
sequences 164 → 104 ms at 50,000, 16 HTTP clients 77 → 113 tokens/s, one client alone unchanged (30,000 cost
it ~8%, 100,000 kept half the gain); float32 serving unchanged (BENCHMARKS.md).
"""
import os

SPINCOUNT = "50000"

os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
