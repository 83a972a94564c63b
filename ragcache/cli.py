"""The `ragcache` command line: its flags, parsed here; what each subcommand then does is in commands.py."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from . import commands
from .config import CHOICES, EVAL_MODES, KV_CODEC, KV_CODEC_FORM, MAX_STOPS, MODES, STOP_CHARS
from .errors import UserError


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _pair(text: str) -> tuple[float, float]:
    values = _floats(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected T,S (two numbers), got {text!r}")
    return values[0], values[1]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


STORE_PARTS = ("throughput", "codecs", "fidelity", "ttft", "trace", "zipf")  # `bench store`'s, in bench/store.py


def _parts(text: str) -> list[str]:
    parts = [x for x in text.split(",") if x]
    unknown = set(parts) - set(STORE_PARTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(sorted(unknown))}: use {', '.join(STORE_PARTS)}")
    return parts


def _codecs(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if not KV_CODEC.fullmatch(x)]
    if "raw" in names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError("name each codec once; raw is always measured beside them")
    if bad:
        raise argparse.ArgumentTypeError(f"unknown codec(s) {', '.join(bad)}: each {KV_CODEC_FORM}")
    return names


def _add_eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="a MuSiQue/CacheBlend-format JSON file")
    # each None: a plain `ragcache eval`'s (EvalConfig): the measured frontier and the baselines it is held against
    p.add_argument("--modes", default=None, help=f"any of {','.join(EVAL_MODES)}")
    p.add_argument("--ratios", type=_floats, default=None, help="cacheblend ratios")
    p.add_argument("--epic-k", type=_ints, default=None, help="epic: tokens per chunk")
    p.add_argument("--probe-ratios", type=_floats, default=None, help="probe (query-probe selection) ratios")
    p.add_argument("--probe-epic-k", type=int, default=0, help="probe: EPIC's first k per chunk inside its budget")
    p.add_argument("--probe-layers", type=_ints, default=None,
                   help="probe: layers the question runs through to score the context (0: all); several → each")
    p.add_argument("--coverages", type=_floats, default=None,
                   help="adaptive: share of the question's attention whose stale rows are recomputed")
    p.add_argument("--deferred-ratios", type=_floats, default=None,
                   help="deferred: the probe ratios of the repair made after reuse's first token")
    p.add_argument("--adaptive-layers", type=int, default=None, help="adaptive: layers its probe runs through (0: all)")
    p.add_argument("--ape", type=_pair, action="append", metavar="T,S",
                   help="every mode that reads chunk KV again, with APE re-weighting (temperature T, factor S); "
                        "repeatable; default: the server's (1,0.5)")
    p.add_argument("--no-ape", action="store_true", help="no APE variants")
    p.add_argument("--a3-ratios", type=_floats, default=[0.15], help="a3 (question attention at the check layer)")
    p.add_argument("--a3-window", type=int, default=2, help="a3, blendq: ± neighbours the attention is smoothed over")
    p.add_argument("--blendq-ratios", type=_floats, default=[0.12], help="blendq (deviation and attention ranks)")
    p.add_argument("--top-k", type=_positive, default=4)
    p.add_argument("--retrieval", choices=["given", *CHOICES["retrieval"]], default="given",
                   help="given: each question's own passages; else retrieve over all the file's passages")
    p.add_argument("--rerank", type=int, default=0,
                   help="with --retrieval: rerank this many candidates on their chunk KV (by RAGCACHE_RERANKER)")
    p.add_argument("--chunk-prefill", choices=CHOICES["chunk_prefill"], default=None,
                   help="default: the RAGCACHE_CHUNK_PREFILL setting (lead)")
    p.add_argument("--kv-dtype", choices=CHOICES["kv_dtype"], default="auto")
    p.add_argument("--tier", choices=["cpu", "disk"], default="cpu")
    p.add_argument("--limit", type=_positive, default=None, help="first N questions")
    p.add_argument("--max-new-tokens", type=_positive, default=24)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _counts(text: str) -> list[int]:
    values = _ints(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _span(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not 2 <= int(parts[0]) <= int(parts[1]) <= 8:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 2 <= LO <= HI <= 8, got {text!r}")
    return int(parts[0]), int(parts[1])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _stop(text: str) -> str:
    if not 1 <= len(text) <= STOP_CHARS:
        raise argparse.ArgumentTypeError(f"must be 1 to {STOP_CHARS} characters")
    return text


def build_parser(extend=None) -> argparse.ArgumentParser:
    """The command line; `extend(subparsers)` adds commands from the layer above (api's `serve`)."""
    p = argparse.ArgumentParser(prog="ragcache", description="RAG serving cache: precomputed chunk KV, blended.")
    p.add_argument("--model", help="bundled 'smollm2' (default) or a local HF checkpoint directory")
    p.add_argument("--device", help="auto | cpu | cuda")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser("demo", help="the main job on the bundled model and demo data")
    d.add_argument("--data", default="demo/data/musique_demo.json")
    d.add_argument("--out", default="demo/out")
    d.set_defaults(func=commands.demo)

    b = sub.add_parser("bench", help="benchmarks whose output goes into BENCHMARKS.md")
    b.add_argument("what", choices=["load", "prefill", "blend", "store", "precompute", "retrieval", "coverage",
                                    "http", "serve", "decode", "tenants"])
    b.add_argument("--tokens", type=_positive, default=2048, help="prefill: input length")
    b.add_argument("--repeats", type=_positive, default=5)
    b.add_argument("--dataset", default="demo/data/musique_dev.json",
                   help="blend, precompute, coverage: MuSiQue-format file")
    b.add_argument("--question", type=int, default=0, help="blend: which question's passages")
    b.add_argument("--passages", type=_counts, default=None,
                   help="blend, store: passage counts (4,10); coverage: top-k values (1,2,4,8,10)")
    b.add_argument("--chunk-prefill", choices=("alone", "prefixed", "lead"), default=None,
                   help="what chunk KV is computed behind: blend (alone, prefixed; default alone), store's fidelity "
                        "(any; default prefixed, issue 24's measure; lead: picked from the questions past --limit)")
    b.add_argument("--window", type=int, default=0,
                   help="coverage: index passages cut into pieces of at most this many embedder tokens (0: whole)")
    b.add_argument("--questions", default=None, help="coverage: A-B, the questions measured (default: all)")
    b.add_argument("--rerank", type=int, default=20, help="coverage: hybrid candidates the reranker orders (0: none)")
    b.add_argument("--json", action="store_true", help="coverage: print the results as JSON")
    b.add_argument("--chunks", type=_positive, default=None, help="precompute: chunks (40); retrieval: index size (10000)")
    b.add_argument("--seconds", type=_positive, default=60, help="http: how long the load runs; tenants --hostile: "
                   "how long B runs under the flood")
    b.add_argument("--hostile", action="store_true", help="tenants: A also pins, sends bad bodies, stalls uploads")
    b.add_argument("--ingest", type=int, default=0, help="tenants: A ingests this many documents while B runs")
    b.add_argument("--clients", type=_counts, default=[1, 4, 8, 16],
                   help="serve: concurrent clients, comma-separated; tenants: the flooder's (the largest)")
    b.add_argument("--rounds", type=_positive, default=2, help="serve: requests per client; tenants: B's requests")
    b.add_argument("--new-tokens", type=_positive, default=64, help="serve: tokens decoded per request; decode: "
                   "greedy answer length")
    b.add_argument("--parts", type=_parts, default=list(STORE_PARTS),
                   help=f"store: which parts, comma-separated ({','.join(STORE_PARTS)})")
    b.add_argument("--codecs", type=_codecs, default=["compact"],
                   help=f"store: compact codecs to measure beside raw, comma-separated (each {KV_CODEC_FORM})")
    b.add_argument("--limit", type=_positive, default=20, help="store: dev questions in the fidelity part; decode: "
                   "dev questions whose greedy answers compare")
    b.add_argument("--trace", type=_floats, default=[0.8, 1.0, 1.2], help="store: Zipf exponents of the traces")
    b.add_argument("--llama-bench", default=None, help="decode: llama.cpp's llama-bench (default: the one on PATH)")
    b.set_defaults(func=commands.bench)

    i = sub.add_parser("ingest", help="add documents: PDF, DOCX, HTML, Markdown, text, .jsonl or MuSiQue .json "
                                      "files, or a folder of them")
    i.add_argument("path")
    i.add_argument("--namespace", default="default")
    i.set_defaults(func=commands.ingest)

    pc = sub.add_parser("precompute", help="prefill, store, embed and index every pending chunk (resumable)")
    pc.add_argument("--workers", type=_positive, default=1)
    pc.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    pc.add_argument("--quiet", action="store_true", help="no progress bar")
    pc.add_argument("--job", type=_positive, default=None, help="work on this job row (made by `serve`)")
    pc.add_argument("--lifeline", action="store_true", help="exit when stdin closes (`serve` starts its jobs so: "
                                                           "they end with the server)")
    pc.add_argument("--retry-failed", action="store_true", help="give failed chunks a fresh set of attempts")
    pc.set_defaults(func=commands.precompute)

    se = sub.add_parser("search", help="the top-k chunks for a query")
    se.add_argument("query")
    se.add_argument("-k", type=_positive, default=None)
    se.add_argument("--namespace", default="default")
    se.add_argument("--retrieval", choices=CHOICES["retrieval"], default=None, help="default: RAGCACHE_RETRIEVAL")
    se.set_defaults(func=commands.search)

    a = sub.add_parser("ask", help="retrieve, blend, answer")
    a.add_argument("question")
    a.add_argument("-k", type=_positive, default=None, help="chunks to retrieve")
    a.add_argument("--mode", choices=MODES, default=None)
    a.add_argument("--ratio", type=float, default=None,
                   help="cacheblend, probe, a3, blendq: share of context rows recomputed")
    a.add_argument("--epic-k", type=int, default=None, help="epic: tokens recomputed at each chunk's start")
    a.add_argument("--target-kl", type=float, default=None,
                   help="auto, adaptive: the calibrated point within this KL of full prefill (`ragcache calibrate`)")
    a.add_argument("--max-new-tokens", type=_positive, default=None)
    a.add_argument("--stop", action="append", type=_stop, default=[],
                   help=f"end the answer before this string (repeatable, up to {MAX_STOPS})")
    a.add_argument("--namespace", default="default")
    a.add_argument("--json", action="store_true", help="print the whole result as JSON")
    a.add_argument("--retrieval", choices=CHOICES["retrieval"], default=None, help="default: RAGCACHE_RETRIEVAL")
    a.add_argument("--rerank", type=int, default=None,
                   help="rerank this many candidates on their cached KV (RAGCACHE_RERANK, by RAGCACHE_RERANKER)")
    a.set_defaults(func=commands.ask)

    ev = sub.add_parser("eval", help="quality vs latency of every mode against full prefill")
    _add_eval_flags(ev)
    ev.add_argument("--out", default="eval-out", help="folder for results.json, results.csv, pareto.png")
    ev.set_defaults(func=commands.evaluate)

    cal = sub.add_parser("calibrate", help="pick the fastest mode within a KL target; `mode: auto` uses it")
    _add_eval_flags(cal)
    cal.add_argument("--target-kl", type=float, required=True, help="mean teacher-forced KL(full ‖ mode), nats")
    cal.set_defaults(func=commands.calibrate)

    cc = sub.add_parser("calibrate-codec", help="measure which layers' K and V the compact KV codec gives one more bit")
    cc.add_argument("--dataset", required=True, type=Path, help="a MuSiQue/CacheBlend-format JSON file (dev questions)")
    cc.add_argument("--first", type=int, default=40, help="first question (keep them apart from what you report)")
    cc.add_argument("--count", type=_positive, default=5)
    cc.add_argument("--top-k", type=_counts, default=[4], help="passages per question; several (4,10) add up")
    cc.add_argument("--k-bits", type=int, choices=[2, 3, 4], default=3)
    cc.add_argument("--v-bits", type=int, choices=[2, 3, 4], default=3)
    cc.add_argument("--max-bits", type=float, default=3.2, help="mean bits per element, everything counted")
    cc.add_argument("--check-bits", type=int, choices=[0, *range(2, 9)], default=8,
                    help="bits for V of cacheblend's check layer, whose deviation picks the rows it recomputes (0: "
                         "like any other layer)")
    cc.add_argument("--widths", type=_span, default=(2, 6), help="LO:HI, the widths a tensor may take (2..8)")
    cc.add_argument("--quiet", action="store_true")
    cc.set_defaults(func=commands.calibrate_codec)

    if extend is not None:
        extend(sub)
    return p


def main(argv: list[str] | None = None, extend=None) -> int:
    args = build_parser(extend).parse_args(argv)
    from blend.model import ModelError  # imports torch: not for --help

    from .config import Settings

    try:
        overrides = {k: v for k in ("model", "device") if (v := getattr(args, k, None)) is not None}
        settings = Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        print(f"ragcache: error: setting {'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}",
              file=sys.stderr)
        return 2
    from blend.cores import claim_cores

    claim_cores(settings.threads)  # a share of the cores (a job the server started), or every core
    try:
        return args.func(args, settings)
    except UserError as e:
        print(f"ragcache: error: {e}", file=sys.stderr)
        return 2 if e.usage else 1
    except ModelError as e:
        print(f"ragcache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
