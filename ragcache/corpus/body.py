"""A request's documents: a JSON list of {"id", "title", "text"}, {"documents": [...]}, or JSON lines → Documents,
each field checked as SQL will store it, what is wrong named by its place (`Invalid.field`: documents.3.text).

One parser for both places a body is read: the API route for a small body (a bad one is answered at once, not
after the ingests queued on the side worker), the ingest process for a large one (a 32 MiB body is ~0.3 s of
Python: there it never holds the server's interpreter lock).
"""
from __future__ import annotations

import json

from ..errors import Invalid
from .chunking import Document

DOC_ID_CHARS = 512  # documents.external_id's width
MISSING = object()  # a field the body left out
NUL = "holds a NUL character, which cannot be stored"


def unpaired(v: str) -> str | None:
    """What is wrong with `v` as text, or None: JSON's \\ud800 escapes let a lone UTF-16 surrogate into a Python
    string, which no UTF-8 column, file or tokenizer takes (a 500 or a tokenizer's internals, were it let through)."""
    try:
        v.encode()
    except UnicodeEncodeError as e:
        return (f"holds a lone UTF-16 surrogate (\\u{ord(v[e.start]):04x} at character {e.start}), which is not a "
                "character: send the text as valid Unicode")
    return None


def valid_text(v: str) -> str:
    """A string that is text: no lone surrogate (pydantic's AfterValidator)."""
    if (why := unpaired(v)) is not None:
        raise ValueError(why)
    return v


def storable(v: str) -> str:
    """A string that reaches SQL: text, and no NUL (PostgreSQL's text cannot hold one: a 500 there, were it let
    through)."""
    if "\x00" in v:
        raise ValueError(NUL)
    return valid_text(v)


def json_problem(e: BaseException | None) -> str | None:
    """What makes a body `json.loads` refused unusable, in words; None when `e` is no such refusal."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}"
    if isinstance(e, RecursionError):
        return "arrays or objects nested too deeply"
    if isinstance(e, ValueError):  # an integer of more digits than Python converts (4300), say
        return str(e).split(";")[0]
    return None


def parse_body(raw: bytes, content_type: str) -> list[Document]:
    """The body's documents, or Invalid naming the first problem (field "body", "line N", "documents.N.text", or a
    key of a {"documents": [...]} object other than "documents": were it ignored, `"namespace": "x"` there would
    put the documents in the default namespace without a word)."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise Invalid("the body is not UTF-8", "body") from None
    if "json" in content_type and "ndjson" not in content_type and "jsonl" not in content_type:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise Invalid(f"the body is not usable JSON ({json_problem(e)})", "body") from None
        if isinstance(data, dict) and (extra := sorted(set(data) - {"documents"})):
            raise Invalid(f'{extra[0]}: not a field of the body, which holds only "documents"; a namespace or any '
                          "other option is given apart from it (?namespace= over HTTP, --namespace on the command "
                          "line)", extra[0])
        rows = data.get("documents") if isinstance(data, dict) else data
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except (ValueError, RecursionError) as e:
                    raise Invalid(f"line {n} is not usable JSON ({json_problem(e)})", f"line {n}") from None
    if not isinstance(rows, list) or not rows:
        raise Invalid('expected a non-empty list of {"id", "title", "text"} documents', "documents")
    docs = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise Invalid(f"documents.{i}: must be a JSON object", f"documents.{i}")
        external_id, title, text = row.get("id", MISSING), row.get("title", ""), row.get("text", MISSING)
        if (found := problem(external_id, title, text)) is not None:
            field, why = found
            raise Invalid(f"documents.{i}.{field}: {why}", f"documents.{i}.{field}")
        docs.append(Document(str(external_id), title, text))
    ids = [d.external_id for d in docs]
    if len(set(ids)) != len(ids):
        raise Invalid("document ids repeat within the request", "documents.id")
    return docs


def problem(external_id: object, title: object, text: object) -> tuple[str, str] | None:
    """(field, what is wrong with it) for a document SQL cannot take as it is; None when it can. Its id a string
    or an integer (written as one), non-blank, up to DOC_ID_CHARS; its title a string; its text a non-empty
    string; none holding NUL or a lone surrogate. MISSING: a field the request left out."""
    if external_id is MISSING:
        return "id", "is required"
    if isinstance(external_id, bool) or not isinstance(external_id, str | int):
        return "id", "must be a string or an integer"
    doc_id = str(external_id)
    if not doc_id.strip():
        return "id", "is empty"
    if len(doc_id) > DOC_ID_CHARS:
        return "id", f"is over {DOC_ID_CHARS} characters"
    if text is MISSING:
        return "text", "is required"
    for field, value in (("id", doc_id), ("title", title), ("text", text)):
        if not isinstance(value, str):
            return field, "must be a string"
        if "\x00" in value:
            return field, NUL
        if (why := unpaired(value)) is not None:
            return field, why
    if not text:
        return "text", "must not be empty"
    return None
