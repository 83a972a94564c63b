"""torch's OpenMP workers spin briefly (`blend.openmp`): set by any use of blend before torch starts loading, a value
set outside kept; importing the CLI loads no torch, so its `main` loads torch through blend."""
import os
import subprocess
import sys

from blend import openmp

# prints GOMP_SPINCOUNT as it is when `import torch` starts (libgomp reads it as torch loads), or "no torch"
AT_TORCH = """import os, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not hasattr(self, "seen"):
            self.seen = True
            print(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Watch())
{}
if "torch" not in sys.modules:
    print("no torch")
"""


def _run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    return subprocess.run([sys.executable, "-c", AT_TORCH.format(code)], capture_output=True, text=True, check=True,
                          env={**base, **env}).stdout.strip()


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
