"""Compact chunk KV decoded a layer at a time on a thread of its own, while the fused prefill runs.

    chunks = decode_layerwise(entries, dtype, device)   # ChunkKVs at once, their layers still arriving
    fuse_and_prefill(runner, prefix, chunks, ...)        # layer l waits for layer l of every chunk

The recompute starts on layer 0 as soon as layer 0 of every chunk is decoded. Bit for bit what
`codec.decode` gives (the same decoder and conversions, a layer at a time); a frame that fails to
decode is re-raised (CorruptBlob) where the model waits for it.
"""
from __future__ import annotations

import threading

import torch

from blend import ChunkKV
from blend.cores import one_core

from .codec import StoredKV, decode_layer
from .compact import Decoder


class _Arrivals:
    """How many layers of a set of chunks are in; `wait(l)` blocks until layer l is."""

    def __init__(self):
        self._done, self._error = 0, None
        self._cond = threading.Condition()

    def wait(self, layer: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done > layer or self._error is not None)
            if self._done <= layer:
                raise self._error

    def run(self, entries: list[StoredKV], chunks: list[ChunkKV]) -> None:
        one_core()  # a thread a request: a team of its own each time would slow the model thread
        decoder = Decoder()
        try:
            for l in range(entries[0].shape[0]):
                for entry, chunk in zip(entries, chunks):
                    if chunk.k.dtype == torch.float32 and chunk.k.device.type == "cpu":
                        decode_layer(decoder, entry, l, chunk.k[l], chunk.v[l], chunk.noise[l])
                        continue
                    k, v = torch.empty(entry.shape[1:]), torch.empty(entry.shape[1:])  # as `decode`: float32
                    decode_layer(decoder, entry, l, k, v, chunk.noise[l])  # on the CPU first, then converted
                    chunk.k[l].copy_(k)
                    chunk.v[l].copy_(v)
                with self._cond:
                    self._done = l + 1
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 — handed to the waiting model thread
            with self._cond:
                self._error = e
                self._cond.notify_all()


def decode_layerwise(entries: list[StoredKV], dtype: torch.dtype, device: torch.device) -> list[ChunkKV]:
    """Compact entries (same model: same layer count) → their ChunkKVs, decoded layer by layer on a new thread."""
    arrivals = _Arrivals()
    chunks = [ChunkKV(e.token_ids.cpu(), torch.empty(e.shape, dtype=dtype, device=device),
                      torch.empty(e.shape, dtype=dtype, device=device), e.start, e.context, lossless=False,
                      k_pre_rope=True, ready=arrivals, noise=torch.empty(e.shape[0], 2, e.shape[2]))
              for e in entries]
    threading.Thread(target=arrivals.run, args=(entries, chunks), name="kv-layers", daemon=True).start()
    return chunks
