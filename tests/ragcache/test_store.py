"""The tiered KV store against real servers: a SQLite file and PostgreSQL, a disk tier, Redis."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psycopg
import pytest
import torch
from sqlalchemy import select

from ragcache.database import Database
from ragcache.meta import KVCopy, KVEntry
from ragcache.store import StoreFull, TieredStore, decode, encode, kv_key
from ragcache.store.codec import checksum, from_bytes, to_bytes
from ragcache.store.disk import DiskTier
from ragcache.store.memory import MemoryTier
from ragcache.store.policy import GDSF, LRU
from ragcache.store.redis import RedisTier

from .conftest import PG_ADMIN, REDIS_URL, fake_chunk

ENTRY_BYTES = encode(fake_chunk(0), "float32").nbytes


def make_store(db, tmp_path, *, cpu_entries=100, disk_entries=1000, redis_token=None, policy="lru",
               write_back=False, grace=60.0) -> TieredStore:
    memory = [MemoryTier("cpu", "cpu", cpu_entries * ENTRY_BYTES)]
    blobs = [DiskTier(tmp_path / "kv", disk_entries * (ENTRY_BYTES + 1024))]
    if redis_token:
        blobs.append(RedisTier(REDIS_URL, 1 << 30, redis_token))
    return TieredStore(db, memory, blobs, policy=policy, write_back=write_back, orphan_grace_s=grace)


def _close(chunk, restored, kv_dtype):
    for a, b in ((chunk.k, restored.k), (chunk.v, restored.v)):
        if kv_dtype == "float32":
            assert torch.equal(a, b)
        elif kv_dtype == "int8":  # symmetric, one scale per (layer, head, token): half a step at most
            bound = a.abs().amax(dim=-1, keepdim=True) / 254 + 1e-6
            assert ((a - b).abs() <= bound).all()
        else:
            assert torch.allclose(a, b, rtol=1e-2, atol=1e-2)
    assert torch.equal(chunk.token_ids, restored.token_ids)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8"])
def test_round_trip_through_every_tier(db, tmp_path, redis_token, kv_dtype):
    store = make_store(db, tmp_path, redis_token=redis_token)
    chunk = fake_chunk(1)
    store.put("k1", encode(chunk, kv_dtype))
    hit = store.get("k1")
    assert hit.tier == "cpu"
    _close(chunk, decode(hit.entry, torch.float32, torch.device("cpu")), kv_dtype)
    reopened = make_store(db, tmp_path, redis_token=redis_token)  # empty memory: the disk serves it
    hit = reopened.get("k1")
    assert hit.tier == "disk"
    _close(chunk, decode(hit.entry, torch.float32, torch.device("cpu")), kv_dtype)
    assert reopened.get("k1").tier == "cpu"  # promoted on that hit
    DiskTier(tmp_path / "kv", 1 << 30).delete("k1")
    third = make_store(db, tmp_path, redis_token=redis_token)
    hit = third.get("k1")
    assert hit.tier == "redis"
    _close(chunk, decode(hit.entry, torch.float32, torch.device("cpu")), kv_dtype)


def test_int8_is_a_quarter_of_float32():
    chunk = fake_chunk(2, n=64, hd=64)
    f32, i8 = encode(chunk, "float32"), encode(chunk, "int8")
    assert i8.nbytes < 0.3 * f32.nbytes


def test_eviction_demotes_and_a_hit_promotes(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=2)
    for i in range(3):
        store.put(f"k{i}", encode(fake_chunk(i), "float32"))
    cpu = store.memory[0]
    assert sorted(cpu.keys()) == ["k1", "k2"]  # LRU: k0 went down to disk
    assert cpu.used_bytes() <= cpu.capacity_bytes()
    assert store.get("k0").tier == "disk" and sorted(cpu.keys()) == ["k0", "k2"]
    assert store.evictions["cpu"] == 2


def test_pinned_entries_are_never_evicted(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=2)
    store.put("pinned", encode(fake_chunk(0), "float32"), pinned=True)
    for i in range(5):
        store.put(f"k{i}", encode(fake_chunk(i + 1), "float32"))
        assert store.memory[0].contains("pinned")
    with db.session() as s:
        assert s.get(KVEntry, "pinned").pinned


def test_disk_full_of_pinned_entries_refuses_more(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=1, disk_entries=2)
    store.put("a", encode(fake_chunk(0), "float32"), pinned=True)
    store.put("b", encode(fake_chunk(1), "float32"), pinned=True)
    with pytest.raises(StoreFull):
        store.put("c", encode(fake_chunk(2), "float32"))


def test_a_pinned_put_stays_inside_the_tier(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=1, disk_entries=2)
    store.put("a", encode(fake_chunk(0), "float32"), pinned=True)
    store.put("b", encode(fake_chunk(1), "float32"), pinned=True)
    with pytest.raises(StoreFull):  # it used to land past the capacity
        store.put("c", encode(fake_chunk(2), "float32"), pinned=True)
    assert store.stats()["tiers"][1]["used_bytes"] <= store.blobs[0].capacity_bytes()


def test_pins_are_counted_per_namespace_in_its_quota_all_or_nothing(db, tmp_path):
    from ragcache.store.pins import PinQuotaExceeded

    store = make_store(db, tmp_path)
    for i in range(3):
        store.put(f"k{i}", encode(fake_chunk(i), "float32"))
    size = store.stats()["tiers"][1]["used_bytes"] // 3
    assert store.pin("a", ["k0", "k1"], 2 * size) == {"k0", "k1"}
    assert store.pin("a", ["k0"], 2 * size) == {"k0"}  # pinned already: counted once
    with pytest.raises(PinQuotaExceeded, match="RAGCACHE_PIN_QUOTA_BYTES"):
        store.pin("a", ["k2"], 2 * size)
    assert not store.is_pinned("k2")
    assert store.pin("b", ["k1", "k2"], 2 * size) == {"k1", "k2"}  # another namespace, its own quota
    store.unpin("a", ["k0", "k1"])
    assert not store.is_pinned("k0") and store.is_pinned("k1")  # b still pins k1
    with db.session() as s:
        assert not s.get(KVEntry, "k0").pinned and s.get(KVEntry, "k1").pinned
    many = [f"absent{i}" for i in range(40_000)] + ["k0"]  # past SQLite's 32,766 variables, in one call
    assert store.pin("a", many, 2 * size) == {"k0"}  # only what is stored is pinned


def test_lru_and_gdsf_orders():
    lru = LRU()
    for k in "abc":
        lru.touch(k, 10, 1.0)
    lru.touch("a", 10, 1.0)
    assert lru.victim() == "b" and lru.victim(skip={"b"}) == "c"
    gdsf = GDSF()
    gdsf.touch("cheap", 100, 1.0)  # priority 0.01
    gdsf.touch("costly", 100, 50.0)  # priority 0.5
    for _ in range(3):
        gdsf.touch("popular", 100, 1.0)  # hits 3 → 0.03
    assert gdsf.victim() == "cheap"
    gdsf.remove("cheap")
    assert gdsf.clock == pytest.approx(0.01)
    assert gdsf.victim() == "popular"  # 0.03 < 0.5: size-normalised cost beats a few hits


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_capacity_is_never_exceeded(db, tmp_path, policy):
    store = make_store(db, tmp_path, cpu_entries=3, disk_entries=6, policy=policy)
    rng = random.Random(0)
    for step in range(60):
        key = f"k{rng.randrange(12)}"
        if rng.random() < 0.5:
            store.put(key, encode(fake_chunk(rng.randrange(100), n=rng.choice([8, 16])), "float32"))
        else:
            store.get(key)
        for tier in store.stats()["tiers"]:
            assert tier["used_bytes"] <= tier["capacity_bytes"], (step, tier["name"])


def _blob_path(tmp_path, key):
    return next((tmp_path / "kv").glob(f"*/{key}.safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_disk_blob_is_detected_dropped_and_a_miss(db, tmp_path, damage):
    make_store(db, tmp_path).put("k", encode(fake_chunk(3), "float32"))
    path = _blob_path(tmp_path, "k")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) // 3]
    path.write_bytes(bytes(data))
    store = make_store(db, tmp_path)
    assert store.get("k") is None
    assert store.corrupt["disk"] == 1 and not path.exists()
    with db.session() as s:
        assert s.get(KVEntry, "k") is None  # nothing else held it: the entry is gone, to be recomputed


def test_corrupt_redis_blob_is_detected_and_the_disk_copy_is_untouched(db, tmp_path, redis_token):
    import redis

    make_store(db, tmp_path, redis_token=redis_token).put("k", encode(fake_chunk(4), "float32"))
    DiskTier(tmp_path / "kv", 1 << 30).delete("k")  # force the read to Redis
    redis.Redis.from_url(REDIS_URL).setrange(f"ragcache:{redis_token}:kv:k", 200, b"\xff\xfe")
    store = make_store(db, tmp_path, redis_token=redis_token)
    assert store.get("k") is None and store.corrupt["redis"] == 1
    assert not redis.Redis.from_url(REDIS_URL).exists(f"ragcache:{redis_token}:kv:k")


def test_row_whose_blob_vanished_is_repaired_on_lookup(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=0)
    store.put("k", encode(fake_chunk(5), "float32"))
    _blob_path(tmp_path, "k").unlink()
    assert store.get("k") is None
    with db.session() as s:
        assert s.get(KVEntry, "k") is None


def test_write_back_commits_the_row_only_once_the_blob_is_durable(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=2, write_back=True)
    store.put("a", encode(fake_chunk(6), "float32"))
    with db.session() as s:
        assert s.get(KVEntry, "a") is None
    store.put("b", encode(fake_chunk(7), "float32"))
    store.put("c", encode(fake_chunk(8), "float32"))  # evicts a: written down now
    assert store.where("a") == ["disk"] and store.where("b") == ["cpu"]
    store.flush()
    with db.session() as s:
        assert {r.key for r in s.scalars(select(KVEntry))} == {"a", "b", "c"}


def test_write_back_entry_no_memory_tier_takes_is_written_at_once(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=0, write_back=True)
    store.put("a", encode(fake_chunk(9), "float32"))
    assert store.where("a") == ["disk"]  # nowhere in memory to wait for a flush
    assert store.get("a").tier == "disk"


def test_a_pin_survives_write_back_and_a_restart(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=2, write_back=True)
    store.put("p", encode(fake_chunk(10), "float32"), pinned=True)
    store.close()
    assert "p" in make_store(db, tmp_path)._pinned


def _costing(seed: int, cost_s: float):
    entry = encode(fake_chunk(seed), "float32")
    entry.cost_s = cost_s
    return entry


def test_gdsf_keeps_what_costs_most_to_recompute_and_its_order_survives_a_restart(db, tmp_path):
    first = make_store(db, tmp_path, cpu_entries=0, disk_entries=4, policy="gdsf")
    first.put("dear", _costing(0, 0.05))  # same size: only the measured prefill cost and the hits differ
    first.put("cheap", _costing(1, 0.01))
    first.put("popular", _costing(2, 0.01))
    for _ in range(6):
        first.get("popular")
    first.close()  # hits written
    reopened = make_store(db, tmp_path, cpu_entries=0, disk_entries=4, policy="gdsf")
    for i in range(3):  # the second and third need room
        reopened.put(f"new{i}", _costing(10 + i, 0.02))
    kept = {k for k in ("dear", "cheap", "popular", "new0", "new1", "new2") if reopened.where(k)}
    assert kept == {"dear", "popular", "new1", "new2"}  # cheap, then new0 (under the risen clock) went


def test_keys_separate_tenants_unless_sharing_is_on(db):
    salt_a, salt_b = db.namespace_salt("a", shared=False), db.namespace_salt("b", shared=False)
    assert salt_a != salt_b and db.namespace_salt("a", shared=False) == salt_a
    ids = torch.arange(10)
    assert kv_key("fp", ids, "", "float32", salt_a) != kv_key("fp", ids, "", "float32", salt_b)
    assert db.namespace_salt("a", shared=True) == db.namespace_salt("b", shared=True) == ""
    assert kv_key("fp", ids, "", "float32", "") != kv_key("fp", ids, "", "int8", "")
    assert kv_key("fp", ids, "", "float32", "") != kv_key("fp", ids, "prefix", "float32", "")


_WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.ragcache.conftest import fake_chunk
    from tests.ragcache.test_store import make_store
    from ragcache.database import Database
    from ragcache.store import encode
    from pathlib import Path
    store = make_store(Database({url!r}), Path({tmp!r}), cpu_entries=4, disk_entries=100000)
    print("ready", flush=True)
    i = {start}
    while True:
        store.put(f"k{{i}}", encode(fake_chunk(i, n=64), "float32"))
        i += 1
""")


def _wait_for_its_backends(db_url: str, timeout_s: float = 60.0) -> None:
    """Until PostgreSQL has finished the dead writer's sessions: a COMMIT it sent just before SIGKILL
    still lands after the process is gone, and a sweep that ran first would miss that copy row."""
    if not db_url.startswith("postgresql"):
        return  # SQLite: the file lock dies with the process
    name = db_url.rsplit("/", 1)[1]
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)).fetchone()[0]:
            assert time.monotonic() < deadline, "the killed writer's sessions never ended"
            time.sleep(0.05)


def test_killed_writer_leaves_every_row_with_a_valid_blob(db_url, tmp_path):
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    rng = random.Random(1)
    start = 0
    for round_ in range(6):  # a kill at a random point of the writer's loop, six times per database
        code = _WRITER.format(root=root, url=db_url, tmp=str(tmp_path), start=start)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _wait_for_its_backends(db_url)
        start += 10_000
        db = Database(db_url)
        store = make_store(db, tmp_path, grace=0.0)  # the writer is dead: every put it left can go
        disk = store.blobs[0]
        with db.session() as s:
            rows = list(s.scalars(select(KVCopy).where(KVCopy.store == disk.store_id)))
        assert {r.key for r in rows} == set(disk.keys()), f"round {round_}: rows and blobs disagree"
        assert not list((tmp_path / "kv").glob("*/.*.tmp"))
        for r in rows:
            blob = disk.get(r.key)
            assert checksum(blob) == r.checksum and from_bytes(blob).token_ids.numel() == 64
        assert store.stats()["tiers"][1]["used_bytes"] == sum(r.bytes for r in rows)
        assert all(store.get(r.key) is not None for r in rows[-5:])
        db.dispose()
    assert rows, "the writer never committed anything"


def test_eight_threads_lose_and_tear_nothing(db, tmp_path):
    store = make_store(db, tmp_path, cpu_entries=8, disk_entries=10_000)
    written: dict[str, int] = {}
    errors: list[str] = []
    stop = time.monotonic() + 3.0
    lock = threading.Lock()

    def worker(t: int):
        rng = random.Random(t)
        i = 0
        while time.monotonic() < stop:
            if rng.random() < 0.4 or not written:
                key, seed = f"t{t}-{i}", t * 100_000 + i
                store.put(key, encode(fake_chunk(seed), "float32"))
                with lock:
                    written[key] = seed
                i += 1
            else:
                with lock:
                    key, seed = rng.choice(list(written.items()))
                hit = store.get(key)
                if hit is None or not torch.equal(hit.entry.k, fake_chunk(seed).k):
                    errors.append(f"{key}: {'missing' if hit is None else 'torn'}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    assert len(written) > 50
    for key, seed in written.items():
        assert torch.equal(store.get(key).entry.v, fake_chunk(seed).v)


def test_blob_bytes_round_trip_and_garbage_is_corrupt():
    from ragcache.store import CorruptBlob

    entry = encode(fake_chunk(9), "int8")
    back = from_bytes(to_bytes(entry))
    assert torch.equal(back.k, entry.k) and torch.equal(back.k_scale, entry.k_scale) and back.kv_dtype == "int8"
    with pytest.raises(CorruptBlob):
        from_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")


def _dead_redis_url() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused, at once
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_a_dead_redis_tier_is_counted_and_served_around(db, tmp_path):
    memory = [MemoryTier("cpu", "cpu", 0)]
    blobs = [DiskTier(tmp_path / "kv", 1 << 30), RedisTier(_dead_redis_url(), 1 << 30, "x")]
    store = TieredStore(db, memory, blobs, retry_s=0.0)  # starts: the dead tier is not judged, not fatal
    assert store.put("k", encode(fake_chunk(7), "float32"), best_effort=True)  # landed on disk
    hit = store.get("k")
    assert hit is not None and hit.tier == "disk"
    assert store.guard.errors["redis"] >= 1 and store.health() == {"cpu": True, "disk": True, "redis": False}
    assert store.where("k") == ["disk"]
    assert store.stats()["tiers"][2]["errors"] == store.guard.errors["redis"]


def test_recover_does_not_judge_an_unreachable_tier(db, tmp_path, redis_token):
    make_store(db, tmp_path, redis_token=redis_token).put("k", encode(fake_chunk(8), "float32"))
    blobs = [DiskTier(tmp_path / "kv", 1 << 30), RedisTier(_dead_redis_url(), 1 << 30, redis_token)]
    store = TieredStore(db, [MemoryTier("cpu", "cpu", 1 << 30)], blobs, orphan_grace_s=0.0)
    assert store.where("k") == ["disk", "redis"]  # the blob may well be there: this process cannot see it


def test_without_a_working_blob_tier_a_durable_put_fails_loudly(db, tmp_path):
    from ragcache.store.tiered import StoreError

    store = TieredStore(db, [MemoryTier("cpu", "cpu", 1 << 30)], [RedisTier(_dead_redis_url(), 1 << 30, "x")])
    with pytest.raises(StoreError):
        store.put("k", encode(fake_chunk(9), "float32"), durable=True)
    assert not store.put("k", encode(fake_chunk(9), "float32"), best_effort=True)
    assert store.get("k").tier == "cpu"  # still served from memory this time


def test_pins_lookups_and_tier_eviction(db, tmp_path):
    store = make_store(db, tmp_path)
    for i in range(3):
        store.put(f"k{i}", encode(fake_chunk(i), "float32"))
    assert store.pin("ns", ["k0", "not stored"], 1 << 30) == {"k0"}
    assert store.where("k0") == ["cpu", "disk"] and store.is_pinned("k0")
    assert not store.evict("k0") and store.evict("k1") and store.where("k1") == []
    assert store.evict_tier("cpu") == 1  # k2; the pinned k0 stays
    assert store.where("k2") == ["disk"] and store.where("k0") == ["cpu", "disk"]
    with db.session() as s:
        assert s.get(KVEntry, "k0").pinned


def test_a_damaged_store_id_adopts_the_directory_as_a_new_store(db, tmp_path):
    store = make_store(db, tmp_path)
    store.put("k", encode(fake_chunk(0), "float32"))
    old = store.blobs[0].store_id
    (tmp_path / "kv" / "STORE_ID").write_bytes(b"\xff\xfe\x00garbage\x9c")
    again = make_store(db, tmp_path)  # it used to raise UnicodeDecodeError, at every request
    assert again.blobs[0].store_id != old and again.blobs[0].keys() == []  # its old blobs swept
    assert again.get("k") is None
    again.put("k", encode(fake_chunk(0), "float32"))
    assert make_store(db, tmp_path).get("k").tier == "disk"  # the new name holds
