"""Request and response bodies (pydantic): what /openapi.json documents and every route validates."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from ragcache.config import CHOICES, MAX_STOPS, MODES, STOP_CHARS
from ragcache.corpus.body import DOC_ID_CHARS, storable, valid_text

Mode = Literal[MODES]  # type: ignore[valid-type]
Retrieval = Literal[CHOICES["retrieval"]]  # type: ignore[valid-type]
RowId = Annotated[int, Field(ge=1, le=2**31 - 1)]  # a SQL integer key

NamespaceName = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(storable)]
DocId = Annotated[str, Field(min_length=1, max_length=DOC_ID_CHARS), AfterValidator(storable)]


StopString = Annotated[str, Field(min_length=1, max_length=STOP_CHARS), AfterValidator(valid_text)]
STOP_STRING = {"type": "string", "minLength": 1, "maxLength": STOP_CHARS}


def _listed(v):
    return [v] if isinstance(v, str) else v


# a string or a list of them (OpenAI's two forms), validated as one list: an error names `stop` or `stop.N`, never
# the branch of a union that pydantic tried last
Stops = Annotated[tuple[StopString, ...], Field(max_length=MAX_STOPS), BeforeValidator(_listed),
                  WithJsonSchema({"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING,
                                                          "maxItems": MAX_STOPS}]})] | None
STOP = (f"up to {MAX_STOPS} strings: the answer ends before the first one it writes, which is not part of it "
        "(OpenAI's stop)")


TARGET_KL = ("auto, adaptive: serve the mode (auto) or coverage (adaptive) `ragcache calibrate` measured fastest "
             "within this mean teacher-forced KL of full prefill (nats)")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(Strict):
    query: str = Field(min_length=1, max_length=20000)
    namespace: NamespaceName = "default"
    top_k: int | None = Field(default=None, ge=1, le=64)
    mode: Mode | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1,
                                          description="cacheblend, probe, a3, blendq, deferred (its repair after the "
                                                      "first token): share of context rows recomputed")
    epic_k: int | None = Field(default=None, ge=0, le=4096, description="epic: tokens recomputed per chunk")
    target_kl: float | None = Field(default=None, ge=0, le=100, description=TARGET_KL)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20, description="the model's context bounds it")
    temperature: float = Field(default=0.0, ge=0, le=5)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    explain: bool = Field(default=False, description="token strings, chunk spans, recomputed rows, deviations")
    ignore_eos: bool = Field(default=False, description="decode max_tokens tokens whatever the model says")
    stop: Stops = Field(default=None, description=STOP)
    retrieval: Retrieval | None = Field(default=None, description="dense, bm25 or hybrid; default RAGCACHE_RETRIEVAL")
    rerank: int | None = Field(default=None, ge=0, le=64,
                               description="rerank this many candidates on their cached KV (by the server's "
                                           "RAGCACHE_RERANKER: attention, or query likelihood)")


class Chunk(BaseModel):
    id: int
    doc_id: str
    score: float
    tier: str
    heading: str = Field(default="", description="the chunk's heading path in its document, ' > '-joined")
    page: int | None = Field(default=None, description="its first page, in a PDF")


class Usage(BaseModel):
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    retrieve: float
    load: float
    queue: float = Field(default=0.0, description="waiting for the KV budget and a scheduler step")
    blend: float
    ttft: float
    repair: float = Field(default=0.0, description="deferred: the repair after the first token (part of decode)")
    decode: float
    total: float


class GenerateResponse(BaseModel):
    request_id: str
    answer: str
    mode: str
    policy: str = Field(description="what served it, knobs and APE included: probe@0.1+ape@1,0.5")
    finish_reason: str
    chunks: list[Chunk]
    usage: Usage
    timings_ms: Timings
    explain: dict | None = None


TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
             "required": ["type", "text"]}
TEXT_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}  # what `content` takes


def _joined(content):
    """OpenAI's list of content parts → their text, joined; text parts only, or a 422 names the first other one."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f'part {i} must be an object {{"type": "text", "text": "..."}}')
        if (kind := part.get("type")) != "text":
            raise ValueError(f"part {i} is of type {kind!r}: this server reads text parts only")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: its text must be a string")
        texts.append(part["text"])
    return "".join(texts)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    # a string or text parts, read as one string; it reaches the tokenizer: no lone surrogate
    content: Annotated[str, BeforeValidator(_joined), AfterValidator(valid_text), WithJsonSchema(TEXT_PARTS)]
    name: str | None = None


class RagOptions(Strict):
    namespace: NamespaceName = "default"
    top_k: int | None = Field(default=None, ge=1, le=64)
    mode: Mode | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1)
    epic_k: int | None = Field(default=None, ge=0, le=4096)
    target_kl: float | None = Field(default=None, ge=0, le=100, description=TARGET_KL)
    explain: bool = False
    retrieval: Retrieval | None = None
    rerank: int | None = Field(default=None, ge=0, le=64)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """OpenAI's chat.completions body; unknown fields are ignored as OpenAI-compatible servers do, but for RAG
    options: those go in `rag`, and one at the top level is a 422 naming it."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float = Field(default=0.0, ge=0, le=2, description="default 0: greedy")
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    stop: Stops = Field(default=None, description=STOP)
    ignore_eos: bool = False
    rag: RagOptions = Field(default_factory=RagOptions)

    @model_validator(mode="before")
    @classmethod
    def _rag_options_in_rag(cls, data):
        """Other unknown fields are ignored, but not a RAG option at the top level: ignored, `"namespace": "x"`
        there would answer from the default namespace without a word."""
        misplaced = sorted(set(data) & (set(RagOptions.model_fields) - set(cls.model_fields))) \
            if isinstance(data, dict) else []
        if misplaced:
            raise ValueError(f'"{misplaced[0]}" is a RAG option: it goes inside "rag" ({{"rag": {{"{misplaced[0]}": '
                             '...}}), and at the top level it would be ignored')
        return data

    @model_validator(mode="after")
    def _last_is_user(self):
        if self.messages[-1].role != "user":
            raise ValueError("the last message must be the user's question")
        if not self.messages[-1].content.strip():
            raise ValueError("the last user message is empty")
        return self


class JobRequest(Strict):
    namespace: NamespaceName | None = Field(default=None, description="None: every namespace (admin key only)")


class ChunkSelector(Strict):
    namespace: NamespaceName = "default"
    chunk_ids: list[RowId] | None = Field(default=None, min_length=1, max_length=10000)
    doc_id: DocId | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.chunk_ids is None) == (self.doc_id is None):
            raise ValueError("name either chunk_ids or doc_id")
        return self


class EvictRequest(Strict):
    namespace: NamespaceName | None = None
    chunk_ids: list[RowId] | None = Field(default=None, min_length=1, max_length=10000)
    doc_id: DocId | None = None
    tier: Literal["gpu", "cpu", "disk", "redis"] | None = Field(default=None, description="admin: empty a tier")

    @model_validator(mode="after")
    def _one(self):
        if (self.tier is None) == (self.chunk_ids is None and self.doc_id is None):
            raise ValueError("name a tier, or chunk_ids or doc_id (with their namespace)")
        if self.chunk_ids is not None and self.doc_id is not None:
            raise ValueError("name either chunk_ids or doc_id")
        return self


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None


class ErrorBody(BaseModel):
    """Every 4xx and 5xx: `{"error": {"message", "type", "param"}}`, OpenAI's shape."""

    error: ErrorDetail
