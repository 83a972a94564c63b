"""The `ragcache` command: usage errors exit 2 with a message, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragcache.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_unknown_subcommand_prints_usage_and_exits_2():
    r = _run("frobnicate")
    assert r.returncode == 2 and "usage: ragcache" in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_exits_2():
    r = _run("bench", "load", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_bad_setting_is_named(monkeypatch):
    import os

    r = _run("demo", env={**os.environ, "RAGCACHE_DTYPE": "float8"})
    assert r.returncode == 2 and "setting dtype" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_path_is_one_line(tmp_path):
    r = _run("--model", str(tmp_path / "missing"), "demo")
    assert r.returncode == 1 and "config.json missing" in r.stderr and "Traceback" not in r.stderr


def test_eval_knob_out_of_range_is_named():
    dataset = Path(__file__).parents[2] / "demo" / "data" / "musique_demo.json"
    for flag, value, words in [("--ratios", "2", "ratio must be in [0, 1]"), ("--epic-k", "-1", "epic k must be >= 0")]:
        r = _run("eval", "--dataset", str(dataset), flag, value)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
