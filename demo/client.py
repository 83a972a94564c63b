"""A client of a running `ragcache serve`, through its two public doors, with nothing of ragcache imported:

    .venv/bin/ragcache serve --port 8000 &
    .venv/bin/python demo/client.py "who founded it?" --url http://127.0.0.1:8000 --namespace demo

1. POST /v1/rag/generate with `stream: true`: the answer's text as it decodes (server-sent events), then the
   chunks it was given and where their KV came from, and the stage timings;
2. POST /v1/chat/completions: the same question as an OpenAI-compatible chat, options under `rag`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import httpx


def stream_generate(client: httpx.Client, query: str, namespace: str, mode: str, max_tokens: int) -> dict:
    """Print the answer's deltas as they arrive; the `done` event's whole response."""
    body = {"query": query, "namespace": namespace, "mode": mode, "max_tokens": max_tokens, "stream": True}
    with client.stream("POST", "/v1/rag/generate", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"generate: HTTP {r.status_code}: {r.text}")
        event, data = None, []
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").strip())
            elif not line and data:
                payload = json.loads("\n".join(data))
                if event == "token":
                    print(payload["text"], end="", flush=True)
                elif event == "done":
                    print()
                    return payload
                elif event == "error":
                    raise SystemExit(f"generate: {payload['error']}")
                event, data = None, []
    raise SystemExit("generate: the stream ended without a done event")


def chat(client: httpx.Client, query: str, namespace: str, mode: str, max_tokens: int) -> dict:
    model = client.get("/v1/models").json()["data"][0]["id"]  # the one model this server serves
    body = {"model": model, "messages": [{"role": "user", "content": query}], "max_tokens": max_tokens,
            "rag": {"namespace": namespace, "mode": mode}}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"chat: HTTP {r.status_code}: {r.text}")
    return r.json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("query")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--namespace", default="demo")
    p.add_argument("--mode", default="cacheblend")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--key", default=os.environ.get("RAGCACHE_KEY"), help="a bearer key, when the server has keys")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=300) as client:
        print(f"== POST /v1/rag/generate (streamed, mode {args.mode})")
        r = stream_generate(client, args.query, args.namespace, args.mode, args.max_tokens)
        for c in r["chunks"]:
            print(f"  chunk {c['id']} of {c['doc_id']!r}, score {c['score']}, KV from {c['tier']}")
        u, t = r["usage"], r["timings_ms"]
        print(f"  {u['reused_tokens']} prompt tokens reused, {u['recomputed_tokens']} recomputed; "
              f"TTFT {t['ttft']:.0f} ms, total {t['total']:.0f} ms")
        print("== POST /v1/chat/completions")
        c = chat(client, args.query, args.namespace, args.mode, args.max_tokens)
        print(c["choices"][0]["message"]["content"])
        print(f"  chunks: {[x['id'] for x in c['rag']['chunks']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
