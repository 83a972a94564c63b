"""What `blend` sets before torch starts loading, a value set outside kept: how torch's OpenMP workers spin
(`blend.openmp`), huge pages for its CPU allocator (`blend.hugepages`) and numba's vector width (`blend.vectors`);
importing the CLI loads no torch, so its `main` loads torch through blend."""
import os
import re
import subprocess
import sys
from pathlib import Path

from blend import cpuinfo, openmp, vectors

# prints the variable as it is when `import torch` starts (libgomp and c10 read theirs once), or "no torch"
AT_TORCH = """import os, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not hasattr(self, "seen"):
            self.seen = True
            print(os.environ.get({var!r}))
sys.meta_path.insert(0, Watch())
{code}
if "torch" not in sys.modules:
    print("no torch")
"""
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _run(code: str, var: str = "GOMP_SPINCOUNT", **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != var}
    return subprocess.run([sys.executable, "-c", AT_TORCH.format(var=var, code=code)], capture_output=True, text=True,
                          check=True, env={**base, **env}).stdout.strip()


def test_blend_sets_the_spin_before_torch_starts_loading_and_keeps_a_value_set_outside():
    assert _run("import blend") == openmp.spincount()
    assert _run("from blend.model import ModelError") == openmp.spincount()  # the CLI's first import of torch
    assert _run("import blend", GOMP_SPINCOUNT="7") == "7"
    assert _run("import torch") == "None"  # without blend, libgomp's own default


def test_the_spin_count_follows_the_cpus_vendor(tmp_path):
    def on(text: str) -> str:
        (tmp_path / "cpuinfo").write_text(text)
        return openmp.spincount(str(tmp_path / "cpuinfo"))

    assert on("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == "10000"
    assert on("processor\t: 0\nvendor_id\t: GenuineIntel\n") == "50000"
    assert on("processor\t: 0\n") == openmp.DEFAULT == "50000"  # no vendor line
    assert openmp.spincount(str(tmp_path / "absent")) == "50000"


def test_importing_the_cli_loads_no_torch():
    assert _run("import api.cli") == "no torch"


# after the setting's value at torch's import, how many kB of the process are in huge pages once a fresh 16 MB
# tensor is written
TOUCH = """import re, blend, torch
x = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
print(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))"""


def test_blend_asks_for_huge_pages_before_torch_loads_and_a_fresh_tensor_gets_them_where_the_kernel_offers():
    var, half = "THP_MEM_ALLOC_ENABLE", 8 << 10
    offered = THP.exists() and re.search(r"\[(\w+)\]", THP.read_text()).group(1) != "never"
    always = THP.exists() and "[always]" in THP.read_text()
    asked, pages = _run(TOUCH, var).split()
    assert asked == "1" and (int(pages) >= half) == offered  # at least half the tensor in 2 MB pages, if offered
    asked, pages = _run(TOUCH, var, THP_MEM_ALLOC_ENABLE="0").split()
    assert asked == "0" and (int(pages) < half or always)  # a value set outside stays: no pages asked for
    assert _run("import torch", var) == "None"


AVX512 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"


def test_numba_compiles_for_512_bit_vectors_only_where_the_cpu_has_avx512_and_nothing_is_set_outside():
    def chosen(info: str, **environ) -> str | None:
        vectors.choose(environ, info, lambda: "+avx2,+avx512f")
        return environ.get("NUMBA_CPU_FEATURES")

    assert chosen(AVX512) == "+avx2,+avx512f,-prefer-256-bit"
    assert chosen(AVX2) is None and chosen("") is None  # numba's own choice
    assert chosen(AVX512, NUMBA_CPU_FEATURES="+sse2") == "+sse2"
    assert cpuinfo.flags(AVX512) == {"fpu", "sse", "avx2", "avx512f", "avx512bw"} and cpuinfo.flags("") == set()


# after `import blend`, the widest vector register a vectorized loop compiled by numba uses
ZMM = """import blend, numba, numpy as np
f = numba.njit(fastmath=True)(lambda x: (x * np.float32(2)).sum())
f(np.ones(4096, dtype=np.float32))
asm = next(iter(f.inspect_asm().values()))
print("zmm" if "zmm" in asm else "ymm" if "ymm" in asm else "xmm")"""


def test_blends_kernels_compile_to_512_bit_vectors_on_this_host_where_it_has_avx512():
    wide = "avx512f" in cpuinfo.flags(cpuinfo.read())
    assert _run(ZMM, "NUMBA_CPU_FEATURES").splitlines()[-1] == ("zmm" if wide else "ymm")
