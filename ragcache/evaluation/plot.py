"""The Pareto plot of an evaluation: speedup vs full (log x) against fidelity, one point per mode.

Variants (`+layers@…`, `+ape@…`) are hollow, in their family's colour. The lower panel draws the
teacher-forced frontier (no other mode is both faster and closer to full prefill) and names the
modes on it and the plain ones; full prefill (KL 0) is the reference, not a point there.
"""
from __future__ import annotations

from pathlib import Path

COLORS = {"full": "black", "reuse": "tab:red", "prefix": "tab:gray", "cacheblend": "tab:blue", "epic": "tab:green",
          "probe": "tab:purple", "adaptive": "tab:pink", "a3": "tab:orange", "blendq": "tab:brown",
          "deferred": "tab:olive"}


def frontier(modes: dict) -> list[str]:
    """Labels no other mode beats on both speedup and teacher-forced KL, fastest first."""
    points = sorted(modes.items(), key=lambda lm: (-lm[1]["speedup_vs_full"], lm[1]["kl_tf"]))
    out, best = [], float("inf")
    for label, m in points:
        if m["kl_tf"] < best:
            out.append(label)
            best = m["kl_tf"]
    return out


def pareto(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    front = [label for label in frontier(modes) if label != "full"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9), sharex=True)
    for i, (label, m) in enumerate(modes.items()):
        color = COLORS[label.split("+")[0].split("@")[0]]
        face = "none" if "+" in label else color
        x = max(m["speedup_vs_full"], 1e-3)
        nudge = (4, 4 + 9 * (i % 3))  # modes at the same spot stay readable
        top.scatter(x, m["f1_vs_full"], edgecolors=color, facecolors=face)
        if label == "full":
            continue
        bottom.scatter(x, max(m["kl_tf"], 1e-4), edgecolors=color, facecolors=face, marker="s",
                       label="teacher-forced (hollow: a +variant)" if i == 1 else None)
        bottom.scatter(x, max(m["kl_first"], 1e-4), color=color, marker="x", alpha=0.5,
                       label="first token" if i == 1 else None)
        if "+" not in label:
            top.annotate(label, (x, m["f1_vs_full"]), textcoords="offset points", xytext=nudge, fontsize=7)
        if "+" not in label or label in front:
            bottom.annotate(label, (x, max(m["kl_tf"], 1e-4)), textcoords="offset points", xytext=nudge, fontsize=7)
    if front:
        bottom.plot([modes[label]["speedup_vs_full"] for label in front],
                    [max(modes[label]["kl_tf"], 1e-4) for label in front], color="gray", linewidth=0.8,
                    linestyle="--", label="teacher-forced frontier")
    top.set_xscale("log")
    top.set_ylabel("answer F1 vs full prefill")
    top.set_ylim(-0.05, 1.05)
    top.grid(True, which="both", alpha=0.3)
    bottom.set_yscale("log")
    bottom.set_ylabel("KL(full ‖ mode), nats")
    bottom.set_xlabel("TTFT speedup vs full prefill (log)")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{results['model']} on {Path(results['dataset']).name}: n={results['n']}, "
                 f"top-k {results['top_k']}, chunks {results['chunk_prefill']}, {results['tier']} tier", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
