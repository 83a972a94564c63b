"""Disk tier: one safetensors blob per entry under RAGCACHE_HOME/kv/, written temp → fsync → rename.

A directory is one store, named by the id in its STORE_ID file: every process of a host that uses
the directory shares it, another host's directory is another store. What it holds and how full it is
are kept in SQL (ledger.py); nothing here lists or stats the blobs at start.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import uuid
from pathlib import Path

SUFFIX = ".safetensors"
_ID = re.compile(r"[A-Za-z0-9_-]{1,59}")  # what `_identity` writes: a uuid4 hex
log = logging.getLogger("ragcache.store")


class DiskTier:
    name = "disk"
    holds_blobs = True

    def __init__(self, root: Path, capacity: int):
        self.root, self.capacity = Path(root), capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self.store_id = f"disk:{self._identity()}"

    def _identity(self) -> str:
        """The directory's store id, written by the first process to open it. A STORE_ID that holds no
        id (damaged, truncated) names a store no row can be found for any more: the directory is
        adopted as a new store and its blobs swept, rather than failing every request."""
        path = self.root / "STORE_ID"
        with open(self.root / ".STORE_ID.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process names (or re-names) the directory at a time
            try:
                found = path.read_bytes().decode("ascii", "replace").strip()
            except FileNotFoundError:
                found = None
            if found is not None and _ID.fullmatch(found):
                return found
            if found is not None:
                log.warning("%s is damaged: %s is adopted as a new store, its blobs swept", path, self.root)
                for blob in self.root.glob(f"*/*{SUFFIX}"):
                    blob.unlink(missing_ok=True)
            new = uuid.uuid4().hex
            tmp = self.root / f".STORE_ID.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(new)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return new

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old blob or the whole new one
        except BaseException:  # a full disk (ENOSPC), an I/O error: what was written would hold its space
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself is durable
        finally:
            os.close(dir_fd)

    def get(self, key: str) -> bytearray | None:
        """The blob as a bytearray: tensors parsed from it are writable views, no copy."""
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                f.readinto(buf)
                return buf
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_partial(self, key: str) -> None:
        """A put that died: its blob and any temp file it left."""
        self.delete(key)
        for tmp in self._path(key).parent.glob(f".{key}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Every blob in the directory (a listing: for inspection, never on a request's path)."""
        return [p.name[: -len(SUFFIX)] for p in self.root.glob(f"*/*{SUFFIX}")]

    def capacity_bytes(self) -> int:
        return self.capacity

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OSError(f"{self.root} is not writable")
