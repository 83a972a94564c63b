"""Lines per tenant, served in turn: one tenant's flood waits behind its own requests, never before others'.

    lines = RoundRobin()
    lines.put("tenant-a", item)
    for key, head in lines.heads():    # each tenant with something waiting, whose turn first
        lines.take(key)                # its head leaves; the tenant goes to the back of the turn

A RoundRobin is not thread-safe: its owner holds a lock around every call. `Inbox` is one with its lock,
for a thread that takes from it.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Hashable, Iterator


class RoundRobin:
    def __init__(self):
        self._lines: dict[Hashable, deque] = {}
        self._turns: deque[Hashable] = deque()  # the keys with a non-empty line, whose turn first

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def __iter__(self) -> Iterator[Any]:
        return (item for line in self._lines.values() for item in line)

    def put(self, key: Hashable, item: Any) -> None:
        if key not in self._lines:
            self._lines[key] = deque()
            self._turns.append(key)
        self._lines[key].append(item)

    def heads(self) -> list[tuple[Hashable, Any]]:
        """(key, the head of its line) of every key, in turn order: a snapshot, safe to `take` from."""
        return [(key, self._lines[key][0]) for key in self._turns]

    def take(self, key: Hashable) -> Any:
        """The head of `key`'s line; the key goes to the back of the turn (or leaves it, its line empty)."""
        line = self._lines[key]
        item = line.popleft()
        self._turns.remove(key)
        if line:
            self._turns.append(key)
        else:
            del self._lines[key]
        return item

    def pop(self) -> Any:
        """The head of the line whose turn it is."""
        return self.take(self._turns[0])

    def remove_if(self, cond: Callable[[Any], bool]) -> list:
        """Every item `cond` holds for leaves its line; returns them."""
        gone = []
        for key in list(self._lines):
            kept = deque()
            for item in self._lines[key]:
                (gone if cond(item) else kept).append(item)
            if kept:
                self._lines[key] = kept
            else:
                del self._lines[key]
                self._turns.remove(key)
        return gone


class Inbox:
    """A RoundRobin for one consumer thread: `put` from any thread, `get` waits; None once closed."""

    def __init__(self):
        self._lines = RoundRobin()
        self._wake = threading.Condition()
        self._closed = False

    def put(self, key: Hashable, item: Any) -> None:
        with self._wake:
            self._lines.put(key, item)
            self._wake.notify()

    def get(self) -> Any:
        with self._wake:
            while not self._lines and not self._closed:
                self._wake.wait()
            return self._lines.pop() if self._lines else None

    def close(self) -> list:
        """What was still in it; `get` answers None from now on."""
        with self._wake:
            left = self._lines.remove_if(lambda _x: True)
            self._closed = True
            self._wake.notify_all()
        return left
