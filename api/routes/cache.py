"""Cache admin: lookup, pin, unpin and evict chunks of a namespace; evict a whole tier and read
per-tier statistics with the admin key."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ragcache.store.pins import PinQuotaExceeded

from ..auth import Caller, caller
from ..deps import service
from ..errors import ApiError, documented
from ..schemas import ChunkSelector, EvictRequest

router = APIRouter(tags=["cache"], responses=documented(400, 401, 403, 404, 409, 413, 422, 503))


@router.post("/v1/cache/lookup")
def lookup(sel: ChunkSelector, request: Request, who: Caller = Depends(caller)):
    who.allow(sel.namespace)
    return {"chunks": service(request).cache.lookup(sel.namespace, sel.chunk_ids, sel.doc_id)}


@router.post("/v1/cache/pin")
def pin(sel: ChunkSelector, request: Request, who: Caller = Depends(caller)):
    who.allow(sel.namespace)
    try:
        return {"chunks": service(request).cache.pin(sel.namespace, sel.chunk_ids, sel.doc_id, True)}
    except PinQuotaExceeded as e:  # nothing pinned; the message names the quota and its setting
        raise ApiError(409, str(e), param="doc_id" if sel.doc_id is not None else "chunk_ids") from None


@router.post("/v1/cache/unpin")
def unpin(sel: ChunkSelector, request: Request, who: Caller = Depends(caller)):
    who.allow(sel.namespace)
    return {"chunks": service(request).cache.pin(sel.namespace, sel.chunk_ids, sel.doc_id, False)}


@router.post("/v1/cache/evict")
def evict(req: EvictRequest, request: Request, who: Caller = Depends(caller)):
    cache = service(request).cache
    if req.tier is not None:
        who.require_admin()
        return cache.evict_tier(req.tier)
    namespace = req.namespace or "default"
    who.allow(namespace)
    return cache.evict(namespace, req.chunk_ids, req.doc_id)


@router.get("/v1/cache/stats")
def stats(request: Request, who: Caller = Depends(caller)):
    who.require_admin()
    return service(request).cache.stats()
