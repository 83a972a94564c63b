"""Several processes, several hosts, one database and one Redis: each store's copies, use and orphans
are its own (separate directories stand in for hosts; separate store objects for processes)."""
from __future__ import annotations

import sys

import redis
from sqlalchemy import event

from ragcache.database import Database
from ragcache.store import encode
from ragcache.store.disk import DiskTier
from ragcache.store.ledger import Ledger
from ragcache.store.memory import MemoryTier
from ragcache.store.redis import RedisTier
from ragcache.store.tiered import TieredStore

from .conftest import REDIS_URL, fake_chunk
from .test_store import ENTRY_BYTES


def host(db, root, *, disk_entries=100, redis_token=None, grace=60.0) -> TieredStore:
    blobs = [DiskTier(root / "kv", disk_entries * (ENTRY_BYTES + 1024))]
    if redis_token:
        blobs.append(RedisTier(REDIS_URL, 1 << 30, redis_token))
    return TieredStore(db, [MemoryTier("cpu", "cpu", 0)], blobs, orphan_grace_s=grace)


def test_another_hosts_start_and_misses_never_touch_this_hosts_copies(db, tmp_path):
    a = host(db, tmp_path / "a")
    a.put("k", encode(fake_chunk(1), "float32"))
    b = host(db, tmp_path / "b", grace=0.0)  # starts with nothing on its disk
    assert b.get("k") is None and b.where("k") == []  # its miss judges only its own disk
    assert host(db, tmp_path / "a").get("k").tier == "disk"  # A restarted: still there, served


def test_every_writer_of_a_store_shares_its_capacity(db, tmp_path):
    one, two = host(db, tmp_path, disk_entries=4), host(db, tmp_path, disk_entries=4)  # two processes, one disk
    for i in range(6):
        (one if i % 2 else two).put(f"k{i}", encode(fake_chunk(i), "float32"))
    used = [t["used_bytes"] for t in one.stats()["tiers"] if t["name"] == "disk"]
    assert used == [t["used_bytes"] for t in two.stats()["tiers"] if t["name"] == "disk"]
    files = list((tmp_path / "kv").glob("*/*.safetensors"))
    assert len(files) == 4 and used[0] == sum(f.stat().st_size for f in files) <= 4 * (ENTRY_BYTES + 1024)


def test_deployments_sharing_a_redis_never_count_or_delete_each_others_keys(db, tmp_path, redis_token):
    other_db = Database(f"sqlite:///{tmp_path / 'other.db'}")
    ours = host(db, tmp_path / "ours", redis_token=redis_token)
    theirs = host(other_db, tmp_path / "theirs", redis_token=redis_token + "x")
    ours.put("k", encode(fake_chunk(2), "float32"))
    theirs.put("k", encode(fake_chunk(3), "float32"))
    ours.evict_tier("redis")
    client = redis.Redis.from_url(REDIS_URL)
    assert not client.exists(f"ragcache:{redis_token}:kv:k") and client.exists(f"ragcache:{redis_token}x:kv:k")
    assert [t["entries"] for t in theirs.stats()["tiers"] if t["name"] == "redis"] == [1]
    client.delete(f"ragcache:{redis_token}x:kv:k")
    other_db.dispose()


def test_a_put_that_died_between_blob_and_commit_is_swept_at_the_next_start(db, tmp_path, redis_token):
    store = host(db, tmp_path, redis_token=redis_token)
    blob = b"x" * 100
    for tier in store.blobs:  # what a put does before its commit, then the process dies
        assert Ledger(db, tier.store_id).reserve("dead", len(blob), 1 << 30, 4, "float32", 1.0, False)
        tier.put("dead", blob)
    again = host(db, tmp_path, redis_token=redis_token, grace=0.0)
    assert again.where("dead") == [] and not redis.Redis.from_url(REDIS_URL).exists(f"ragcache:{redis_token}:kv:dead")
    assert not list((tmp_path / "kv").glob("*/dead.safetensors"))
    assert [t["used_bytes"] for t in again.stats()["tiers"]] == [0, 0, 0]


def test_start_up_does_not_grow_with_the_number_of_entries(db, tmp_path, redis_token):
    """The same SQL statements for 3 entries as for 30, and no blob directory listed or blob opened."""
    watching, touched = [], []

    def audit(event_name, args):
        if watching and event_name in ("os.scandir", "os.listdir", "open") and "safetensors" in str(args[:1]) \
                or watching and event_name in ("os.scandir", "os.listdir") and "/kv" in str(args[:1]):
            touched.append((event_name, args[0]))

    sys.addaudithook(audit)  # (hooks cannot be removed: this one only records while `watching`)

    def statements_at_start(n: int) -> int:
        root = tmp_path / f"n{n}"
        store = host(db, root, redis_token=redis_token)
        for i in range(n):
            store.put(f"{n}-{i}", encode(fake_chunk(i), "float32"))
        seen = []

        def count(*_):
            seen.append(1)

        event.listen(db.engine, "before_cursor_execute", count)
        watching.append(1)
        host(db, root, redis_token=redis_token)
        watching.clear()
        event.remove(db.engine, "before_cursor_execute", count)
        return len(seen)

    assert statements_at_start(3) == statements_at_start(30)
    assert not touched, touched[:3]


def test_a_schema_3_database_upgrades_and_its_disk_blobs_are_adopted(db_url, tmp_path):
    from sqlalchemy import create_engine, text

    from ragcache.store.codec import checksum, to_bytes

    entry = encode(fake_chunk(5), "float32")
    blob = to_bytes(entry)
    DiskTier(tmp_path / "kv", 1 << 30).put("old", blob)
    engine = create_engine(db_url)
    with engine.begin() as c:  # the tables as schema 3 had them
        c.execute(text("CREATE TABLE schema_info (id INTEGER PRIMARY KEY, version INTEGER)"))
        c.execute(text("INSERT INTO schema_info VALUES (1, 3)"))
        c.execute(text("CREATE TABLE kv_entries (key VARCHAR(64) PRIMARY KEY, n_tokens INTEGER, bytes BIGINT, "
                       "checksum VARCHAR(32), kv_dtype VARCHAR(16), on_disk BOOLEAN, in_redis BOOLEAN, "
                       "pinned BOOLEAN, hits INTEGER, last_access TIMESTAMP, created TIMESTAMP)"))
        c.execute(text("INSERT INTO kv_entries VALUES ('old', 16, :b, :c, 'float32', TRUE, FALSE, FALSE, 0, "
                       "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP), ('gone', 16, 10, 'x', 'float32', TRUE, TRUE, FALSE, "
                       "0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"b": len(blob), "c": checksum(blob)})
    engine.dispose()
    db = Database(db_url)
    store = host(db, tmp_path)
    assert store.get("old").tier == "disk" and store.where("gone") == []
    assert [t["used_bytes"] for t in store.stats()["tiers"] if t["name"] == "disk"] == [len(blob)]
    db.dispose()
