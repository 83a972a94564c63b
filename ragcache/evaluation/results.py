"""Where a run's results go: the `--out` folder, and the home's `eval/latest` that a server's dashboard
shows (`GET /v1/eval/latest`). The latest file is read back only by that route: one cut short, garbage
or not a run's results is named in a one-line error there, never a 500, until the next run replaces it."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from ..errors import UserError

METRICS = ("ttft_s_median", "speedup_vs_full", "repair_s_median", "f1_gold", "f1_vs_full", "top1_agree", "kl_first",
           "kl_tf", "recompute_fraction", "work_fraction")


def output_dir(path: str | Path) -> Path:
    """The results folder, made now: a bad one fails before the run, not after it."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write results to {out}: {e.strerror}") from None
    return out


def latest_dir(home: Path) -> Path:
    """Where every run also leaves its results: what a server's dashboard shows."""
    return home / "eval" / "latest"


def write_results(results: dict, out: Path) -> None:
    """results.json, results.csv, pareto.png into `out`."""
    from .plot import pareto

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out / "results.json")  # a reader (the dashboard) never sees half a file
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", *METRICS])
        for label, m in results["modes"].items():
            w.writerow([label, *(f"{m[k]:.6g}" for k in METRICS)])
    pareto(results, out / "pareto.png")


def read_latest(home: Path) -> dict | None:
    """The latest run's results; None when no run has left any. A file that holds no run's results
    raises UserError naming it."""
    path = latest_dir(home) / "results.json"
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # a directory, unreadable, not UTF-8, not JSON
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                        "the next `ragcache eval` replaces it", usage=False) from None
    if not isinstance(results, dict) or not isinstance(results.get("modes"), dict):
        raise UserError(f"{path} holds no evaluation results (no \"modes\" object): the next `ragcache eval` "
                        "replaces it", usage=False)
    return results
