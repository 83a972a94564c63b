"""One file's bytes → its title and its blocks (paragraphs, list items, tables), each under its heading path.

PDF through pypdf's text layer (headings are the lines set larger than the body text; a line of
separate cells is a table row), DOCX through python-docx (Heading/Title styles, tables in body
order), HTML through lxml (h1–h6, paragraphs, list items, tables; scripts, styles and navigation
dropped), Markdown through markdown-it-py, plain text by blank lines. A file that cannot be read
raises FormatError naming why: an encrypted or image-only PDF, a corrupt file, an unknown type.
"""
from __future__ import annotations

import io
import re
from collections import Counter
from pathlib import PurePath

from ..errors import UserError
from .chunking import Block

SUFFIXES = (".pdf", ".docx", ".html", ".htm", ".md", ".markdown", ".txt")
_MARKER = re.compile(r"^(\d{1,3}[.)]?|[^\w\s])$")  # a list item's number or bullet, set apart from its text


class FormatError(UserError):
    """This one file cannot be ingested; the message says why (the rest of a folder goes on)."""


def read_blocks(name: str, data: bytes) -> tuple[str, list[Block]]:
    """(title, blocks) of a file named `name`; the title defaults to the file's stem."""
    suffix = PurePath(name).suffix.lower()
    readers = {".pdf": _pdf, ".docx": _docx, ".html": _html, ".htm": _html, ".md": _markdown,
               ".markdown": _markdown, ".txt": _text}
    if suffix not in readers:
        raise FormatError(f"unsupported type {suffix or '(no suffix)'!r}: use one of {', '.join(SUFFIXES)}, "
                          ".jsonl or a MuSiQue .json")
    try:
        title, blocks = readers[suffix](data)
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 — each library has its own errors; every one means a bad file
        raise FormatError(f"cannot be read as {suffix[1:].upper()} ({type(e).__name__}: {e})") from None
    blocks = [b for b in blocks if b.text.strip()]
    if not blocks:
        raise FormatError("holds no text")
    return title or PurePath(name).stem, blocks


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FormatError(f"cannot be read as UTF-8 text ({e.reason} at byte {e.start})") from None


def _text(data: bytes) -> tuple[str, list[Block]]:
    return "", [Block(p.strip()) for p in re.split(r"\n\s*\n", _utf8(data)) if p.strip()]


class _Outline:
    """The heading path as headings arrive: a heading of level n replaces levels ≥ n."""

    def __init__(self):
        self.levels: list[tuple[int, str]] = []

    def enter(self, level: int, text: str) -> None:
        self.levels = [(lv, t) for lv, t in self.levels if lv < level] + [(level, " ".join(text.split()))]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(t for _, t in self.levels)


# ---- PDF ----------------------------------------------------------------------------------------

def _pdf(data: bytes) -> tuple[str, list[Block]]:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):  # an owner password alone still opens
        raise FormatError("is an encrypted PDF: a password is needed to read it")
    lines = []  # (page, y, size, [(x, text)])
    for number, page in enumerate(reader.pages, 1):
        frags = []

        def visit(text, cm, tm, _font, size, frags=frags):
            text = "".join(ch if ch.isprintable() else " " for ch in text)  # a symbol font's bullet is a control code
            if text.strip():
                scale = abs(tm[3] * cm[3]) or 1.0
                frags.append((round(cm[5] + tm[5] * abs(cm[3]), 1), cm[4] + tm[4], size * scale, text.strip()))

        page.extract_text(visitor_text=visit)
        rows: list[list] = []  # top to bottom; fragments within a third of their size in height share a line
        for f in sorted(frags, key=lambda f: -f[0]):
            if rows and rows[-1][0][0] - f[0] <= 0.35 * f[2]:
                rows[-1].append(f)
            else:
                rows.append([f])
        for row in rows:
            row.sort(key=lambda f: f[1])
            lines.append((number, row[0][0], max(f[2] for f in row), [(f[1], f[3]) for f in row]))
    if not lines:
        raise FormatError("has no text layer (an image-only or scanned PDF: OCR is not supported)")
    meta = reader.metadata
    title = str(meta.title) if meta is not None and meta.title else ""
    return title, _pdf_blocks(lines)


def _pdf_blocks(lines: list) -> list[Block]:
    """Lines → blocks: larger-than-body lines with letters are headings (level by size), lines of
    several cells are table rows, other lines join into paragraphs split at wider gaps and page ends."""
    body = Counter(round(size) for _, _, size, _ in lines).most_common(1)[0][0]
    sizes = sorted({round(s) for _, _, s, cells in lines if _is_heading(s, body, cells)}, reverse=True)
    outline, blocks = _Outline(), []
    para, table, last = [], [], None  # last: (page, y, size) of the previous line

    def flush():
        if para:
            blocks.append(Block(" ".join(para), outline.path, last[0]))
        if table:
            blocks.append(Block("\n".join(table), outline.path, last[0], is_table=True))
        para.clear(), table.clear()

    for page, y, size, cells in lines:
        if _is_heading(size, body, cells):
            flush()
            outline.enter(sizes.index(round(size)) + 1, " ".join(t for _, t in cells))
        else:
            if len(cells) > 1 and _MARKER.match(cells[0][1]) and not cells[0][1][0].isdigit():
                cells = cells[1:]  # a bullet carries no words
            row = len(cells) > 1 and not _MARKER.match(cells[0][1])
            gap = last is not None and not row and last[1] - y > 1.5 * size  # wider than a line: a new paragraph
            if last is not None and (page != last[0] or gap or bool(table) != row):
                flush()
            (table if row else para).append(" | ".join(t for _, t in cells) if row
                                           else " ".join(t for _, t in cells))
        last = (page, y, size)
    flush()
    return blocks


def _is_heading(size: float, body: int, cells) -> bool:
    text = " ".join(t for _, t in cells)
    return round(size) >= 1.15 * body and len(cells) == 1 and sum(c.isalpha() for c in text) >= 2 and len(text) < 200


# ---- DOCX ---------------------------------------------------------------------------------------

def _docx(data: bytes) -> tuple[str, list[Block]]:
    from docx import Document as Docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    doc = Docx(io.BytesIO(data))
    outline, blocks = _Outline(), []
    for item in doc.iter_inner_content():
        if isinstance(item, Table):
            rows = [" | ".join(c.text.strip() for c in row.cells) for row in item.rows]
            blocks.append(Block("\n".join(rows), outline.path, is_table=True))
        elif isinstance(item, Paragraph) and item.text.strip():
            style = (item.style.name if item.style is not None else "") or ""
            level = _heading_level(style)
            if level is not None:
                outline.enter(level, item.text)
            elif "List" in style:
                blocks.append(Block("- " + item.text.strip(), outline.path))
            else:
                blocks.append(Block(item.text.strip(), outline.path))
    return doc.core_properties.title or "", blocks


def _heading_level(style: str) -> int | None:
    if style == "Title":
        return 0
    m = re.fullmatch(r"Heading (\d)", style)
    return int(m[1]) if m else None


# ---- HTML ---------------------------------------------------------------------------------------

_SKIP = {"script", "style", "nav", "header", "footer", "aside", "noscript", "template", "form"}
_PARAS = {"p", "li", "pre", "blockquote", "dt", "dd", "figcaption", "address"}


def _html(data: bytes) -> tuple[str, list[Block]]:
    import lxml.html

    root = lxml.html.document_fromstring(data)
    title = " ".join((root.findtext(".//title") or "").split())
    body = root.find("body")
    outline, blocks = _Outline(), []
    _walk_html(root if body is None else body, outline, blocks)
    return title, blocks


def _walk_html(el, outline: _Outline, blocks: list[Block]) -> None:
    for child in el:
        tag = child.tag if isinstance(child.tag, str) else ""
        if tag in _SKIP or not tag:
            continue
        if re.fullmatch(r"h[1-6]", tag):
            outline.enter(int(tag[1]), child.text_content())
        elif tag == "table":
            rows = [" | ".join(" ".join(c.text_content().split()) for c in tr.xpath("./th|./td"))
                    for tr in child.iter("tr")]
            blocks.append(Block("\n".join(r for r in rows if r.strip(" |")), outline.path, is_table=True))
        elif tag in _PARAS and not child.xpath(".//p|.//table|.//ul|.//ol|.//h1|.//h2|.//h3|.//h4"):
            text = " ".join(child.text_content().split())
            blocks.append(Block(("- " if tag == "li" else "") + text, outline.path))
        else:
            loose = " ".join((child.text or "").split())
            if loose and tag not in ("ul", "ol", "tr"):
                blocks.append(Block(loose, outline.path))
            _walk_html(child, outline, blocks)
        tail = " ".join((child.tail or "").split())
        if tail:
            blocks.append(Block(tail, outline.path))


# ---- Markdown -----------------------------------------------------------------------------------

def _markdown(data: bytes) -> tuple[str, list[Block]]:
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(_utf8(data))
    outline, blocks = _Outline(), []
    table: list[list[str]] = []
    in_heading, in_item = 0, 0
    for t in tokens:
        if t.type == "heading_open":
            in_heading = int(t.tag[1])
        elif t.type == "list_item_open":
            in_item += 1
        elif t.type == "list_item_close":
            in_item -= 1
        elif t.type == "tr_open":
            table.append([])
        elif t.type == "table_close":
            blocks.append(Block("\n".join(" | ".join(r) for r in table), outline.path, is_table=True))
            table = []
        elif t.type == "inline":
            if in_heading:
                outline.enter(in_heading, t.content)
                in_heading = 0
            elif table:
                table[-1].append(t.content.strip())
            else:
                blocks.append(Block(("- " if in_item else "") + t.content.strip(), outline.path))
        elif t.type in ("fence", "code_block"):
            blocks.append(Block(t.content.rstrip(), outline.path))
    return "", blocks
