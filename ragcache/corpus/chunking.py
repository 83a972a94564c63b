"""Documents from files, and documents → token chunks with the model's tokenizer.

Formats: JSONL (`{"id", "title", "text"}` a line), the MuSiQue/CacheBlend JSON (each ctx a
document), or a folder of .txt / .md files. A document under the limit is one chunk; longer
ones are cut at word boundaries. A chunk's tokens are its text (after the title line, if any)
followed by a blank line, the separator between passages in a prompt.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Document:
    external_id: str
    title: str
    text: str

    @property
    def text_hash(self) -> str:
        return hashlib.sha256(f"{self.title}\x00{self.text}".encode()).hexdigest()


@dataclass(frozen=True)
class ChunkSpec:
    ordinal: int
    text: str  # what the prompt shows (title line included)
    token_ids: list[int]  # text + SEPARATOR


def read_documents(path: Path) -> list[Document]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        if not files:
            raise UserError(f"{path} holds no .txt or .md files")
        return [Document(str(p.relative_to(path)), p.stem, p.read_text(errors="replace")) for p in files]
    if not path.is_file():
        raise UserError(f"{path} not found")
    readers = {".jsonl": _read_jsonl, ".json": _read_musique}
    if path.suffix not in readers:
        raise UserError(f"{path}: expected a .jsonl or .json file or a folder of .txt/.md files")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path} cannot be read as UTF-8 text: {e}") from None
    docs = readers[path.suffix](path, text)
    if not docs:
        raise UserError(f"{path} holds no documents")
    return docs


def _read_jsonl(path: Path, text: str) -> list[Document]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or "id" not in row:
            raise UserError(f'{path}:{n}: each line needs "id" and a string "text"')
        docs.append(Document(str(row["id"]), str(row.get("title") or ""), row["text"]))
    return docs


def _read_musique(path: Path, text: str) -> list[Document]:
    try:
        data = json.loads(text)
        ctxs = [c for item in data for c in item["ctxs"]]
        docs = {}
        for c in ctxs:
            doc = Document("", str(c.get("title") or ""), str(c["text"]))
            docs.setdefault(doc.text_hash, Document(f"ctx-{doc.text_hash[:16]}", doc.title, doc.text))
        return list(docs.values())
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f'{path}: expected a list of {{"question", "answers", "ctxs": [{{"title", "text"}}]}} '
                        f"({type(e).__name__}: {e})") from None


def chunk_document(tokenizer, doc: Document, max_tokens: int) -> list[ChunkSpec]:
    """Greedy token windows of at most `max_tokens` (title and separator included), cut where a
    word starts; a single word longer than a window is the only thing ever cut mid-word."""
    head = f"{doc.title}\n" if doc.title else ""
    overhead = len(_encode(tokenizer, head + SEPARATOR)) + 2
    budget = max(16, max_tokens - overhead)
    enc = tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n = len(offsets)
    starts_word = [i == 0 or doc.text[offsets[i][0] - 1 : offsets[i][0]].isspace()
                   or doc.text[offsets[i][0] : offsets[i][0] + 1].isspace() for i in range(n)]
    pieces, start = [], 0
    while start < n:
        end = min(start + budget, n)
        if end < n:
            cut = next((b for b in range(end, start + budget // 2, -1) if starts_word[b]), end)
            end = cut
        text = doc.text[offsets[start][0] : offsets[end - 1][1]].strip()
        if text:
            pieces.append(text)
        start = end
    chunks = []
    for piece in pieces or [doc.text.strip()]:
        body = head + piece
        chunks.append(ChunkSpec(len(chunks), body, _encode(tokenizer, body + SEPARATOR)))
    return chunks


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
