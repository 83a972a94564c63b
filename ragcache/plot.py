"""The Pareto plot of an evaluation: speedup vs full (log x) against fidelity, one point per mode."""
from __future__ import annotations

from pathlib import Path


def pareto(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 8), sharex=True)
    for i, (label, m) in enumerate(modes.items()):
        family = label.split("+")[0].split("@")[0]
        color = {"full": "black", "reuse": "tab:red", "prefix": "tab:gray", "cacheblend": "tab:blue",
                 "epic": "tab:green", "probe": "tab:purple", "a3": "tab:orange", "blendq": "tab:brown"}[family]
        face = "none" if "+" in label else color  # a variant (+layers, +ape): hollow, in its family's colour
        x = max(m["speedup_vs_full"], 1e-3)
        top.scatter(x, m["f1_vs_full"], edgecolors=color, facecolors=face)
        nudge = (4, 4 + 9 * (i % 3))  # modes at the same spot (full, prefix, cacheblend@1) stay readable
        top.annotate(label, (x, m["f1_vs_full"]), textcoords="offset points", xytext=nudge, fontsize=8)
        bottom.scatter(x, max(m["kl_tf"], 1e-4), color=color, marker="s", label="teacher-forced" if label == "full"
                       else None)
        bottom.scatter(x, max(m["kl_first"], 1e-4), color=color, marker="x", label="first token" if label == "full"
                       else None)
        bottom.annotate(label, (x, max(m["kl_tf"], 1e-4)), textcoords="offset points", xytext=nudge, fontsize=8)
    top.set_xscale("log")
    top.set_ylabel("answer F1 vs full prefill")
    top.set_ylim(-0.05, 1.05)
    top.grid(True, which="both", alpha=0.3)
    bottom.set_yscale("log")
    bottom.set_ylabel("KL(full ‖ mode), nats (floor 1e-4)")
    bottom.set_xlabel("TTFT speedup vs full prefill (log)")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{results['model']} on {Path(results['dataset']).name}: n={results['n']}, "
                 f"top-k {results['top_k']}, chunks {results['chunk_prefill']}, {results['tier']} tier", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
