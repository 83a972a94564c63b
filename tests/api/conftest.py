"""Real servers: `ragcache serve` in a subprocess on a free port, the real model, a small corpus
precomputed once per session (copied per server, so each server owns its home)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

DEMO = Path(__file__).parents[2] / "demo" / "data" / "musique_demo.json"
NAMESPACE = "musique"


@dataclass
class Server:
    url: str
    home: Path
    proc: subprocess.Popen
    env: dict
    namespace: str = NAMESPACE
    question: str = ""
    answers: list = field(default_factory=list)
    admin_key: str | None = None
    tenant_keys: dict = field(default_factory=dict)

    def client(self, key: str | None = None, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metric(self, name: str, **labels) -> float:
        """The sum of /metrics samples named `name` whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's precompute children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path, smollm, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update({"RAGCACHE_HOME": str(home), "RAGCACHE_MODEL": str(smollm.path), "RAGCACHE_CHUNK_TOKENS": "1024",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_server(home: Path, smollm, **extra) -> Server:
    port = free_port()
    env = server_env(home, smollm, **extra)
    log = open(home.parent / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log.name).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                data = json.loads(DEMO.read_text())[0]
                return Server(url, home, proc, env, question=data["question"], answers=data["answers"])
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready in time: {Path(log.name).read_text()[-3000:]}")


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def demo_docs(question: int, n: int, prefix: str) -> list[dict]:
    ctxs = json.loads(DEMO.read_text())[question]["ctxs"][:n]
    return [{"id": f"{prefix}{i}", "title": c["title"], "text": c["text"]} for i, c in enumerate(ctxs)]


def short_docs(question: int, n: int, prefix: str, words: int = 60) -> list[dict]:
    """demo_docs cut to their first `words` words (about 100 tokens): quick to prefill (a lead picked from them is
    as short), small blobs. For tests where what the passages say does not matter."""
    return [{**d, "text": " ".join(d["text"].split()[:words])} for d in demo_docs(question, n, prefix)]


def precompute_home(home: Path, smollm, files: dict[str, Path]) -> None:
    """namespace → documents file, ingested and precomputed into `home` in this process (one model load, no
    CLI start: the CLI's own ingest and precompute are tested in tests/ragcache)."""
    from ragcache.config import Settings
    from ragcache.jobs.precompute import run_precompute
    from ragcache.service import RagCache

    env = server_env(home, smollm)
    settings = Settings(**{k.removeprefix("RAGCACHE_").lower(): v for k, v in env.items() if k.startswith("RAGCACHE_")})
    with RagCache(settings) as service:
        for namespace, path in files.items():
            service.ingest(path, namespace)
        summary = run_precompute(settings, progress=False, service=service)
    assert not summary.failed, summary


@pytest.fixture(scope="session")
def corpus_home(tmp_path_factory, smollm) -> Path:
    """A home whose namespace `musique` holds 6 passages of question 0, precomputed."""
    home = tmp_path_factory.mktemp("corpus") / "home"
    precompute_home(home, smollm, {NAMESPACE: write_jsonl(home.parent / "docs.jsonl", demo_docs(0, 6, "q0-"))})
    return home


def copy_home(corpus_home: Path, tmp: Path) -> Path:
    home = tmp / "home"
    shutil.copytree(corpus_home, home)
    return home


@pytest.fixture(scope="session")
def api_server(corpus_home, tmp_path_factory, smollm):
    """One server for the session, no keys. Tests that change its corpus use namespaces of their own."""
    server = start_server(copy_home(corpus_home, tmp_path_factory.mktemp("api")), smollm,
                          RAGCACHE_MAX_TOKENS_CAP=6000)  # room to ask for more than the context holds
    yield server
    server.stop()


ADMIN = "admin-key-0123456789"
TENANTS = {"tenant-a-key-0123": ["tenant-a"], "tenant-b-key-0123": ["tenant-b"]}


@pytest.fixture(scope="session")
def api_server_with_keys(corpus_home, tmp_path_factory, smollm):
    """Keys on: the admin key, and two tenants whose namespaces hold different documents."""
    home = copy_home(corpus_home, tmp_path_factory.mktemp("keys"))
    precompute_home(home, smollm, {ns: write_jsonl(home.parent / f"{ns}.jsonl", short_docs(question, 3, f"{ns}-"))
                                   for ns, question in (("tenant-a", 1), ("tenant-b", 2))})
    server = start_server(home, smollm, RAGCACHE_ADMIN_KEY=ADMIN, RAGCACHE_API_KEYS=json.dumps(TENANTS))
    server.admin_key, server.tenant_keys = ADMIN, TENANTS
    yield server
    server.stop()
