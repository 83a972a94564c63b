"""`ragcache demo`: the main job on the bundled model and the demo corpus.

ingest → precompute (resumable: a second run skips what is done) → answer three questions in
full, cacheblend, epic and the default mode (probe, with APE) through the service → a small evaluation of the
same modes, with and without APE, and its Pareto plot.
"""
from __future__ import annotations

import time
from pathlib import Path

from .config import Settings
from .errors import UserError
from .evaluation.evaluate import EvalConfig, evaluate, load_dataset, table
from .evaluation.results import latest_dir, output_dir, write_results
from .jobs.precompute import run_precompute
from .service import RagCache

NAMESPACE = "demo"
MODES = ("full", "cacheblend", "epic", None)  # None: the server's default mode


def run_demo(settings: Settings, args) -> int:
    data = Path(args.data)
    if not data.is_file():
        raise UserError(f"demo data {data} not found: run from the repository root or pass --data")
    questions = load_dataset(data, 3)
    out = output_dir(args.out)
    t_start = time.perf_counter()
    with RagCache(settings) as service:
        _run(service, settings, data, questions, out)
    print(f"\ndone in {time.perf_counter() - t_start:.0f} s; results in {out}/ (results.json, results.csv, pareto.png)")
    print("\nserve it: .venv/bin/ragcache serve --port 8000, then open http://127.0.0.1:8000/ "
          f"(the dashboard; ask in namespace {NAMESPACE!r})")
    return 0


def _run(service: RagCache, settings: Settings, data: Path, questions: list[dict], out: Path) -> None:
    _step(f"model: {settings.model} → loading")
    service.warm(NAMESPACE)
    m = service.model
    print(f"  {m.name}, {m.config.num_hidden_layers} layers, {m.dtype} on {m.device}")
    _step(f"ingest {data}")
    print("  " + service.ingest(data, NAMESPACE).line())
    _step("precompute chunk KVs (prefill once, store, embed, index)")
    print("  " + run_precompute(settings, namespace=NAMESPACE, service=service).line())

    _step("answer three questions; chunk KVs come from the store, the rest is recomputed per mode")
    rows = []
    for q in questions:
        full_ttft = None
        for mode in MODES:
            r = service.generate(q["question"], NAMESPACE, top_k=4, mode=mode)
            ttft = r["timings_ms"]["ttft"]
            full_ttft = full_ttft or ttft
            u = r["usage"]
            served = (mode or f"{settings.mode} (default)") + ("+ape" if mode != "full" and settings.ape_factor != 1 else "")
            rows.append([q["question"], served, ttft, full_ttft / ttft, u["recomputed_tokens"] / u["prompt_tokens"],
                         r["answer"], q["answers"][0], {c["tier"] for c in r["chunks"]}])
    print("| question | mode | TTFT ms | speedup vs full | recomputed | answer | gold | KV from |")
    print("|---|---|---|---|---|---|---|---|")
    for question, mode, ttft, speedup, frac, answer, gold, tiers in rows:
        short = answer if len(answer) <= 60 else answer[:57] + "..."
        print(f"| {question[:40]} | {mode} | {ttft:.0f} | {speedup:.1f}× | {frac:.0%} | {short} | {gold} | "
              f"{','.join(sorted(tiers))} |")

    _step(f"evaluate fidelity vs latency on these questions → {out}/pareto.png")
    cfg = EvalConfig(data, modes=["full", "reuse", "cacheblend", "epic", "probe"], probe_ratios=[settings.probe_ratio],
                     probe_layers=[settings.probe_layers], top_k=4, limit=len(questions), max_new_tokens=16,
                     chunk_prefill=settings.chunk_prefill)  # chunk KV as this deployment computes it
    results = evaluate(service, cfg)
    write_results(results, out)
    write_results(results, latest_dir(settings.home))
    print(table(results))


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)
