"""What each `ragcache` subcommand does, given its parsed flags (cli.py parses them): each calls the module
that owns the work and prints its result."""
from __future__ import annotations

import sys

from .config import MAX_STOPS
from .errors import UserError


def demo(args, settings) -> int:
    from .demo import run_demo

    return run_demo(settings, args)


def bench(args, settings) -> int:
    from .bench import run_bench

    return run_bench(settings, args)


def ingest(args, settings) -> int:
    from .service import RagCache

    with RagCache(settings) as service:
        report = service.ingest(args.path, args.namespace)
        counts = service.counts(args.namespace)
    print(report.line())
    print("chunks by state: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for error in report.errors:
        print(f"ragcache: not ingested: {error}", file=sys.stderr)
    return 1 if report.errors else 0


def precompute(args, settings) -> int:
    from .jobs.launcher import exit_with_parent
    from .jobs.precompute import run_precompute

    if args.lifeline:
        exit_with_parent()
    summary = run_precompute(settings, workers=args.workers, namespace=args.namespace, progress=not args.quiet,
                             job_id=args.job, retry_failed=args.retry_failed)
    print(summary.line())
    return 0


def search(args, settings) -> int:
    from .service import RagCache

    with RagCache(settings) as service:
        hits = service.search(args.query, args.namespace, args.k, args.retrieval)
    for hit in hits:
        words = " ".join(hit.text.split()[:14])
        where = f" p.{hit.page}" if hit.page else ""
        print(f"{hit.id:>7}  {hit.score:.4f}  {hit.doc_id}{where}  {words}…")
    return 0


def ask(args, settings) -> int:
    import json

    from .service import RagCache
    from .serving.policy import fixed_policy

    if len(args.stop) > MAX_STOPS:
        raise UserError(f"--stop given {len(args.stop)} times: at most {MAX_STOPS} stop strings")
    mode = args.mode or settings.mode
    if mode not in ("auto", "adaptive"):  # a knob out of range named before the model loads, not after
        fixed_policy(mode, args.ratio, args.epic_k, settings)
    with RagCache(settings) as service:
        out = service.generate(args.question, args.namespace, args.k, args.mode, ratio=args.ratio, k=args.epic_k,
                               max_new_tokens=args.max_new_tokens, retrieval=args.retrieval, rerank=args.rerank,
                               target_kl=args.target_kl, stop=tuple(args.stop))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(out["answer"])
    t, u = out["timings_ms"], out["usage"]
    print(f"\nTTFT {t['ttft']:.0f} ms (retrieve {t['retrieve']:.0f}, load {t['load']:.0f}, blend {t['blend']:.0f}); "
          f"decode {t['decode']:.0f} ms; total {t['total']:.0f} ms")
    print(f"prompt {u['prompt_tokens']} tokens, recomputed {u['recomputed_tokens']}, "
          f"completion {u['completion_tokens']}; chunks from " + ", ".join(c["tier"] for c in out["chunks"]))
    for c in out["chunks"]:
        print(f"  [{c['doc_id']}" + (f" p.{c['page']}" if c["page"] else "") + (f" § {c['heading']}" if c["heading"]
                                                                                 else "") + "]")
    return 0


def eval_config(args, settings):
    from pathlib import Path

    from .evaluation.evaluate import EvalConfig

    given = {"modes": args.modes.split(",") if args.modes else None, "ratios": args.ratios, "epic_ks": args.epic_k,
             "probe_ratios": args.probe_ratios, "probe_layers": args.probe_layers, "coverages": args.coverages,
             "adaptive_layers": args.adaptive_layers, "deferred_ratios": args.deferred_ratios,
             "ape": [] if args.no_ape else args.ape or ([(settings.ape_temperature, settings.ape_factor)]  # the server's
                                                        if (settings.ape_temperature, settings.ape_factor) != (1, 1) else [])}
    return EvalConfig(Path(args.dataset), **{k: v for k, v in given.items() if v is not None},
                      probe_epic_k=args.probe_epic_k, a3_ratios=args.a3_ratios,
                      a3_window=args.a3_window, blendq_ratios=args.blendq_ratios,
                      top_k=args.top_k, retrieval=args.retrieval, rerank=args.rerank,
                      chunk_prefill=args.chunk_prefill or settings.chunk_prefill,
                      kv_dtype=args.kv_dtype, codec=settings.kv_codec, tier=args.tier, limit=args.limit,
                      max_new_tokens=args.max_new_tokens)


def evaluate(args, settings) -> int:
    from .evaluation.evaluate import evaluate as run_eval, table
    from .evaluation.results import latest_dir, output_dir, write_results
    from .service import RagCache

    out = output_dir(args.out)  # a bad --out fails now, not after the run
    with RagCache(settings) as service:
        results = run_eval(service, eval_config(args, settings), progress=not args.quiet)
    write_results(results, out)
    write_results(results, latest_dir(settings.home))
    print(f"{results['model']}, {results['dataset']}: n={results['n']}, top-k {results['top_k']} "
          f"({results['retrieval']}), chunks {_behind(results)}, {results['kv_dtype']} KV ({results['codec']}) in the "
          f"{results['tier']} tier; running sequences keep {results['kv_cache_dtype']} KV")
    print(table(results))
    print(f"wrote {args.out}/results.json, results.csv, pareto.png")
    return 0


def _behind(results: dict) -> str:
    lead = results.get("lead")
    return results["chunk_prefill"] + (f' (lead: "{" ".join(lead.split()[:8])} …", {len(lead.split())} words)'
                                       if lead else "")


def calibrate_config(args, settings):
    """A plain eval's modes but `deferred`, unless named: `auto` picks by time to first token, and deferred's is
    reuse's while its answer ends later than the mode it repairs with."""
    cfg = eval_config(args, settings)
    if not args.modes:
        cfg.modes = [m for m in cfg.modes if m != "deferred"]
    return cfg


def calibrate(args, settings) -> int:
    from .evaluation.calibrate import calibrate as choose
    from .service import RagCache

    with RagCache(settings) as service:
        choice = choose(service, calibrate_config(args, settings), args.target_kl, progress=not args.quiet)
    print(choice.line())
    return 0


def calibrate_codec(args, settings) -> int:
    from .evaluation.codec_calibrate import command
    from .service import RagCache

    with RagCache(settings) as service:
        return command(service, args)
