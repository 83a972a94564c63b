"""GET /health (the process answers), GET /ready (model loaded, database and tiers reachable),
GET /metrics (Prometheus)."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from ..deps import service

router = APIRouter(tags=["health"])


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "not ready: `checks` says what is missing"}})
def ready(request: Request):
    svc = service(request)
    checks = {"model": svc.loaded("prefix") and svc.loaded("index")}
    try:
        with svc.db.session() as s:
            s.execute(text("SELECT 1"))
        checks["database"] = True
    except Exception:  # noqa: BLE001 — any failure means not ready
        checks["database"] = False
    if svc.loaded("store"):
        checks.update({f"tier:{name}": ok for name, ok in svc.store.health().items()})
    ok = all(checks.values())
    out = {"ready": ok, "checks": checks}
    if request.app.state.warm_error:
        out["error"] = request.app.state.warm_error
    return JSONResponse(out, status_code=200 if ok else 503)


@router.get("/metrics")
def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
