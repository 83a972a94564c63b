"""Custom system prompts' exact prefix KV: a few recent ones, salted by namespace, inside the KV budget.

    prefixes.get(head, namespace)   # the PrefixKV of a prompt head (computed on a miss, then kept)
    prefixes.has(head, namespace)   # cached? (else the scheduler computes it on its side worker first)
    prefixes.shrink(max_bytes)      # admission: the cache gives way to a request that needs the budget

Keyed like chunk KV (`Parts.kv_key_of`: model, token ids, the namespace's salt): a tenant never gets, and
never times, another tenant's entry (one entry for all only with RAGCACHE_SHARE_ACROSS_NAMESPACES). What it
holds (`nbytes`) counts against RAGCACHE_KV_BUDGET_BYTES, at most an eighth of it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from blend import compute_prefix
from blend.prompt import as_ids

HEAD = "prompt-head"  # the context of a prompt head's key: it starts the sequence, behind nothing


class PrefixCache:
    def __init__(self, parts, max_entries: int = 8):
        self.p, self.max_entries = parts, max_entries
        self._entries: OrderedDict[str, object] = OrderedDict()  # salted key → PrefixKV, least recent first
        self._lock = threading.Lock()  # the prep thread, the side worker and admission all touch it
        self.nbytes = 0

    @property
    def max_bytes(self) -> int:
        return self.p.settings.kv_budget_bytes // 8

    def _key(self, head: list[int], namespace: str) -> str:
        return self.p.kv_key_of(as_ids(head), namespace, context=HEAD)

    def has(self, head: list[int], namespace: str) -> bool:
        key = self._key(head, namespace)
        with self._lock:
            return key in self._entries

    def get(self, head: list[int], namespace: str):
        key = self._key(head, namespace)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        kv = compute_prefix(self.p.runner, as_ids(head))
        size = kv.k.nbytes + kv.v.nbytes
        with self._lock:
            if key in self._entries or size > self.max_bytes:  # computed twice at once, or too big to keep
                return self._entries.get(key, kv)
            self._entries[key] = kv
            self.nbytes += size
            self._evict(lambda: len(self._entries) > self.max_entries or self.nbytes > self.max_bytes)
        return kv

    def shrink(self, max_bytes: int) -> None:
        """Least recent entries leave until the cache holds at most `max_bytes`."""
        with self._lock:
            self._evict(lambda: self.nbytes > max(0, max_bytes))

    def _evict(self, over) -> None:
        while self._entries and over():
            _, kv = self._entries.popitem(last=False)
            self.nbytes -= kv.k.nbytes + kv.v.nbytes
