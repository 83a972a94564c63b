"""One settings object, read from RAGCACHE_* environment variables and validated once."""
from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# measurable against full
EVAL_MODES = ("full", "reuse", "prefix", "cacheblend", "epic", "probe", "adaptive", "a3", "blendq", "deferred")
RATIO_MODES = ("cacheblend", "probe", "a3", "blendq", "deferred")  # whose knob is the share of context rows recomputed
MODES = (*EVAL_MODES, "auto")
MAX_STOPS, STOP_CHARS = 4, 256  # a request's stop strings (OpenAI's `stop`): how many, how long
CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "kv_dtype": ("auto", "float32", "bfloat16", "float16", "int8"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "int8"),
    "decode_weights": ("model", "float16", "int8", "int4"),
    "chunk_prefill": ("prefixed", "lead", "alone"),
    "index_kind": ("flat", "ivf", "hnsw"),
    "retrieval": ("dense", "bm25", "hybrid"),
    "reranker": ("attention", "likelihood"),
    "mode": MODES,
    "eviction": ("gdsf", "lru"),
    "write_policy": ("write-through", "write-back"),
    "admission": ("all", "second-use"),
}
# the blob codecs (store/codecs.py): raw, compact (calibrated), compact-kXvY (+kA:B / -vA:B: one bit more for K /
# one less for V in layers A..B-1, +Ln: one more bit than X, Y in layer n, +gG: K in clipped blocks of G tokens,
# +vN=W: V of layer N at W bits (2..8; K likewise), +r: V rotated, +b: scales at a byte each, +f: K's symbols by
# error feedback against calibrated queries)
KV_CODEC = re.compile(r"raw|compact|compact-k([234])v([234])((?:[+-][kv]\d+:\d+)*)((?:\+L\d+)*)((?:\+[kv]\d+=[2-8])*)"
                      r"(?:\+g([1-9]\d*))?(\+r)?(\+b)?(\+f)?")
KV_CODEC_FORM = ("raw, compact or compact-kXvY[±kA:B][±vA:B][+Ln][+kN=W][+vN=W][+gG][+r][+b][+f] (X, Y in 2..4, W in "
                 "2..8, e.g. compact-k3v3+k16:30+L1+v1=8+g96+b+f)")
DEFAULT_SYSTEM_PROMPT = (
    "You will be asked a question after reading several passages. "
    "Answer it directly from the passages, in a few words. Do not repeat the question."
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGCACHE_", protected_namespaces=())

    home: Path = Path("~/.cache/ragcache")
    model: str = "smollm2"  # "smollm2" (bundled) or a local HF checkpoint directory
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_new_tokens: int = 32  # a request's default
    max_tokens_cap: int = 4096  # the most a request may ask for (more: a 400 naming it)

    # metadata and the tiered KV store
    database_url: str | None = None  # default: a SQLite file in `home`; or postgresql+psycopg://…
    redis_url: str | None = None  # the shared remote tier, off unless set (redis://127.0.0.1:6379/0)
    kv_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16 | float16 | int8
    kv_codec: str = "raw"  # raw (kv_dtype) | compact | compact-kXvY: how disk and Redis blobs are written
    layerwise_load: bool = True  # compact chunk KV decodes a layer at a time beside the fused prefill
    gpu_cache_bytes: int = 8 << 30  # used only when CUDA is present
    cpu_cache_bytes: int = 2 << 30
    disk_cache_bytes: int = 64 << 30
    redis_cache_bytes: int = 4 << 30
    eviction: str = "gdsf"  # lru | gdsf
    write_policy: str = "write-through"  # write-through | write-back
    admission: str = "all"  # all | second-use: which chunks computed at query time are written to disk and Redis
    admission_window: int = 100_000  # second-use: a chunk's second use counts within this many distinct chunks
    orphan_grace_s: float = 60.0  # a blob put unfinished this long was cut off: swept at the next start
    share_across_namespaces: bool = False  # True: one cache entry per text for every tenant
    pin_quota_bytes: int = 0  # what one namespace may pin, in bytes; 0: a quarter of the smallest cache tier

    # corpus, retrieval, precompute
    chunk_tokens: int = 512
    chunk_prefill: str = "lead"  # lead (behind the system prompt and a passage: KV that has seen a passage before
    # it, as nearly every chunk in a prompt has; measured best) | prefixed (behind the system prompt) | alone
    chunk_lead: str = ""  # lead: the passage every chunk is computed behind (never in a prompt); empty: each
    # namespace's own, picked from its chunks (lead.py: a made-up or a short one measured no help)
    index_kind: str = "flat"  # flat | ivf | hnsw
    retrieval: str = "hybrid"  # dense (FAISS) | bm25 | hybrid (both, rank-fused: measured best)
    rerank: int = 0  # > 0: score this many retrieved candidates against their cached KV, keep the best top_k
    reranker: str = "attention"  # attention (the question's attention over a null question's) | likelihood (UPR)
    precompute_batch: int = 8
    lease_seconds: int = 600  # a claimed chunk goes back to the pool if its worker is silent this long
    precompute_attempts: int = 3  # a chunk whose prefill fails this often stays failed (--retry-failed)
    retry_backoff_s: float = 10.0  # first retry delay; doubles with every further failure

    # generation defaults
    top_k: int = 4
    mode: str = "probe"  # full | prefix | reuse | cacheblend | epic | probe | adaptive | a3 | blendq | deferred | auto
    cacheblend_ratio: float = 0.15
    epic_k: int = 16
    probe_ratio: float = 0.1  # probe@0.1 with APE: cacheblend@0.15's speed at 0.4–0.66× its KL (measured)
    deferred_ratio: float = 0.2  # deferred: reuse's first token, then probe@0.2 over the prompt and it (measured)
    probe_layers: int = 0  # probe: the question runs through this many layers first (0: all; 4 at epic's budget)
    ape_temperature: float = 1.0  # APE re-weighting of the question's attention to stale context (off at 1, 1);
    ape_factor: float = 0.5  # on by default: it lowered every mode's teacher-forced KL by 21–35% (measured)

    # serving
    threads: int = 0  # torch threads of this process; 0: every core (less a running job's share)
    job_threads: int = 0  # torch threads of a precompute job the server starts; 0: half the cores
    max_queue: int = 64  # requests waiting for the model beyond this get 429
    # one tenant's share (an API key; the namespace without keys); 0: derived from the global limits
    tenant_max_queue: int = 0  # its waiting requests beyond this get 429; 0: half of max_queue with keys, all of it without
    tenant_max_running: int = 0  # its requests prefilling or decoding at once (more wait); 0: a quarter of max_queue
    tenant_max_tokens: int = 0  # KV rows (prompt + max_tokens) its running requests hold; 0: half the KV budget
    kv_budget_bytes: int = 4 << 30  # fused KV caches of running requests, together; more wait (one alone: 400)
    kv_cache_dtype: str = "auto"  # what running sequences keep their fused KV in: auto (the model's dtype) | float32
    # | bfloat16 | int8 (a float32 scale per layer, head and token); the fused prefill works at the model's dtype
    decode_weights: str = "model"  # the matrices a decode step reads: model (the prefill's) | float16 (a float32
    # model on CPU: a half-size copy fbgemm widens inside its GEMM | int8: a quarter-size copy through fbgemm's
    # dynamic int8 GEMM, its rows quantized too, ~1% error a product | int4: 4-bit groups of 32 (LM head 8-bit),
    # weight-only, lossless for the bundled GGUF, fastest for one sequence; prefill and recompute keep float32)
    max_step_rows: int = 8192  # recomputed rows one scheduler step admits (at least one request; longer: × layers)
    shared_step_rows: int = 64  # the same while more than one tenant is active: a step is short,
    # so one tenant's long prefills delay another's first token by about one short step, not one long one
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    max_connections: int = 256  # requests in flight beyond this get a JSON 503 (open connections past twice this,
    # uvicorn's plain one)
    body_timeout_s: float = 30.0  # a request body that takes longer to arrive gets 408: slow uploads hold nothing
    max_messages: int = 256  # a chat request with more messages gets 413
    max_message_chars: int = 200_000  # characters of a chat request's messages together; more: 413
    api_keys: dict[str, list[str]] = {}  # key → namespaces it may use (JSON); empty: no auth
    admin_key: str | None = None  # reaches every namespace and the whole-cache routes

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'ragcache.db'}"

    @field_validator(*"dtype kv_dtype kv_cache_dtype decode_weights chunk_prefill index_kind retrieval reranker mode "
                      "eviction write_policy admission".split())
    @classmethod
    def _choice(cls, v: str, info: ValidationInfo) -> str:
        allowed = CHOICES[info.field_name]
        if v not in allowed:
            raise ValueError(f"{info.field_name} must be one of {', '.join(allowed)}")
        return v

    @field_validator("chunk_lead")
    @classmethod
    def _lead(cls, v: str) -> str:
        return v.strip()

    @field_validator("kv_codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if not KV_CODEC.fullmatch(v):
            raise ValueError(f"must be {KV_CODEC_FORM}")
        return v

    @property
    def auth(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None

    def job_thread_count(self) -> int:
        cores = os.cpu_count() or 1
        return self.job_threads or max(1, cores // 2)

    def thread_count(self, jobs_running: int = 0, side_work: bool = False) -> int:
        """This process's torch threads: the setting, else every core not lent to running jobs; one fewer while
        `side_work` (the server's side worker runs an item: an ingest's Python keeps a core busy)."""
        cores = os.cpu_count() or 1
        n = self.threads or max(1, cores - jobs_running * self.job_thread_count())
        return max(1, n - side_work)

    @field_validator("chunk_tokens", "precompute_batch", "top_k", "lease_seconds", "max_new_tokens", "max_queue",
                     "precompute_attempts",
                     "max_tokens_cap",
                     "max_body_bytes", "kv_budget_bytes", "max_step_rows", "shared_step_rows", "admission_window",
                     "max_connections", "body_timeout_s", "max_messages", "max_message_chars")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("gpu_cache_bytes", "cpu_cache_bytes", "disk_cache_bytes", "redis_cache_bytes", "epic_k",
                     "threads", "job_threads", "retry_backoff_s", "orphan_grace_s", "probe_layers", "rerank",
                     "pin_quota_bytes", "tenant_max_queue", "tenant_max_running", "tenant_max_tokens")
    @classmethod
    def _nonneg(cls, v: float) -> float:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for key, namespaces in v.items():
            if len(key) < 8 or not namespaces:
                raise ValueError("each key needs 8+ characters and at least one namespace")
        return v

    @field_validator("admin_key")
    @classmethod
    def _admin(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 8:
            raise ValueError("needs 8+ characters")
        return v

    @field_validator("ape_temperature", "ape_factor")
    @classmethod
    def _ape(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("cacheblend_ratio", "probe_ratio", "deferred_ratio")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError("must be in [0, 1]")
        return v
