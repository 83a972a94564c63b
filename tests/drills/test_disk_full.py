"""Drill: the disk tier's filesystem fills up under a serving server (another writer takes the space its
RAGCACHE_DISK_CACHE_BYTES counted on). Writes fail with ENOSPC: every request still answers 200, its chunks
recomputed; the failed writes are counted (ragcache_store_errors_total) and leave nothing behind; once space
is free again the tier stores chunks again.

The full disk is real: a 40 MiB tmpfs mounted over the home's kv/ (this needs root, as CI has; the test
fails, rather than skips, where mounting is refused), filled with a file until writing to it fails."""
from __future__ import annotations

import errno
import subprocess

import pytest

from tests.api.conftest import short_docs

from .conftest import disk_store_problems, wait_for

NS = "drill-disk"


@pytest.fixture
def small_disk(tmp_path):
    """home/kv on a 40 MiB tmpfs: (home, the mount point)."""
    kv = tmp_path / "home" / "kv"
    kv.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(kv)], capture_output=True, text=True)
    assert r.returncode == 0, f"cannot mount a tmpfs (root is needed): {r.stderr.strip()}"
    yield kv.parent, kv
    subprocess.run(["umount", "-l", str(kv)], check=True)


def _fill(path) -> int:
    """Write `path` until the filesystem refuses with ENOSPC; the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"\0" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return n


def test_a_full_disk_tier_is_served_around_and_counted(small_disk, servers):
    home, kv = small_disk
    s = servers(home, RAGCACHE_CPU_CACHE_BYTES=0,  # no memory tier: a chunk is on disk, or computed
                RAGCACHE_DISK_CACHE_BYTES=32 << 20)  # less than the filesystem: the ledger sees room to the end
    docs = short_docs(5, 4, "d-")
    ask = {"query": docs[0]["text"], "namespace": NS, "top_k": 4, "mode": "reuse", "max_tokens": 8}
    with s.client() as c:
        r = c.post("/v1/documents", params={"namespace": NS}, json=docs)
        assert r.status_code == 200, r.text
        job_id = r.json()["job"]["id"]
        wait_for(lambda: c.get(f"/v1/jobs/{job_id}").json()["state"] != "running", 240, "the precompute job")
        assert c.get(f"/v1/jobs/{job_id}").json()["done"] == 4

        def tiers() -> list[str]:
            r = c.post("/v1/rag/generate", json=ask)
            assert r.status_code == 200, r.text[:300]
            return [ch["tier"] for ch in r.json()["chunks"]]

        assert tiers() == ["disk"] * 4
        assert c.post("/v1/cache/evict", json={"tier": "disk"}).json()["evicted"] == 4  # room in the books for all four
        filler = kv / "someone-else"
        assert _fill(filler) > 0  # and none on the disk
        for _ in range(3):
            assert tiers() == ["computed"] * 4  # served, recomputed: no tier holds them
        assert s.metric("ragcache_store_errors_total", tier="disk") >= 1
        assert disk_store_problems(home, f"sqlite:///{home / 'ragcache.db'}") == []  # no half-written blob

        filler.unlink()  # space again: within the tier's rest (5 s) it stores chunks again
        wait_for(lambda: tiers() == ["disk"] * 4, 60, "chunks served from disk again", every=1)
    assert disk_store_problems(home, f"sqlite:///{home / 'ragcache.db'}") == []
