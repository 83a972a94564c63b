"""The small interface every tier has. Memory tiers hold decoded `StoredKV`; blob tiers hold bytes."""
from __future__ import annotations

from typing import Protocol


class StoreFull(Exception):
    """A durable tier has no room even after evicting every unpinned entry."""


class StoreError(Exception):
    """No blob tier could take an entry that had to be durable."""


class Tier(Protocol):
    name: str  # "gpu", "cpu", "disk", "redis": what `generate` reports as a chunk's source
    holds_blobs: bool  # True: values are checksummed bytes (disk, redis); False: StoredKV objects

    def put(self, key: str, value) -> None: ...
    def get(self, key: str): ...  # the value, or None
    def contains(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def capacity_bytes(self) -> int: ...
    # memory tiers also have used_bytes() -> int; blob tiers have store_id (their row in blob_stores:
    # what they hold and use is kept in SQL, see ledger.py) and ping() -> None, raising when unreachable
