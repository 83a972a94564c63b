"""The jobs role: precompute jobs started for a server, run in a process of their own.

A job is a row in SQL (`jobs`); its work is `ragcache precompute --job ID`, a child process, so
the server stays responsive and the job survives nothing it should not: a server that stops
terminates its children, and the job resumes (chunk states are in SQL) when started again. A
server that dies (kill -9, a crash) takes its children with it (their stdin is a pipe only the
server holds: `exit_with_parent`), and the next server on its home resumes the jobs it left running.
The child gets `job_threads` torch threads; the server uses the rest while it runs.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading

from sqlalchemy import select

from ..corpus.ingest import corpus_counts
from ..errors import Conflict, NotFound
from ..meta import Job, utcnow
from .rows import LOCK_FILE, join_or_start_job

log = logging.getLogger("ragcache.jobs")
_SERVER_ONLY = {"api_keys", "admin_key"}  # settings a precompute child is not given
_ERROR_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Interrupt))(?::|$)")  # a traceback's last line


class Jobs:
    def __init__(self, parts):
        self.p = parts
        self._children: dict[int, tuple[subprocess.Popen, str | None]] = {}  # job id → (process, namespace)
        self._queued: dict[int, str | None] = {}  # SQLite: job id → namespace, to start when no child runs
        self._lock = threading.Lock()
        self._closed = False

    def start(self, namespace: str | None) -> dict:
        """Start (or join the running) precompute job for `namespace` (None: every namespace). On SQLite, while
        a child of ours runs (or, its job just finished, is still exiting with the one-writer lock), the job is
        queued: it starts when that child exits, so the caller never has to retry."""
        with self._lock:
            self._reap()
            for job_id, ns in [*((j, ns) for j, (_, ns) in self._children.items()), *self._queued.items()]:
                if ns == namespace and self._row(job_id)["state"] == "running":
                    return self._row(job_id)
            if self.p.db.is_sqlite and not self._children and self._lock_held():
                raise Conflict("a precompute is already running on this SQLite database (another process); wait "
                               "for it, or use PostgreSQL (RAGCACHE_DATABASE_URL) for several at once")
            job_id = join_or_start_job(self.p.db, namespace)
            if self.p.db.is_sqlite and self._children:
                self._queued[job_id] = namespace
            else:
                self._launch(job_id, namespace)
            return self._row(job_id)

    def _launch(self, job_id: int, namespace: str | None) -> None:
        out = open(self.p.settings.home / f"job-{job_id}.log", "ab")
        cmd = [sys.executable, "-m", "ragcache.cli", "precompute", "--job", str(job_id), "--quiet", "--lifeline"]
        if namespace is not None:
            cmd += ["--namespace", namespace]
        proc = subprocess.Popen(cmd, env=self._child_env(), stdout=out, stderr=out, stdin=subprocess.PIPE)
        self._children[job_id] = (proc, namespace)
        out.close()
        threading.Thread(target=self._watch, args=(proc,), name=f"job-{job_id}", daemon=True).start()

    def resume(self) -> None:
        """Start again the jobs a server on this home left running (it died without stopping them, and
        its children died with it); on SQLite none while another process precomputes (it holds the
        lock, and may be working on them)."""
        with self.p.db.session() as s:
            rows = s.execute(select(Job.id, Job.namespace).where(Job.state == "running").order_by(Job.id)).all()
        left = [(job_id, ns) for job_id, ns in rows if (self.p.settings.home / f"job-{job_id}.log").exists()]
        with self._lock:
            if not left or (self.p.db.is_sqlite and self._lock_held()):
                return
            for job_id, ns in left:
                if job_id in self._children or job_id in self._queued:
                    continue
                log.info("resuming precompute job %d, left running by a server that died", job_id)
                if self.p.db.is_sqlite and self._children:
                    self._queued[job_id] = ns
                else:
                    self._launch(job_id, ns)

    def _watch(self, proc: subprocess.Popen) -> None:
        """Reap a child as soon as it exits, so its failure is written and a queued job starts at once."""
        proc.wait()
        with self._lock:
            if not self._closed:
                self._reap()

    def get(self, job_id: int) -> dict:
        with self._lock:
            self._reap()
        return self._row(job_id)

    def _row(self, job_id: int) -> dict:
        with self.p.db.session() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFound(f"no job {job_id}")
            return _as_dict(job)

    def working(self) -> int:
        """Children still running, without the lock: what the model thread asks every step, never waiting on
        a `start` that holds the lock across SQL and a spawn. A snapshot of the children, each polled without
        blocking (Popen.poll takes no lock it would wait for); `_reap` writes their ends later."""
        return sum(proc.poll() is None for proc, _ in list(self._children.values()))

    def _reap(self) -> None:
        """Children that ended (the lock held): a failure is written on the job; a child that ended while
        chunks it could claim were still pending (ingested after its last claim) is started again on the
        same job; with no child left, the first queued job starts."""
        for job_id, (proc, namespace) in list(self._children.items()):
            code = proc.poll()
            if code is None:
                continue
            del self._children[job_id]
            proc.stdin.close()
            if code != 0:
                self._end(job_id, "failed", self._failure(job_id, code))
            elif self._row(job_id)["state"] == "running" and corpus_counts(self.p.db, namespace).get("pending"):
                self._launch(job_id, namespace)
        if self._queued and not self._children:
            job_id = next(iter(self._queued))
            self._launch(job_id, self._queued.pop(job_id))

    def _end(self, job_id: int, state: str, reason: str) -> None:
        with self.p.db.session() as s:
            job = s.get(Job, job_id)
            if job is not None and job.state == "running":
                job.state, job.error, job.finished = state, reason[:2000], utcnow()

    def _failure(self, job_id: int, code: int) -> str:
        try:
            lines = (self.p.settings.home / f"job-{job_id}.log").read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        return exit_reason(code, lines, f"job-{job_id}.log")

    def _lock_held(self) -> bool:
        """Another process holds SQLite's one-precompute lock (the CLI, say)."""
        path = self.p.settings.home / LOCK_FILE
        if not path.exists():
            return False
        with open(path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    def _child_env(self) -> dict[str, str]:
        """This server's settings, as the child's RAGCACHE_* environment, with the job's thread share; the
        keys stay in the server (a precompute child serves nobody)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
        for name, value in self.p.settings.model_dump(exclude=_SERVER_ONLY).items():
            if value is None:
                continue
            env[f"RAGCACHE_{name.upper()}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        env["RAGCACHE_THREADS"] = str(self.p.settings.job_thread_count())
        return env

    def close(self) -> None:
        """Stop the children; their jobs say so, and resume from SQL when started again."""
        with self._lock:
            self._closed = True
            for job_id in self._queued:
                self._end(job_id, "stopped", "the server stopped; POST /v1/jobs/precompute resumes the work")
            self._queued.clear()
            for proc, _ in self._children.values():
                proc.terminate()
            for job_id, (proc, _) in self._children.items():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                proc.stdin.close()
                self._end(job_id, "stopped", "the server stopped; POST /v1/jobs/precompute resumes the work")
            self._children.clear()


def exit_with_parent() -> None:
    """In a server's precompute child: exit as soon as stdin, the pipe only the server holds, reaches its
    end: the server is gone, however it went. No cleanup, as when `close` terminates it: the chunks it held
    go back to the pool from SQL (claims.release_dead, leases) and a put it cut off is swept (ledger.sweep)."""
    def watch() -> None:
        while sys.stdin.buffer.read(1 << 16):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def exit_reason(code: int, log_lines: list[str], log_name: str) -> str:
    """What failed, for a job's `error`: the exit status and the kind of error, never the child's own words
    (they may name hosts, users and paths; the log in the server's home keeps them for its operator)."""
    if code < 0:
        return f"precompute was killed by signal {signal.Signals(-code).name}; see {log_name} in the server's home"
    kind = next((m[1].rsplit(".", 1)[-1] for line in reversed(log_lines) if (m := _ERROR_LINE.match(line))), None)
    if kind is None and any(line.startswith("ragcache: error:") for line in log_lines[-3:]):
        kind = "a setting or the environment"
    return f"precompute exited with status {code}" + (f" ({kind})" if kind else "") + \
        f"; see {log_name} in the server's home"


def _as_dict(job: Job) -> dict:
    return {"id": job.id, "namespace": job.namespace, "state": job.state, "total": job.total, "done": job.done,
            "failed": job.failed, "skipped": job.skipped, "tokens": job.tokens,
            "started": job.started.isoformat() if job.started else None,
            "finished": job.finished.isoformat() if job.finished else None, "error": job.error}
