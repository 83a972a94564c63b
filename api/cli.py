"""The `ragcache` command: every subcommand of `ragcache.cli`, plus `serve` (uvicorn on this app).

The program's entry point lives in the top layer because `serve` needs the API and arrows only
point down: ragcache's own commands never import api.
"""
from __future__ import annotations

import argparse
import ipaddress
import sys

from ragcache import cli
from ragcache.errors import UserError


def _serve(args, settings) -> int:
    if not settings.auth and not _loopback(args.host) and not args.insecure:  # before the model loads
        raise UserError(f"no API keys (RAGCACHE_API_KEYS, RAGCACHE_ADMIN_KEY) and --host {args.host} is not "
                        "loopback: set keys, bind 127.0.0.1, or pass --insecure to serve every namespace to anyone")
    import logging

    import uvicorn

    from .app import create_app

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ragcache").setLevel(logging.INFO)
    if not settings.auth:
        print(f"ragcache serve: no API keys configured (RAGCACHE_API_KEYS, RAGCACHE_ADMIN_KEY): anyone who can "
              f"reach {args.host}:{args.port} can use every namespace", file=sys.stderr, flush=True)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5,
                limit_concurrency=2 * settings.max_connections + 16)  # idle connections too: a backstop
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be in 1..65535")
    return value


def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="the REST API, OpenAI-compatible chat and the dashboard (uvicorn)")
    sv.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1: loopback only")
    sv.add_argument("--port", type=_port, default=8000)
    sv.add_argument("--insecure", action="store_true",
                    help="serve without API keys on a non-loopback address (anyone who reaches it uses everything)")
    sv.set_defaults(func=_serve)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, extend=_add_serve)


if __name__ == "__main__":
    sys.exit(main())
