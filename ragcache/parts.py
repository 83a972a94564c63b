"""The parts every role of the service shares, each loaded on first use, once, thread-safely.

model, runner, tokenizer, chat frame, the system prompt's exact prefix KV, the tiered store,
the embedder, the FAISS and the BM25 indexes. `search` never loads the LLM; a server warms them all at
start so that no request pays a one-time cost.
"""
from __future__ import annotations

import threading
import time

import torch

from blend import ALONE, ChunkKV, PrefixKV, Runner, compute_chunk, compute_prefix, ids_key, load_model
from blend.prompt import SEPARATOR, as_ids, chat_frame, encode, stop_token_ids

from .config import Settings
from .database import Database
from .errors import UserError
from .store import encode as encode_kv
from .store import kv_key, open_store
from .store.admission import Admission
from .store.codecs import spec_for


class part:
    """`functools.cached_property` whose first computation holds the owner's lock: two threads
    never build one part twice (cached_property has no lock since Python 3.12)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            pass
        with obj._parts_lock:
            if self.name not in obj.__dict__:
                obj.__dict__[self.name] = self.fn(obj)
            return obj.__dict__[self.name]


class Parts:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or Settings()
        self.settings.home.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.settings.db_url)
        self._parts_lock = threading.RLock()
        self._salts: dict[str, str] = {}  # namespace → key salt; never changes once created
        self._leads: dict[str, str] = {}  # namespace → its lead passage (chunk_prefill=lead); never changes either
        self._lead_kv: dict[str, PrefixKV] = {}  # lead passage → the prefix KV chunks are computed behind
        self._lead_keys: dict[str, str] = {}  # lead passage → that prefix's key, known without computing it

    def loaded(self, name: str) -> bool:
        return name in self.__dict__

    @part
    def model(self):
        s = self.settings
        return load_model(s.model, s.home, s.device, s.dtype)

    @part
    def runner(self) -> Runner:
        return Runner(self.model, self.settings.decode_weights)

    @part
    def tokenizer(self):
        return self.model.tokenizer

    @part
    def frame(self):
        return chat_frame(self.tokenizer, self.settings.system_prompt)

    @part
    def prefix(self):
        """The system prompt's KV: an exact prefix cache shared by every request."""
        return compute_prefix(self.runner, as_ids(self.frame.head))

    @part
    def stops(self) -> frozenset[int]:
        return stop_token_ids(self.tokenizer, self.model.config)

    @part
    def store(self):
        return open_store(self.settings, self.db)

    @part
    def admission(self) -> Admission:
        return Admission(self.settings.admission, self.settings.admission_window)

    @part
    def embedder(self):
        from index import Embedder

        return Embedder()

    @part
    def index(self):
        from index import VectorIndex

        return VectorIndex(self.settings.home / "index", self.embedder.dim, self.settings.index_kind)

    @part
    def lexical(self):
        """Per-namespace BM25 indexes, in memory: filled from SQL by the first search that needs one."""
        from index import LexicalIndex

        return LexicalIndex()

    @property
    def kv_dtype(self) -> str:
        d = self.settings.kv_dtype
        return str(self.model.dtype).removeprefix("torch.") if d == "auto" else d

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What a running sequence keeps its fused KV in (RAGCACHE_KV_CACHE_DTYPE)."""
        d = self.settings.kv_cache_dtype
        return self.model.dtype if d == "auto" else getattr(torch, d)

    def lead_text(self, namespace: str | None) -> str:
        """chunk_prefill=lead: RAGCACHE_CHUNK_LEAD, else the namespace's own lead passage (lead.py: picked
        from its chunks at the first need, then kept in SQL; one for all with caching shared across namespaces)."""
        if self.settings.chunk_lead:
            return self.settings.chunk_lead
        ns = "" if self.settings.share_across_namespaces else namespace
        if ns not in self._leads:
            from .lead import namespace_lead

            self._leads[ns] = namespace_lead(self.db, ns, self.embedder.embed)
        return self._leads[ns]

    def lead(self, text: str) -> PrefixKV:
        """The system prompt and a lead passage after it, as a passage ends: what chunks are computed behind with
        chunk_prefill=lead, so that a chunk's KV has seen a passage before it, as every chunk but a prompt's first
        has. The last few computed are kept."""
        with self._parts_lock:
            if text in self._lead_kv:
                return self._lead_kv[text]
        kv = compute_prefix(self.runner, self._lead_ids(text))
        with self._parts_lock:
            self._lead_kv[text] = kv
            while len(self._lead_kv) > 4:
                del self._lead_kv[next(iter(self._lead_kv))]
        return kv

    def _lead_ids(self, text: str) -> torch.Tensor:
        """(P,) the system prompt's tokens, then the lead's as a passage ends."""
        return torch.cat([as_ids(self.frame.head), as_ids(encode(self.tokenizer, text + SEPARATOR))])

    def _lead_key(self, text: str) -> str:
        if text not in self._lead_keys:
            self._lead_keys[text] = ids_key(self._lead_ids(text))
        return self._lead_keys[text]

    def chunk_prefix(self, namespace: str | None = None, how: str | None = None,
                     lead: str | None = None) -> PrefixKV | None:
        """What chunk KV is computed behind: nothing (`alone`), the system prompt (`prefixed`), or it and a lead
        passage (`lead`: the one given, else the namespace's). `how`: a chunk_prefill choice, the setting's by
        default."""
        how = how or self.settings.chunk_prefill
        if how != "lead":
            return None if how == "alone" else self.prefix
        if lead is None and namespace is None and not self.settings.chunk_lead:
            raise UserError("chunk KV behind a lead passage needs a namespace to take it from, or RAGCACHE_CHUNK_LEAD")
        return self.lead(lead or self.lead_text(namespace))

    def kv_key_of(self, token_ids: torch.Tensor, namespace: str, context: str | None = None) -> str:
        """The store's key of these tokens' KV in `namespace` (computed behind its chunk prefix, unless `context`
        names another)."""
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = self.db.namespace_salt(namespace, self.settings.share_across_namespaces)
        if context is None:  # what chunk_prefix(namespace).key is, without computing a lead's KV
            how = self.settings.chunk_prefill
            context = ALONE if how == "alone" else self.prefix.key if how == "prefixed" else \
                self._lead_key(self.lead_text(namespace))
        return kv_key(self.model.fingerprint, token_ids, context, self.kv_dtype, salt)

    def codec_spec(self, name: str | None = None):
        """The compact codec's widths for this model (None: raw); `name` defaults to RAGCACHE_KV_CODEC."""
        return spec_for(name or self.settings.kv_codec, self.runner.num_layers, self.settings.home,
                        self.model.fingerprint)

    @part
    def kv_codec(self):
        return self.codec_spec()

    def store_encode(self, kv: ChunkKV):
        return encode_kv(kv, self.kv_dtype, self.kv_codec, self.runner.inv_freq)

    def compute_chunk_kv(self, token_ids: torch.Tensor, namespace: str) -> ChunkKV:
        return compute_chunk(self.runner, token_ids, self.chunk_prefix(namespace))

    def prefill_for_store(self, token_ids: torch.Tensor, namespace: str):
        """(ChunkKV, its stored form) with the measured cost of making it: what evicting it costs."""
        t0 = time.perf_counter()
        kv = self.compute_chunk_kv(token_ids, namespace)
        stored = self.store_encode(kv)  # to the CPU: waits for the device too
        stored.cost_s = time.perf_counter() - t0
        return kv, stored

    def close(self) -> None:
        if self.loaded("store"):
            self.store.close()
        self.db.dispose()
