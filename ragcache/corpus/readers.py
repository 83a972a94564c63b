"""Paths and uploads → documents, with one error per file that cannot be read.

A path is a file or a folder of mixed files (searched recursively, dot files skipped). Each file is
its documents: a `.jsonl` (`{"id", "title", "text"}` a line) or a MuSiQue/CacheBlend `.json` holds
many; a PDF, DOCX, HTML, Markdown or text file is one, with its structure (`formats`), named by its
path under the folder. A folder's bad file (encrypted, image-only, corrupt, of an unknown type) is
reported and the rest read; a single bad file is a UserError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .body import problem
from .chunking import Document
from .formats import FormatError, read_blocks


@dataclass
class Reading:
    documents: list[Document] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "name: why", one per file not read


def read_documents(path: Path) -> Reading:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"{path} holds no files")
        reading = Reading()
        for p in files:
            name = str(p.relative_to(path))
            try:
                reading.documents += read_file(name, p.read_bytes())
            except OSError as e:
                reading.errors.append(f"{name}: cannot be read ({e.strerror})")
            except UserError as e:
                reading.errors.append(f"{name}: {e}")
        return reading
    if not path.is_file():
        raise UserError(f"{path} not found")
    try:
        return Reading(read_file(path.name, path.read_bytes()))
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror})") from None
    except FormatError as e:
        raise UserError(f"{path}: {e}") from None


def read_file(name: str, data: bytes) -> list[Document]:
    """The documents of one file named `name` (a folder path or an upload's file name)."""
    suffix = Path(name).suffix.lower()
    if suffix in (".jsonl", ".json"):
        try:
            text = data.decode()
        except UnicodeDecodeError as e:
            raise FormatError(f"cannot be read as UTF-8 text ({e.reason} at byte {e.start})") from None
        docs = _read_jsonl(name, text) if suffix == ".jsonl" else _read_musique(name, text)
        if not docs:
            raise FormatError("holds no documents")
        return docs
    title, blocks = read_blocks(name, data)
    return [_storable(Document.of_blocks(name, title, blocks))]


def _storable(doc: Document, where: str | None = None) -> Document:
    """`doc`, or a FormatError naming what SQL cannot take (body.problem: a NUL, a lone surrogate, an id past its
    column), after `where` in a file of many documents."""
    if (wrong := problem(doc.external_id, doc.title, doc.text)) is not None:
        raise FormatError(" ".join(wrong) if where is None else f"{where}: {' '.join(wrong)}")
    return doc


def _read_jsonl(name: str, text: str) -> list[Document]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FormatError(f"line {n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or "id" not in row:
            raise FormatError(f'line {n}: each line needs "id" and a string "text"')
        docs.append(_storable(Document(str(row["id"]), str(row.get("title") or ""), row["text"]), f"line {n}"))
    return docs


def _read_musique(name: str, text: str) -> list[Document]:
    try:
        data = json.loads(text)
        ctxs = [c for item in data for c in item["ctxs"]]
        docs = {}
        for i, c in enumerate(ctxs):
            doc = _storable(Document("ctx", str(c.get("title") or ""), str(c["text"])), f"passage {i}")  # id below
            docs.setdefault(doc.text_hash, Document(f"ctx-{doc.text_hash[:16]}", doc.title, doc.text))
        return list(docs.values())
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise FormatError(f'expected a list of {{"question", "answers", "ctxs": [{{"title", "text"}}]}} '
                          f"({type(e).__name__}: {e})") from None
