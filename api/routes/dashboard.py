"""The dashboard: GET / (static page), /static/*, and the JSON it reads beyond the other routes:
recent requests and the latest `ragcache eval` run kept in the server's home."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse

from ragcache.errors import UserError
from ragcache.evaluation.results import latest_dir, read_latest

from ..auth import Caller, caller
from ..deps import service
from ..errors import ApiError, documented

STATIC = Path(__file__).resolve().parents[1] / "static"
router = APIRouter(tags=["dashboard"], responses=documented(401, 403, 404, 422, 503))


@router.get("/", include_in_schema=False)
async def page():
    return FileResponse(STATIC / "index.html")


@router.get("/v1/requests/recent")
def recent(request: Request, limit: int = Query(50, ge=1, le=500), who: Caller = Depends(caller)):
    return {"requests": service(request).requests.recent(who.namespaces, limit)}


def _latest(request: Request) -> Path:
    return latest_dir(service(request).settings.home)


@router.get("/v1/eval/latest")
def eval_latest(request: Request, who: Caller = Depends(caller)):
    who.require_admin()  # every eval question and a path of this host: not a tenant's to read
    try:
        results = read_latest(service(request).settings.home)
    except UserError as e:  # a damaged file: said, not a 500 on every poll of the dashboard
        return {"available": False, "error": str(e)}
    if results is None:
        return {"available": False}
    plot = (_latest(request) / "pareto.png").is_file()
    return {"available": True, "results": results, "plot_url": "/v1/eval/latest/pareto.png" if plot else None}


@router.get("/v1/eval/latest/pareto.png", response_class=FileResponse)
def eval_plot(request: Request, who: Caller = Depends(caller)):
    who.require_admin()
    path = _latest(request) / "pareto.png"
    if not path.is_file():
        raise ApiError(404, "no evaluation has run in this server's home: ragcache eval")
    return FileResponse(path, media_type="image/png")
