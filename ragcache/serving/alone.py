"""A batch that raises is tried again one item at a time, so that only an item that fails alone fails.

    ran = each_alone(items, run, fail)   # [(item, its result)] of those that ran; fail(item, error) for the rest

`run(batch)` returns one result per item of `batch`, in order (a list, or a tensor's rows). The scheduler's
prefill and decode steps and the repair after a first token all run this way.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


def each_alone(items: Sequence[T], run: Callable[[Sequence[T]], Any],
               fail: Callable[[T, Exception], None]) -> list[tuple[T, Any]]:
    try:
        return list(zip(items, run(items)))
    except Exception as e:  # noqa: BLE001 — alone, each item fails or runs on its own
        if len(items) > 1:
            return [pair for item in items for pair in each_alone([item], run, fail)]
        fail(items[0], e)
        return []
