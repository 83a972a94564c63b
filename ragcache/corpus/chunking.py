"""Documents → token chunks with the model's tokenizer, along the document's structure.

A document is a title and blocks (paragraphs, list items, tables), each under its heading path
(`formats` reads them from files; a plain text is its paragraphs). Chunks split on headings and
paragraphs before tokens: blocks of one section are packed together up to the limit; a block over it
is cut at sentence ends (a sentence over it at word starts, a table between rows); a chunk under
`MIN_TOKENS` takes in the subsections that follow it (their heading lines in its text) rather than
leave a small piece to repair at every seam. Every chunk starts with its title and heading path
("Report > Results > 2021") — what is embedded and indexed, and what the prompt shows, so a table
never loses its heading — and ends with a blank line, the separator between passages in a prompt.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from blend.prompt import SEPARATOR  # a chunk's text ends with it

MIN_TOKENS = 128  # a smaller chunk absorbs the subsections after it
_SENTENCE_END = re.compile(r"[.!?…][\"')\]]*\s+")


@dataclass(frozen=True)
class Block:
    text: str
    heading: tuple[str, ...] = ()  # the headings above it, outermost first
    page: int | None = None  # 1-based, PDF only
    is_table: bool = False  # rows a line, cells " | "-separated


@dataclass(frozen=True)
class Document:
    external_id: str
    title: str
    text: str
    blocks: tuple[Block, ...] = ()  # a file's structure; empty: `text` by paragraphs

    @classmethod
    def of_blocks(cls, external_id: str, title: str, blocks: list[Block]) -> "Document":
        """A structured document; its text (what is hashed) holds every heading and block in order."""
        lines, path = [], ()
        for b in blocks:
            if b.heading != path:
                lines.append(" > ".join(b.heading))
                path = b.heading
            lines.append(b.text)
        return cls(external_id, title, "\n\n".join(lines), tuple(blocks))

    @property
    def text_hash(self) -> str:
        return hashlib.sha256(f"{self.title}\x00{self.text}".encode()).hexdigest()


@dataclass(frozen=True)
class ChunkSpec:
    ordinal: int
    text: str  # what the prompt shows (title and heading path line included)
    token_ids: list[int]  # text + SEPARATOR
    heading: str = ""  # the heading path, " > "-joined
    page: int | None = None


@dataclass
class _Draft:
    heading: tuple[str, ...]
    page: int | None
    budget: int
    parts: list[str] = field(default_factory=list)
    tokens: int = 0
    last: tuple[str, ...] = ()  # the heading path of the last block added


class _Tokens:
    """The tokenizer's ids of texts, each encoded once; `prime` encodes many in one call (the fast tokenizer's
    batch: one Python call for thousands, its work in Rust, outside the GIL that the server's requests need)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._ids = tokenizer, {}

    def prime(self, texts) -> None:
        new = list(dict.fromkeys(t for t in texts if t not in self._ids))
        if new:
            self._ids.update(zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]))

    def __call__(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._ids[text]


def chunk_document(tokenizer, doc: Document, max_tokens: int) -> list[ChunkSpec]:
    """Chunks of at most `max_tokens` (title, heading path and separator included)."""
    return chunk_documents(tokenizer, [doc], max_tokens)[0]


def chunk_documents(tokenizer, docs: list[Document], max_tokens: int) -> list[list[ChunkSpec]]:
    """`chunk_document` of each, the same chunks; what it counts is encoded a batch at a time, stage by stage:
    blocks and heads, the sentences of blocks over their budget, the pieces, the chunks' texts."""
    tokens = _Tokens(tokenizer)
    blocks = [_blocks(doc) for doc in docs]
    tokens.prime(t for doc, bs in zip(docs, blocks) for b in bs for t in (b.text, _head(doc.title, b.heading) + SEPARATOR))
    budgets = [[_budget(tokens, doc.title, b.heading, max_tokens) for b in bs] for doc, bs in zip(docs, blocks)]
    tokens.prime(b.text[x:y] for bs, us in zip(blocks, budgets) for b, u in zip(bs, us)
                 if len(tokens(b.text)) > u - 2 for x, y in _spans(b))
    pieces = [[_split(tokens, b, u) for b, u in zip(bs, us)] for bs, us in zip(blocks, budgets)]
    tokens.prime(p for ps in pieces for block in ps for p in block)
    drafts = [_drafts(tokens, *args) for args in zip(blocks, budgets, pieces)]
    tokens.prime(_head(doc.title, d.heading) + "\n\n".join(d.parts) + SEPARATOR
                 for doc, ds in zip(docs, drafts) for d in ds)
    texts = [[(t, d) for d in ds for t in _fit(tokens, _head(doc.title, d.heading), d.parts, max_tokens)]
             for doc, ds in zip(docs, drafts)]
    tokens.prime(t + SEPARATOR for ts in texts for t, _ in ts)  # halved by _fit: rare
    return [[ChunkSpec(i, t, tokens(t + SEPARATOR), " > ".join(d.heading), d.page) for i, (t, d) in enumerate(ts)]
            for ts in texts]


def _blocks(doc: Document) -> tuple[Block, ...]:
    blocks = doc.blocks or tuple(Block(p.strip()) for p in re.split(r"\n\s*\n", doc.text) if p.strip())
    return blocks or (Block(doc.text.strip()),)


def _drafts(tokens: _Tokens, blocks: tuple[Block, ...], budgets: list[int], pieces: list[list[str]]) -> list[_Draft]:
    """A document's blocks (each as its pieces within its budget) packed into drafts of chunks: a section's
    blocks together up to the budget."""
    drafts: list[_Draft] = []
    for block, budget, parts in zip(blocks, budgets, pieces):
        for piece in parts:
            n = len(tokens(piece)) + 2
            cur = drafts[-1] if drafts else None
            if cur is not None and _joins(cur, block.heading):
                line = " > ".join(block.heading[len(cur.heading):]) if block.heading != cur.last else ""
                extra = n + (len(tokens(line)) + 2 if line else 0)
                if cur.tokens + extra <= cur.budget:
                    cur.parts += [line, piece] if line else [piece]
                    cur.tokens, cur.last = cur.tokens + extra, block.heading
                    continue
            drafts.append(_Draft(block.heading, block.page, budget, [piece], n, block.heading))
    return drafts


def _joins(cur: _Draft, heading: tuple[str, ...]) -> bool:
    """The next block may join the open chunk: same section, or a subsection of a chunk still small."""
    return heading == cur.heading or (cur.tokens < MIN_TOKENS and heading[: len(cur.heading)] == cur.heading)


def _head(title: str, heading: tuple[str, ...]) -> str:
    line = " > ".join(t for t in (title, *heading) if t)
    return f"{line}\n" if line else ""


def _budget(tokens: _Tokens, title: str, heading: tuple[str, ...], max_tokens: int) -> int:
    return max(16, max_tokens - len(tokens(_head(title, heading) + SEPARATOR)) - 2)


def _fit(tokens: _Tokens, head: str, parts: list[str], max_tokens: int) -> list[str]:
    """head + parts as one chunk text, halved until each is within the limit (joins can tokenize a
    little longer than their parts counted alone)."""
    text = head + "\n\n".join(parts)
    if len(parts) == 1 or len(tokens(text + SEPARATOR)) <= max_tokens:
        return [text]
    half = len(parts) // 2
    return _fit(tokens, head, parts[:half], max_tokens) + _fit(tokens, head, parts[half:], max_tokens)


def _split(tokens: _Tokens, block: Block, budget: int) -> list[str]:
    """A block as pieces within `budget`: whole if it fits; else a table by rows, a paragraph by
    sentences, and only a sentence (or row) longer than the budget at word starts."""
    limit = budget - 2
    if len(tokens(block.text)) <= limit:
        return [block.text]
    pieces, start, used = [], None, 0
    for a, b in _spans(block):
        n = len(tokens(block.text[a:b])) + 1
        if start is not None and used + n > limit:
            pieces.append(block.text[start:a])
            start = None
        if n > limit:
            pieces += _cut_words(tokens.tokenizer, block.text[a:b], limit)
            continue
        if start is None:
            start, used = a, 0
        used += n
    if start is not None:
        pieces.append(block.text[start:])
    return [p.strip() for p in pieces if p.strip()]


def _spans(block: Block) -> list[tuple[int, int]]:
    """(start, end) of a table's rows or a paragraph's sentences."""
    if block.is_table:
        starts = [m.start() for m in re.finditer(r"^", block.text, re.M)]
    else:
        starts = [0, *(m.end() for m in _SENTENCE_END.finditer(block.text))]
    return list(zip(starts, [*starts[1:], len(block.text)]))


def _cut_words(tokenizer, text: str, budget: int) -> list[str]:
    """Greedy token windows of at most `budget`, cut where a word starts; a single word longer than a
    window is the only thing ever cut mid-word."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    n = len(offsets)
    starts_word = [i == 0 or text[offsets[i][0] - 1 : offsets[i][0]].isspace()
                   or text[offsets[i][0] : offsets[i][0] + 1].isspace() for i in range(n)]
    pieces, start = [], 0
    while start < n:
        end = min(start + budget, n)
        if end < n:
            end = next((b for b in range(end, start + budget // 2, -1) if starts_word[b]), end)
        pieces.append(text[offsets[start][0] : offsets[end - 1][1]])
        start = end
    return pieces

