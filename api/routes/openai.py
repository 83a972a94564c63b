"""OpenAI-compatible: POST /v1/chat/completions (streaming too) and GET /v1/models.

The last user message is the query (retrieval runs on it); earlier turns follow the passages in
the prompt's suffix; a system message replaces the configured system prompt (its own exact
prefix, cached). Retrieval options ride in an extra `rag` object; the response carries the
retrieved chunks, usage split into reused/recomputed, and timings in an extra `rag` field.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, Request

from ragcache.serving.generation import Ask

from ..auth import Caller, caller
from ..deps import record, service, start_generation
from ..errors import ApiError, body, documented, from_exception
from ..schemas import ChatRequest
from ..streaming import sse, sse_response

router = APIRouter(tags=["openai"], responses=documented(400, 401, 403, 404, 413, 422, 429, 503))


def model_id(request: Request) -> str:
    spec = service(request).settings.model
    return spec if spec == "smollm2" else Path(spec).name


@router.get("/v1/models")
async def models(request: Request, _who: Caller = Depends(caller)):
    return {"object": "list", "data": [{"id": model_id(request), "object": "model", "created": 0,
                                        "owned_by": "ragcache"}]}


def _bounded(req: ChatRequest, settings) -> None:
    """413 for a conversation past the server's bounds: its turns are tokenized on the prep thread."""
    if len(req.messages) > settings.max_messages:
        raise ApiError(413, f"{len(req.messages)} messages is over this server's limit of {settings.max_messages} "
                            "(RAGCACHE_MAX_MESSAGES)", "messages")
    chars = sum(len(m.content) for m in req.messages)
    if chars > settings.max_message_chars:
        raise ApiError(413, f"the messages hold {chars} characters, over this server's limit of "
                            f"{settings.max_message_chars} (RAGCACHE_MAX_MESSAGE_CHARS)", "messages")


def _ask(req: ChatRequest, who: Caller) -> Ask:
    system = [m.content for m in req.messages if m.role in ("system", "developer")]
    turns = [(m.role, m.content) for m in req.messages if m.role in ("user", "assistant")]
    *history, (_, query) = turns
    if history and history[0][0] != "user":
        raise ApiError(400, "the conversation must start with a user message (after any system message)",
                       "messages")
    rag = req.rag
    return Ask(query, rag.namespace, rag.top_k, rag.mode, rag.recompute_ratio, rag.epic_k,
               req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.seed,
               history=tuple(history), system="\n\n".join(system) if system else None, explain=rag.explain,
               ignore_eos=req.ignore_eos, retrieval=rag.retrieval, rerank=rag.rerank, tenant=who.tenant,
               target_kl=rag.target_kl, stop=req.stop or ())


def _usage(result: dict) -> dict:
    u = result["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _rag(result: dict) -> dict:
    return {k: result[k] for k in ("request_id", "mode", "policy", "chunks", "usage", "timings_ms", "explain")
            if k in result}


def _finish(result: dict) -> str:
    return "length" if result["finish_reason"] == "length" else "stop"


@router.post("/v1/chat/completions",
             description="OpenAI's chat completions; `rag` selects namespace, top_k, mode and its knobs.")
async def chat(req: ChatRequest, request: Request, who: Caller = Depends(caller)):
    who.allow(req.rag.namespace)
    if req.model != model_id(request):
        raise ApiError(404, f"model {req.model!r} is not served here; GET /v1/models lists {model_id(request)!r}",
                       "model")
    _bounded(req, service(request).settings)
    ask = _ask(req, who)
    stream, first = await start_generation(request, ask)
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": cid, "created": created, "model": req.model}
    if not req.stream:
        result = first[1] if first[0] == "done" else await stream.result(request)
        record(request, "/v1/chat/completions", ask, result)
        return {**head, "object": "chat.completion", "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"]},
                             "finish_reason": _finish(result), "logprobs": None}],
                "usage": _usage(result), "rag": _rag(result)}

    usage_too = req.stream_options is not None and req.stream_options.include_usage

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                    **({"usage": None} if usage_too else {}), **extra})

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        async for kind, payload in stream.events(first):
            if kind == "text":
                yield chunk({"content": payload})
            elif kind == "done":
                record(request, "/v1/chat/completions", ask, payload)
                yield chunk({}, _finish(payload), rag=_rag(payload))
                if usage_too:
                    yield sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": [],
                               "usage": _usage(payload)})
            elif kind == "error":
                err = from_exception(payload)
                yield sse(body(err.status, err.message))
        yield sse("[DONE]")

    return sse_response(stream, events())
