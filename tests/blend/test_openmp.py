"""torch's OpenMP workers spin briefly (`blend.openmp`): set by any use of blend before torch loads, a value set
outside kept, and the CLI's first torch import is blend's."""
import os
import subprocess
import sys

from blend import openmp

PRINT = "import os; {}; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"


def _run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    return subprocess.run([sys.executable, "-c", "import sys; " + code], capture_output=True, text=True, check=True,
                          env={**base, **env}).stdout.strip()


def test_blend_sets_the_spin_before_torch_loads_and_keeps_a_value_set_outside():
    assert _run(PRINT.format("import blend")) == f"{openmp.SPINCOUNT} True"
    assert _run(PRINT.format("import blend"), GOMP_SPINCOUNT="7") == "7 True"
    assert _run(PRINT.format("import torch")) == "None True"  # the line above is blend's doing


def test_the_cli_loads_torch_only_through_blend():
    assert _run(PRINT.format("import api.cli")) == "None False"  # main() then imports blend.model first
