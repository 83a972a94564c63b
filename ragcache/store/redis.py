"""Redis tier: a shared remote store of blobs (binary values under a key prefix).

Nothing is asked of the server until first use, so a Redis that is down at start costs a
fault the store counts, not a process that cannot start.
"""
from __future__ import annotations

import threading

import redis as redis_py

PREFIX = "ragcache:kv:"


class RedisTier:
    name = "redis"
    holds_blobs = True

    def __init__(self, url: str, capacity: int, prefix: str = PREFIX):
        self.capacity, self.prefix = capacity, prefix
        self.client = redis_py.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._lock = threading.Lock()
        self._sizes: dict[str, int] | None = None  # key → bytes, read on first use, then kept up to date

    def _known(self) -> dict[str, int]:
        if self._sizes is None:
            n = len(self.prefix)
            keys = [k.decode()[n:] for k in self.client.scan_iter(match=self.prefix + "*", count=1000)]
            sizes = {}
            if keys:
                with self.client.pipeline() as p:
                    for k in keys:
                        p.strlen(self.prefix + k)
                    sizes = dict(zip(keys, p.execute()))
            with self._lock:
                if self._sizes is None:
                    self._sizes = sizes
        return self._sizes

    def put(self, key: str, value: bytes) -> None:
        self.client.set(self.prefix + key, value)
        known = self._known()
        with self._lock:
            known[key] = len(value)

    def get(self, key: str) -> bytearray | None:
        value = self.client.get(self.prefix + key)
        if value is None:
            with self._lock:
                (self._sizes or {}).pop(key, None)
            return None
        return bytearray(value)  # writable: tensors parsed from it are views of it

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + key)
        with self._lock:
            (self._sizes or {}).pop(key, None)

    def keys(self) -> list[str]:
        return list(self._known())

    def used_bytes(self) -> int:
        return sum((self._sizes or {}).values())

    def capacity_bytes(self) -> int:
        return self.capacity

    def ping(self) -> None:
        self.client.ping()
