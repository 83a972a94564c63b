"""GPU and CPU tiers: decoded entries in a dict (CPU entries pinned when a GPU exists)."""
from __future__ import annotations

import threading

import torch

from .codec import StoredKV


class MemoryTier:
    holds_blobs = False

    def __init__(self, name: str, device: str, capacity: int):
        self.name, self.device, self.capacity = name, torch.device(device), capacity
        self.pin = self.device.type == "cpu" and torch.cuda.is_available()
        self._entries: dict[str, StoredKV] = {}
        self._used = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: StoredKV) -> None:
        value = value.to(self.device, pin=self.pin) if value.k is not None and (value.k.device != self.device or self.pin) else value
        with self._lock:
            old = self._entries.pop(key, None)
            self._used += value.nbytes - (old.nbytes if old is not None else 0)
            self._entries[key] = value

    def get(self, key: str) -> StoredKV | None:
        return self._entries.get(key)

    def contains(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes

    def keys(self) -> list[str]:
        return list(self._entries)

    def used_bytes(self) -> int:
        return self._used

    def capacity_bytes(self) -> int:
        return self.capacity
