"""The app factory: `create_app(settings)` → a FastAPI app that owns one RagCache and its scheduler.

    ragcache serve --host 127.0.0.1 --port 8000      (uvicorn, see ragcache/cli.py)

At start the side worker loads every part (/health answers at once, /ready once loaded) and resumes the
jobs a killed server left running; at shutdown the model thread stops, precompute children are terminated
(their jobs resume when started again), the store flushes.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from ragcache.config import Settings
from ragcache.serving.scheduler import Scheduler
from ragcache.service import RagCache

from . import errors
from .metrics import Metrics
from .middleware import BodyLimit, CountRequests, InFlight, KeyFirst
from .routes import cache, dashboard, documents, health, jobs, openai, rag


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service = RagCache(settings)
        scheduler = Scheduler(service, settings.max_queue)
        app.state.service, app.state.scheduler = service, scheduler
        app.state.metrics = Metrics(service, scheduler)
        app.state.warm_error = None
        scheduler.submit(lambda _t: _start(service), lambda kind, e: _warmed(app, kind, e))
        try:
            yield
        finally:
            scheduler.close()
            service.close()

    app = FastAPI(title="ragcache", version="0.1.0", lifespan=lifespan,
                  description="RAG serving cache: precomputed chunk KV, stitched and repaired at query time.")
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(KeyFirst, settings=settings)  # before any body is read
    app.add_middleware(InFlight, limit=settings.max_connections)
    app.add_middleware(CountRequests)  # outermost: it counts the 401s, 413s and 503s too
    for module in (rag, openai, documents, jobs, cache, health, dashboard):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC), name="static")
    return app


def _start(service: RagCache) -> None:
    """Every part loaded, then the jobs a server on this home left running resumed: after the store's start
    swept the puts they cut off, and with no child loading a model beside the warm-up."""
    service.warm(None)
    service.jobs.resume()


def _warmed(app: FastAPI, kind: str, payload) -> None:
    if kind == "error":
        app.state.warm_error = f"{type(payload).__name__}: {payload}"
