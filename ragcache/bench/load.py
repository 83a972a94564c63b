"""Model load time: first (dequantizes the GGUF) and second (cached safetensors), each in a fresh process."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from .timing import table

_CHILD = """
import json, sys, time
import torch  # every ragcache process imports torch first; not counted
t0 = time.perf_counter()
from pathlib import Path
from blend.model import load_model
from blend.runner import Runner
m = load_model(sys.argv[1], Path(sys.argv[2]))
t1 = time.perf_counter()
Runner(m)
print(json.dumps({"load_s": t1 - t0, "runner_s": time.perf_counter() - t1}))
"""


def run(settings, args) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for label in ("first (dequantize GGUF)", "second (cached)", "third (cached)"):
            out = subprocess.run([sys.executable, "-c", _CHILD, settings.model, home], capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([label, r["load_s"], r["runner_s"]])
    print(f"model {settings.model}; fresh RAGCACHE_HOME; seconds inside a fresh process, `import torch` excluded")
    print(table(rows, ["load", "load_model s", "Runner() s"]))
    return 0
