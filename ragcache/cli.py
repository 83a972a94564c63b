"""The `ragcache` command. Each subcommand parses its flags here and calls the module that owns it."""
from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from blend.model import ModelError

from .errors import UserError


def _demo(args, settings) -> int:
    from .demo import run_demo

    return run_demo(settings, args)


def _bench(args, settings) -> int:
    from .bench import run_bench

    return run_bench(settings, args)


def _later(issue: str):
    def run(args, settings) -> int:
        raise UserError(f"'ragcache {args.command}' is not built yet: it arrives with {issue}")

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ragcache", description="RAG serving cache: precomputed chunk KV, blended.")
    p.add_argument("--model", help="bundled 'smollm2' (default) or a local HF checkpoint directory")
    p.add_argument("--device", help="auto | cpu | cuda")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser("demo", help="the main job on the bundled model and demo data")
    d.add_argument("--data", default="demo/data/musique_demo.json")
    d.add_argument("--out", default="demo/out")
    d.set_defaults(func=_demo)

    b = sub.add_parser("bench", help="benchmarks whose output goes into BENCHMARKS.md")
    b.add_argument("what", choices=["load", "prefill", "blend", "store"])
    b.add_argument("--tokens", type=int, default=2048, help="prefill: input length")
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--dataset", default="../shared/data/musique_dev.json", help="blend: MuSiQue-format file")
    b.add_argument("--question", type=int, default=0, help="blend: which question's passages")
    b.add_argument("--passages", type=lambda s: [int(x) for x in s.split(",")], default=[4, 10],
                   help="blend: passage counts, comma-separated")
    b.add_argument("--chunk-prefill", choices=["alone", "prefixed"], default="alone")
    b.set_defaults(func=_bench)

    for name, issue in [("ingest", "the precompute issue"), ("precompute", "the precompute issue"),
                        ("search", "the precompute issue"), ("ask", "the precompute issue"),
                        ("serve", "the REST API issue"), ("eval", "the evaluation issue"),
                        ("calibrate", "the evaluation issue")]:
        sub.add_parser(name, help=f"(arrives with {issue})").set_defaults(func=_later(issue))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .config import Settings

    try:
        overrides = {k: v for k in ("model", "device") if (v := getattr(args, k, None)) is not None}
        settings = Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        print(f"ragcache: error: setting {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
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
