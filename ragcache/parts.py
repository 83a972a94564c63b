"""The parts every role of the service shares, each loaded on first use, once, thread-safely.

model, runner, tokenizer, chat frame, the system prompt's exact prefix KV, the tiered store,
the embedder, the FAISS and the BM25 indexes. `search` never loads the LLM; a server warms them all at
start so that no request pays a one-time cost.
"""
from __future__ import annotations

import threading
import time

import torch

from blend import ALONE, ChunkKV, PrefixKV, Runner, compute_chunk, compute_prefix, load_model
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

    @part
    def lead(self) -> PrefixKV:
        """The system prompt and RAGCACHE_CHUNK_LEAD after it, as a passage ends: what chunks are computed behind
        with chunk_prefill=lead, so that a chunk's KV has seen a passage before it, as every chunk but a prompt's
        first has."""
        if not self.settings.chunk_lead:
            raise UserError("chunk KV behind a lead passage needs RAGCACHE_CHUNK_LEAD: a passage of the corpus")
        lead = as_ids(encode(self.tokenizer, self.settings.chunk_lead + SEPARATOR))
        return compute_prefix(self.runner, torch.cat([self.prefix.token_ids, lead]))

    def chunk_prefix(self, how: str | None = None) -> PrefixKV | None:
        """What chunk KV is computed behind (`how`: a chunk_prefill choice, the setting's by default)."""
        how = how or self.settings.chunk_prefill
        return None if how == "alone" else self.lead if how == "lead" else self.prefix

    @property
    def chunk_context(self) -> str:
        behind = self.chunk_prefix()
        return behind.key if behind is not None else ALONE

    def kv_key_of(self, token_ids: torch.Tensor, namespace: str) -> str:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = self.db.namespace_salt(namespace, self.settings.share_across_namespaces)
        return kv_key(self.model.fingerprint, token_ids, self.chunk_context, self.kv_dtype, salt)

    def codec_spec(self, name: str | None = None):
        """The compact codec's widths for this model (None: raw); `name` defaults to RAGCACHE_KV_CODEC."""
        return spec_for(name or self.settings.kv_codec, self.runner.num_layers, self.settings.home,
                        self.model.fingerprint)

    @part
    def kv_codec(self):
        return self.codec_spec()

    def store_encode(self, kv: ChunkKV):
        return encode_kv(kv, self.kv_dtype, self.kv_codec, self.runner.inv_freq)

    def compute_chunk_kv(self, token_ids: torch.Tensor) -> ChunkKV:
        return compute_chunk(self.runner, token_ids, self.chunk_prefix())

    def prefill_for_store(self, token_ids: torch.Tensor):
        """(ChunkKV, its stored form) with the measured cost of making it: what evicting it costs."""
        t0 = time.perf_counter()
        kv = self.compute_chunk_kv(token_ids)
        stored = self.store_encode(kv)  # to the CPU: waits for the device too
        stored.cost_s = time.perf_counter() - t0
        return kv, stored

    def close(self) -> None:
        if self.loaded("store"):
            self.store.close()
        self.db.dispose()
