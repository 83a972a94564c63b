"""numba's compiled loops in 512-bit vectors on a CPU with AVX-512, set before numba builds its code generator
(it reads NUMBA_CPU_FEATURES then, at its first compile or cache load): `blend` imports this module first. A value
set outside the process stays.

LLVM tunes Intel's server cores (Skylake-SP to Emerald Rapids) to prefer 256-bit vectors, so numba's kernels ran
on AVX-512 hosts at AVX2's width. Turning that preference off (`-prefer-256-bit`) doubles the lanes of every loop
LLVM vectorizes (measured on a 2-core Emerald Rapids, BENCHMARKS.md: the int8 cache's value pass 25 → 16 µs for
one head's 2,475 keys). A CPU without AVX-512 is left to numba's own choice.
"""
import os

from . import cpuinfo

PREFER_512 = "-prefer-256-bit"


def choose(environ: dict, info: str, host) -> None:
    """environ's NUMBA_CPU_FEATURES, unless it has one: the host's features (`host()`, LLVM's `+avx2,+fma,...`)
    with 256-bit preference off where cpuinfo text `info` shows AVX-512; else numba's default stays."""
    if "NUMBA_CPU_FEATURES" not in environ and "avx512f" in cpuinfo.flags(info):
        environ["NUMBA_CPU_FEATURES"] = f"{host()},{PREFER_512}"


def _host() -> str:
    import llvmlite.binding as llvm  # numba's LLVM: loading it builds no code generator

    return llvm.get_host_cpu_features().flatten()


choose(os.environ, cpuinfo.read(), _host)
