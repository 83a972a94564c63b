"""The last few hundred requests a server answered, for the dashboard's table and waterfalls."""
from __future__ import annotations

import threading
from collections import deque


class RequestLog:
    def __init__(self, size: int = 500):
        self._rows: deque[dict] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def recent(self, namespaces: set[str] | None = None, limit: int = 50) -> list[dict]:
        """Newest first; `namespaces` limits them to a tenant's (None: all)."""
        with self._lock:
            rows = list(self._rows)
        rows = [r for r in reversed(rows) if namespaces is None or r.get("namespace") in namespaces]
        return rows[:limit]
