"""The `ragcache` command: usage errors exit 2 with a message, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


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
    r = _run("demo", env={**os.environ, "RAGCACHE_DTYPE": "float8"})
    assert r.returncode == 2 and "setting dtype" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_path_is_one_line(tmp_path):
    r = _run("--model", str(tmp_path / "missing"), "demo")
    assert r.returncode == 1 and "config.json missing" in r.stderr and "Traceback" not in r.stderr


DEMO = Path(__file__).parents[2] / "demo" / "data" / "musique_demo.json"


def test_eval_knob_out_of_range_is_named():
    for flag, value, words in [("--ratios", "2", "ratio must be in [0, 1]"), ("--epic-k", "-1", "epic k must be >= 0")]:
        r = _run("eval", "--dataset", str(DEMO), flag, value)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_a_bad_bench_codec_is_named_before_any_work():
    for value, words in [("compact-k9", "unknown codec(s) compact-k9"), ("compact,raw", "raw is always measured")]:
        r = _run("bench", "store", "--parts", "codecs", "--codecs", value)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def _bad_files(tmp: Path) -> dict[str, Path]:
    (tmp / "latin1.jsonl").write_bytes(b'{"id": 1, "text": "caf\xe9"}\n')
    (tmp / "empty.json").write_text("[]")
    (tmp / "strings.json").write_text('[{"question": "q", "answers": ["a"], "ctxs": ["just a string"]}]')
    (tmp / "a_file").write_text("x")
    return {p.stem: p for p in tmp.iterdir()}


@pytest.mark.parametrize("args, env, words", [
    (["ask", "what?", "--ratio", "2"], {}, "ratio must be in [0, 1]"),
    (["ask", "what?", "--mode", "epic", "--epic-k", "-1"], {}, "epic k must be >= 0"),
    (["ask", "   "], {}, "the query is empty"),
    (["ask", "what?"], {"RAGCACHE_CACHEBLEND_RATIO": "2"}, "setting cacheblend_ratio"),
    (["ask", "what?"], {"RAGCACHE_MAX_NEW_TOKENS": "0"}, "setting max_new_tokens"),
    (["ask", "what?"], {"RAGCACHE_DATABASE_URL": "nonsense"}, "database URL 'nonsense' is not usable"),
    (["eval", "--dataset", "{tmp}"], {}, "cannot be read"),
    (["eval", "--dataset", "{latin1}"], {}, "is not a JSON file"),
    (["eval", "--dataset", "{strings}"], {}, "expected a list of"),
    (["eval", "--dataset", str(DEMO), "--out", "{a_file}"], {}, "cannot write results to"),
    (["calibrate", "--dataset", str(DEMO), "--target-kl", "nan"], {}, "--target-kl must be >= 0"),
    (["ingest", "{latin1}"], {}, "cannot be read as UTF-8"),
    (["ingest", "{empty}"], {}, "holds no documents"),
    (["ingest", "{strings}"], {}, "expected a list of"),
    (["ingest", "{a_file}"], {}, "unsupported type '(no suffix)'"),
    (["search", "x", "--retrieval", "sparse"], {}, "invalid choice: 'sparse'"),
    (["ask", "what?"], {"RAGCACHE_RETRIEVAL": "sparse"}, "setting retrieval"),
    (["ask", "what?", "--stop", ""], {}, "--stop: must be 1 to 256 characters"),
    (["ask", "what?", *"--stop a --stop b --stop c --stop d --stop e".split()], {}, "at most 4 stop strings"),
    (["bench", "blend", "--repeats", "0"], {}, "must be >= 1"),
    (["bench", "blend", "--question", "99999"], {}, "--question must be in [0, "),
    (["bench", "blend", "--chunk-prefill", "lead"], {}, "lead is measured by `ragcache eval`"),
    (["bench", "serve", "--clients", "1,0"], {}, "--clients: expected positive integers, got '1,0'"),
    (["bench", "store", "--passages", "0"], {}, "--passages: expected positive integers, got '0'"),
])
def test_bad_input_is_one_named_line(tmp_path, monkeypatch, capsys, args, env, words):
    """In this process (the command's `main`, as `python -m ragcache.cli` runs it; the tests above start it for
    real): a traceback here would be an exception out of `main`."""
    from ragcache.cli import main

    files = _bad_files(tmp_path)
    args = [a.format(tmp=tmp_path, **files) if "{" in a else a for a in args]
    for name in [k for k in os.environ if k.startswith("RAGCACHE_")]:
        monkeypatch.delenv(name)
    for name, value in {"RAGCACHE_HOME": str(tmp_path / "home"), **env}.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(args)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and words in err.strip().splitlines()[-1], err[-800:]  # the last line names it


def test_ingest_a_folder_of_mixed_files_reports_each_bad_one_and_ingests_the_rest(tmp_path, smollm):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.md").write_text("# Harbour\n\n## History\n\nThe harbour was dredged in 1901.\n")
    (folder / "page.html").write_text("<html><body><h1>Quay</h1><p>The quay is a museum.</p></body></html>")
    (folder / "scan.pdf").write_bytes(b"%PDF-1.7 not a real one")
    (folder / "data.xyz").write_text("?")
    env = {**os.environ, "RAGCACHE_HOME": str(tmp_path / "home"), "RAGCACHE_MODEL": str(smollm.path)}
    r = _run("ingest", str(folder), "--namespace", "mixed", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-800:]
    assert "documents: added=2" in r.stdout and "files not read: 2" in r.stdout
    bad = [line for line in r.stderr.splitlines() if line.startswith("ragcache: not ingested: ")]
    assert len(bad) == 2 and "scan.pdf: cannot be read as PDF" in bad[1] and "data.xyz: unsupported type" in bad[0]
    r = _run("ingest", str(folder), "--namespace", "mixed", env=env)
    assert "documents: added=0 unchanged=2" in r.stdout  # an unchanged file is a no-op


def test_a_plain_eval_measures_deferred_and_a_plain_calibrate_leaves_it_to_be_named(settings):
    from ragcache.cli import build_parser
    from ragcache.commands import calibrate_config, eval_config

    parse = build_parser().parse_args
    assert "deferred" in eval_config(parse(["eval", "--dataset", "x.json"]), settings).modes
    calibrate = ["calibrate", "--dataset", "x.json", "--target-kl", "0.05"]
    plain = calibrate_config(parse(calibrate), settings).modes
    assert "deferred" not in plain and {"reuse", "probe", "cacheblend"} <= set(plain)
    named = calibrate_config(parse([*calibrate, "--modes", "full,deferred"]), settings)
    assert named.modes == ["full", "deferred"]
