"""Disk tier: one safetensors blob per entry under RAGCACHE_HOME/kv/, written temp → fsync → rename."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

SUFFIX = ".safetensors"


class DiskTier:
    name = "disk"
    holds_blobs = True

    def __init__(self, root: Path, capacity: int):
        self.root, self.capacity = Path(root), capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes = {p.name[: -len(SUFFIX)]: p.stat().st_size for p in self.root.glob(f"*/*{SUFFIX}")}

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old blob or the whole new one
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself is durable
        finally:
            os.close(dir_fd)
        with self._lock:
            self._sizes[key] = len(value)

    def get(self, key: str) -> bytearray | None:
        """The blob as a bytearray: tensors parsed from it are writable views, no copy."""
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                f.readinto(buf)
                return buf
        except FileNotFoundError:
            with self._lock:
                self._sizes.pop(key, None)
            return None

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        with self._lock:
            self._sizes.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._sizes)

    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def capacity_bytes(self) -> int:
        return self.capacity

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OSError(f"{self.root} is not writable")

    def sweep(self, known: set[str], grace_s: float) -> int:
        """Delete temp files and blobs without a metadata row, older than `grace_s` (another
        process may be between its rename and its commit). Returns how many were removed."""
        removed, now = 0, time.time()
        for p in list(self.root.glob("*/.*.tmp")) + list(self.root.glob(f"*/*{SUFFIX}")):
            key = p.name[: -len(SUFFIX)] if p.name.endswith(SUFFIX) else None
            if key in known:
                continue
            try:
                if now - p.stat().st_mtime >= grace_s:
                    p.unlink()
                    removed += 1
                    with self._lock:
                        self._sizes.pop(key, None)
            except FileNotFoundError:
                pass
        return removed
