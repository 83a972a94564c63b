"""numba's parallel loops on TBB, for every compiled kernel that runs them (`cpu_int8`, `cpu_groups`): import
this module before numba.

Its OpenMP layer, launched from any thread but the main one (the server's model thread), ran a decode step 5x
slower on this machine (299 against 59 ms, SmolLM2 at 2.5K tokens of context); TBB's does not (71 ms). The `tbb`
wheel puts libtbb in the environment's lib/, off the loader's path: loaded here before numba, numba's default
order (tbb, omp, workqueue) takes it. Without the wheel numba falls back to OpenMP.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path


def _load_tbb() -> None:
    lib = Path(sys.prefix) / "lib" / "libtbb.so.12"
    if lib.is_file():
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


_load_tbb()

import numba  # noqa: E402
import torch  # noqa: E402


def cores() -> int:
    """Threads a parallel call may take: torch's, within numba's pool."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
