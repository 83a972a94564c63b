"""Fault drills (issue 21): real servers (tests/api/conftest.py's helpers), real PostgreSQL and Redis, and
real faults: a server killed -9, database backends terminated, a Redis stopped, a disk that fills up.

What they share: servers started and killed per test, a condition waited on, and the store's books read
straight from its SQL tables and its directory (what a drill asserts about no blob lost or leaked).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select

from ragcache.meta import BlobStore, Chunk, KVCopy
from ragcache.store.codec import checksum
from tests.api.conftest import start_server


def wait_for(condition, timeout: float, what: str, every: float = 0.2):
    """condition()'s first truthy value within `timeout` seconds (a loaded machine: be generous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := condition():
            return out
        time.sleep(every)
    raise AssertionError(f"not within {timeout:g}s: {what}")


@pytest.fixture
def servers(smollm):
    """start(home, **env) → a Server, stopped (or killed) afterwards."""
    started = []

    def start(home: Path, **env):
        started.append(start_server(home, smollm, **env))
        return started[-1]

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()


def alive(pid: int) -> bool:
    """`pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill9(server) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)


def disk_store_problems(home: Path, db_url: str) -> list[str]:
    """What is wrong between the disk tier's SQL books and its directory: a copy row without its blob (or
    with another blob), a row never committed, a blob or temp file no row names, counters that disagree."""
    kv = home / "kv"
    store = f"disk:{(kv / 'STORE_ID').read_text().strip()}"
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            rows = {key: (nbytes, csum) for key, nbytes, csum in c.execute(
                select(KVCopy.key, KVCopy.bytes, KVCopy.checksum).where(KVCopy.store == store))}
            used, entries = c.execute(select(BlobStore.used_bytes, BlobStore.entries)
                                      .where(BlobStore.id == store)).one()
    finally:
        engine.dispose()
    blobs = {p.name.removesuffix(".safetensors"): p for p in kv.glob("*/*.safetensors")}
    problems = [f"row {k} has no blob" for k in rows.keys() - blobs.keys()]
    problems += [f"blob {k} has no row" for k in blobs.keys() - rows.keys()]
    problems += [f"temp file {p.name} left" for p in kv.glob("*/.*.tmp")]
    for key, (nbytes, csum) in rows.items():
        if csum is None:
            problems.append(f"row {key} was never committed")
        elif key in blobs and checksum(blobs[key].read_bytes()) != csum:
            problems.append(f"blob {key} does not match its row's checksum")
    if (used, entries) != (sum(b for b, _ in rows.values()), len(rows)):
        problems.append(f"blob_stores says {used} bytes in {entries} entries; its rows hold "
                        f"{sum(b for b, _ in rows.values())} in {len(rows)}")
    return problems


def chunk_states(db_url: str, namespace: str) -> dict[str, int]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            return dict(c.execute(select(Chunk.state, func.count()).where(Chunk.namespace == namespace)
                                  .group_by(Chunk.state)).all())
    finally:
        engine.dispose()
