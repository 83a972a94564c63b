"""Redis tier: a shared remote store of blobs (binary values under a key prefix)."""
from __future__ import annotations

import threading

import redis as redis_py

PREFIX = "ragcache:kv:"


class RedisTier:
    name = "redis"
    holds_blobs = True

    def __init__(self, url: str, capacity: int, prefix: str = PREFIX):
        self.capacity, self.prefix = capacity, prefix
        self.client = redis_py.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.client.ping()  # unreachable → fail now, with redis-py's message
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        keys = self.keys()
        if keys:
            with self.client.pipeline() as p:
                for k in keys:
                    p.strlen(self.prefix + k)
                self._sizes = dict(zip(keys, p.execute()))

    def put(self, key: str, value: bytes) -> None:
        self.client.set(self.prefix + key, value)
        with self._lock:
            self._sizes[key] = len(value)

    def get(self, key: str) -> bytearray | None:
        value = self.client.get(self.prefix + key)
        if value is None:
            with self._lock:
                self._sizes.pop(key, None)
            return None
        return bytearray(value)  # writable: tensors parsed from it are views of it

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + key)
        with self._lock:
            self._sizes.pop(key, None)

    def keys(self) -> list[str]:
        n = len(self.prefix)
        return [k.decode()[n:] for k in self.client.scan_iter(match=self.prefix + "*", count=1000)]

    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def capacity_bytes(self) -> int:
        return self.capacity
