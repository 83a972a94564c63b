"""Precompute jobs: POST /v1/jobs/precompute starts (or joins) one in a child process; GET /v1/jobs/{id}."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request

from ..auth import Caller, caller
from ..deps import service
from ..errors import ApiError, documented
from ..schemas import JobRequest

router = APIRouter(tags=["jobs"], responses=documented(401, 403, 404, 409, 422, 503))


@router.post("/v1/jobs/precompute", status_code=202)
def start(req: JobRequest, request: Request, who: Caller = Depends(caller)):
    who.allow(req.namespace)
    return service(request).jobs.start(req.namespace)


@router.get("/v1/jobs/{job_id}")
def get(request: Request, job_id: int = Path(ge=1, le=2**31 - 1), who: Caller = Depends(caller)):
    job = service(request).jobs.get(job_id)
    if not who.sees(job["namespace"]):  # as unknown as a missing id: enumerating ids tells nothing of others
        raise ApiError(404, f"no job {job_id}")
    return job
