"""Redis tier: a shared remote store of blobs under this deployment's key prefix.

`ragcache:<token>:kv:` where the token is kept in SQL (blob_stores), so deployments sharing one
Redis never see, count or delete each other's keys. What it holds and how full it is are kept in
SQL too (ledger.py). Nothing is asked of the server until first use, so a Redis that is down at
start costs a fault the store counts, not a process that cannot start.
"""
from __future__ import annotations

import redis as redis_py

STORE_ID = "redis"


class RedisTier:
    name = "redis"
    holds_blobs = True
    store_id = STORE_ID

    def __init__(self, url: str, capacity: int, token: str):
        self.capacity, self.prefix = capacity, f"ragcache:{token}:kv:"
        self.client = redis_py.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)

    def put(self, key: str, value: bytes) -> None:
        self.client.set(self.prefix + key, value)

    def get(self, key: str) -> bytearray | None:
        value = self.client.get(self.prefix + key)
        return None if value is None else bytearray(value)  # writable: tensors parsed from it are views

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + key)

    def keys(self) -> list[str]:
        """Every key under this deployment's prefix (a scan: for inspection, never on a request's path)."""
        n = len(self.prefix)
        return [k.decode()[n:] for k in self.client.scan_iter(match=self.prefix + "*", count=1000)]

    def capacity_bytes(self) -> int:
        return self.capacity

    def ping(self) -> None:
        self.client.ping()
