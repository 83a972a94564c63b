"""Documents: POST /v1/documents (a JSON list, {"documents": [...]}, a JSONL body, or files as
multipart/form-data: PDF, DOCX, HTML, Markdown, text, .jsonl, MuSiQue .json), then a precompute job
unless `precompute=false`; GET and DELETE /v1/documents/{id}."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from ragcache.corpus.body import json_problem, parse_body
from ragcache.corpus.chunking import Document
from ragcache.errors import Conflict, UserError

from ..auth import Caller, caller
from ..deps import on_side_worker, service
from ..errors import ApiError, documented
from ..schemas import DocId, NamespaceName

NamespaceQuery = Annotated[NamespaceName, Query()]
DocPath = Annotated[DocId, Path()]
router = APIRouter(tags=["documents"], responses=documented(401, 403, 404, 413, 422, 429, 503))

_DOC = {"type": "object", "required": ["id", "text"],
        "properties": {"id": {"type": "string"}, "title": {"type": "string"}, "text": {"type": "string", "minLength": 1}}}
_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"oneOf": [{"type": "array", "items": _DOC, "minItems": 1},
                                              {"type": "object", "required": ["documents"],
                                               "properties": {"documents": {"type": "array", "items": _DOC,
                                                                            "minItems": 1}},
                                               "additionalProperties": False}]}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one JSON document a line"}},
    "multipart/form-data": {"schema": {"type": "object", "properties": {"files": {
        "type": "array", "items": {"type": "string", "format": "binary"},
        "description": "PDF, DOCX, HTML, Markdown, text, .jsonl or MuSiQue .json files; each is named by its "
                       "file name, and one that cannot be read is listed in `errors`"}}}}}}}


@router.post("/v1/documents", openapi_extra=_BODY,
             description="Ingest documents into a namespace, then (unless precompute=false) start a precompute job.")
async def add_documents(request: Request, namespace: NamespaceQuery = "default", precompute: bool = True,
                        who: Caller = Depends(caller)):
    who.allow(namespace)
    content_type = request.headers.get("content-type", "application/json")
    svc, errors = service(request), []
    if content_type.startswith("multipart/form-data"):
        docs, errors = await _files(request)
        report = await on_side_worker(request, lambda: svc.corpus.ingest_documents(docs, namespace, apart=True))
    elif not svc.corpus.apart(len(raw := await request.body())):  # parsed here: a bad body's 422 waits on no queue
        docs = await run_in_threadpool(parse_body, raw, content_type)
        report = await on_side_worker(request, lambda: svc.corpus.ingest_documents(docs, namespace))
    else:  # parsed where it is ingested, in the ingest process
        report = await on_side_worker(request, lambda: svc.corpus.ingest_body(raw, content_type, namespace))
    job, job_error = None, None
    if precompute and report.chunks_added:
        try:
            job = await run_in_threadpool(svc.jobs.start, namespace)
        except Conflict as e:  # the documents are in; only their precompute has to wait
            job_error = str(e)
    return {"namespace": namespace,
            "documents": {"added": report.added, "unchanged": report.unchanged, "replaced": report.replaced,
                          "staged": report.staged},
            "chunks": {"added": report.chunks_added, "removed": report.chunks_removed}, "job": job,
            "job_error": job_error, "errors": errors}


async def _files(request: Request) -> tuple[list[Document], list[str]]:
    """Every uploaded file's documents, and "name: why" for each file that cannot be read."""
    async with request.form() as form:
        uploads = [((v.filename or "").strip() or "upload", await v.read())
                   for _key, v in form.multi_items() if not isinstance(v, str)]
    if not uploads:
        raise ApiError(422, "a multipart body needs at least one file", "files")
    corpus = service(request).corpus  # read on the side worker as the ingest is: the model thread gives it a core
    read = await on_side_worker(request, lambda: [_read(corpus, name, data) for name, data in uploads])
    docs, errors = [], []
    for (name, _), found in zip(uploads, read):
        if isinstance(found, str):
            errors.append(f"{name}: {found}")
        else:
            docs += found
    ids = [d.external_id for d in docs]
    if len(set(ids)) != len(ids):
        raise ApiError(422, "document ids (file names) repeat within the request", "files")
    if not docs:
        raise ApiError(422, "no file could be read: " + "; ".join(errors), "files")
    return docs, errors


def _read(corpus, name: str, data: bytes) -> list[Document] | str:
    """The file's documents (a large file's read in the ingest process), or why it cannot be read."""
    try:
        found = corpus.read_file(name, data)
    except UserError as e:
        return str(e)
    except (ValueError, RecursionError) as e:  # its JSON: an integer too long, arrays nested too deep
        return f"cannot be read ({json_problem(e)})"
    return found  # each storable as a JSON document's fields are (`readers.read_file`)


@router.get("/v1/documents/{doc_id:path}")
def get_document(doc_id: DocPath, request: Request, namespace: NamespaceQuery = "default",
                 who: Caller = Depends(caller)):
    who.allow(namespace)
    return service(request).corpus.document(namespace, doc_id)


@router.delete("/v1/documents/{doc_id:path}")
def delete_document(doc_id: DocPath, request: Request, namespace: NamespaceQuery = "default",
                    who: Caller = Depends(caller)):
    who.allow(namespace)
    return service(request).corpus.delete_document(namespace, doc_id)
