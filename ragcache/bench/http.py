"""`ragcache bench http`: the REST API measured from a client, against a real `ragcache serve`.

1. HTTP overhead: TTFT seen by a streaming client (request sent → first token event) against the
   server's own `timings_ms.ttft`, 4 passages, per mode; medians of interleaved repeats.
2. Load: 16 concurrent clients for 60 s (asyncio + httpx), modes mixed: statuses, p50/p99
   latency, requests/s, the server's peak RSS.
3. Cores shared with a precompute job started through the API: a request's TTFT and per-token
   decode time while the job runs, with the default split (server takes what the job leaves)
   and with both processes on every core (RAGCACHE_THREADS = RAGCACHE_JOB_THREADS = cores).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ..errors import UserError
from .timing import median, table

MODES = ("reuse", "epic", "cacheblend")


def run(settings, args) -> int:
    data = _questions(Path(args.dataset))
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-http-") as tmp:
        home = Path(tmp) / "home"
        env = _env(settings, home)
        corpus = [c for q in data[:6] for c in q["ctxs"]]  # 60 passages, 4 retrieved a question
        _cli(env, "ingest", _jsonl(Path(tmp) / "corpus.jsonl", corpus, "c"), "--namespace", "bench")
        _cli(env, "precompute", "--quiet")
        for name, qs in (("job-split", data[6:9]), ("job-oversubscribed", data[9:12])):
            _cli(env, "ingest", _jsonl(Path(tmp) / f"{name}.jsonl", [c for q in qs for c in q["ctxs"]], name),
                 "--namespace", name)
        questions = [q["question"] for q in data[:6]]
        cores = os.cpu_count() or 1
        with _Server(env, Path(tmp)) as srv:
            print(f"model {settings.model}, {cores} cores; corpus: 60 MuSiQue passages, top-k 4, "
                  f"{args.repeats} repeats per mode")
            print(_overhead(srv, questions, args.repeats))
            print(_load(srv, questions, clients=16, seconds=args.seconds))
            split = _during_job(srv, questions, "job-split")
        with _Server({**env, "RAGCACHE_THREADS": str(cores), "RAGCACHE_JOB_THREADS": str(cores)},
                     Path(tmp)) as srv:
            over = _during_job(srv, questions, "job-oversubscribed")
        print(f"\nA request while a precompute job started through the API runs (cacheblend, 16 tokens; "
              f"medians over {split['n']} / {over['n']} requests during the job, 5 before it)")
        rows = [[label, r["idle_ttft"], r["job_ttft"], r["job_ttft"] / r["idle_ttft"], r["idle_tok"], r["job_tok"],
                 r["job_tok"] / r["idle_tok"]] for label, r in (("split (default)", split),
                                                              ("both on every core", over))]
        print(table(rows, ["threads", "TTFT idle ms", "TTFT during job ms", "ratio", "ms/token idle",
                           "ms/token during job", "ratio"]))
    return 0


def _questions(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as a MuSiQue-format JSON file: {e}") from None
    if len(data) < 12:
        raise UserError(f"{path}: need at least 12 questions")
    return data


def _jsonl(path: Path, ctxs: list[dict], prefix: str) -> str:
    path.write_text("".join(json.dumps({"id": f"{prefix}-{i}", "title": c["title"], "text": c["text"]}) + "\n"
                            for i, c in enumerate(ctxs)))
    return str(path)


def _env(settings, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(RAGCACHE_HOME=str(home), RAGCACHE_MODEL=settings.model, RAGCACHE_MAX_QUEUE="64",
               RAGCACHE_APE_FACTOR="1",  # the modes the benches name, bare: as measured before APE was on by default
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _cli(env: dict, *args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "ragcache.cli", *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise UserError(f"ragcache {args[0]} failed: {r.stderr.strip().splitlines()[-1:]}")


class _Server:
    """`ragcache serve` on a free loopback port, ready when entered, stopped when left."""

    def __init__(self, env: dict, tmp: Path):
        self.env, self.tmp = env, tmp

    def __enter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.tmp / f"serve-{port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)],  # this checkout's
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise UserError(f"the server did not start; see {self.log.name}")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _stream(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """(client TTFT s, the done event's data) of one streamed request."""
    t0, first = time.perf_counter(), None
    with client.stream("POST", "/v1/rag/generate", json={**body, "stream": True}) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                if event == "token" and first is None:
                    first = time.perf_counter() - t0
            elif line.startswith("data:") and event == "done":
                done = json.loads(line[5:])
                return (first if first is not None else time.perf_counter() - t0), done
    raise UserError(f"no done event (status {r.status_code})")


def _overhead(srv: _Server, questions: list[str], repeats: int) -> str:
    rows = []
    with httpx.Client(base_url=srv.url, timeout=300) as c:
        for q in questions[:2]:  # warm every path
            for mode in MODES:
                _stream(c, {"query": q, "namespace": "bench", "mode": mode, "max_tokens": 4})
        seen = {m: ([], []) for m in MODES}
        for r in range(repeats):
            for mode in MODES:
                client_s, done = _stream(c, {"query": questions[r % len(questions)], "namespace": "bench",
                                             "mode": mode, "top_k": 4, "max_tokens": 4})
                seen[mode][0].append(client_s * 1000)
                seen[mode][1].append(done["timings_ms"]["ttft"])
    for mode, (client_ms, inside_ms) in seen.items():
        c_ms, i_ms = median(client_ms), median(inside_ms)
        rows.append([mode, c_ms, i_ms, c_ms - i_ms, (c_ms - i_ms) / i_ms])
    return "\nHTTP overhead (streamed; client TTFT = request sent → first token event)\n" + table(
        rows, ["mode", "client TTFT ms", "server ttft ms", "overhead ms", "overhead / TTFT"])


def _load(srv: _Server, questions: list[str], clients: int, seconds: float) -> str:
    async def main():
        statuses: dict[int, int] = {}
        latencies: list[float] = []
        stop = time.perf_counter() + seconds

        async def one_client(i: int):
            async with httpx.AsyncClient(base_url=srv.url, timeout=600) as c:
                n = 0
                while time.perf_counter() < stop:
                    body = {"query": questions[(i + n) % len(questions)], "namespace": "bench",
                            "mode": MODES[(i + n) % len(MODES)], "top_k": 4, "max_tokens": 16}
                    t0 = time.perf_counter()
                    r = await c.post("/v1/rag/generate", json=body)
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code == 200:
                        latencies.append(time.perf_counter() - t0)
                    elif r.status_code == 429:
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    n += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(i) for i in range(clients)))
        return statuses, latencies, time.perf_counter() - t0

    statuses, lat, wall = asyncio.run(main())
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    rows = [[clients, seconds, wall, sum(statuses.values()), statuses.get(200, 0), statuses.get(429, 0),
             sum(v for k, v in statuses.items() if k >= 500), len(lat) / wall, p(0.5), p(0.99), srv.peak_rss_mb()]]
    return (f"\nLoad: {clients} clients, non-streamed, modes {'/'.join(MODES)} in turn, 16 tokens each\n" +
            table(rows, ["clients", "target s", "wall s", "requests", "200", "429", "5xx", "req/s", "p50 s",
                         "p99 s", "peak RSS MB"]))


def _during_job(srv: _Server, questions: list[str], namespace: str) -> dict:
    def measure(c) -> tuple[float, float]:
        out = c.post("/v1/rag/generate", json={"query": questions[0], "namespace": "bench", "mode": "cacheblend",
                                               "top_k": 4, "max_tokens": 16, "ignore_eos": True}).json()
        t = out["timings_ms"]
        return t["ttft"], t["decode"] / max(1, out["usage"]["completion_tokens"] - 1)

    with httpx.Client(base_url=srv.url, timeout=600) as c:
        measure(c)
        idle = [measure(c) for _ in range(5)]
        job = c.post("/v1/jobs/precompute", json={"namespace": namespace}).json()
        time.sleep(8)  # the child loads the model before it competes for the cores
        during = []
        while c.get(f"/v1/jobs/{job['id']}").json()["state"] == "running":
            during.append(measure(c))
        if not during:
            raise UserError("the job ended before any request ran beside it")
    return {"n": len(during), "idle_ttft": median([t for t, _ in idle]), "job_ttft": median([t for t, _ in during]),
            "idle_tok": median([d for _, d in idle]), "job_tok": median([d for _, d in during])}
