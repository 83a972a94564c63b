"""POST /v1/rag/generate: retrieve, blend, answer; as JSON, or streamed as server-sent events."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ragcache.serving.generation import Ask

from ..auth import Caller, caller
from ..deps import record, start_generation
from ..errors import body, documented, from_exception
from ..schemas import GenerateRequest, GenerateResponse
from ..streaming import sse, sse_response

router = APIRouter(tags=["rag"], responses=documented(400, 401, 403, 404, 413, 422, 429, 503))

STREAM_DOC = ("With `stream: true`: `text/event-stream` of `event: token` (`{\"text\": delta}`) events, then one "
              "`event: done` whose data is the whole response, or `event: error` (`{\"error\": …}`).")


@router.post("/v1/rag/generate", response_model=GenerateResponse, response_model_exclude_none=True,
             description=STREAM_DOC, responses={200: {"content": {"text/event-stream": {}}}})
async def generate(req: GenerateRequest, request: Request, who: Caller = Depends(caller)):
    who.allow(req.namespace)
    ask = Ask(req.query, req.namespace, req.top_k, req.mode, req.recompute_ratio, req.epic_k, req.max_tokens,
              req.temperature, req.top_p, req.seed, explain=req.explain, ignore_eos=req.ignore_eos,
              retrieval=req.retrieval, rerank=req.rerank, tenant=who.tenant, target_kl=req.target_kl,
              stop=req.stop or ())
    stream, first = await start_generation(request, ask)
    if not req.stream:
        result = first[1] if first[0] == "done" else await stream.result(request)
        record(request, "/v1/rag/generate", ask, result)
        return result

    async def events():
        async for kind, payload in stream.events(first):
            if kind == "text":
                yield sse({"text": payload}, "token")
            elif kind == "done":
                record(request, "/v1/rag/generate", ask, payload)
                yield sse(payload, "done")
            elif kind == "error":
                err = from_exception(payload)
                yield sse(body(err.status, err.message), "error")

    return sse_response(stream, events())
