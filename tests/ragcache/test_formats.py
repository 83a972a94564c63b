"""Real files in, structure-aware chunks out: a PDF, a DOCX, an HTML page and a Markdown file, each written here
(reportlab, python-docx, plain strings) with headings, a list and a table; and bad files, each with its own error."""
from __future__ import annotations

import difflib
import io
import re

import pytest

from ragcache.corpus.chunking import SEPARATOR, Document, chunk_document, chunk_documents
from ragcache.corpus.readers import read_documents

INTRO = [f"The harbour of Velmora was dredged in {1900 + i} by engineer number {i}, who kept careful notes. "
         f"Ships of deeper draught could then reach the inner quay, and trade grew for a decade." for i in range(14)]
LATER = ["Shipping declined after the railway reached the coast.", "The quay is now a museum."]
ITEMS = ["grain from the plains", "timber from the hills", "salt from the marshes"]
TABLE = [["Year", "Ships", "Tonnes"], ["1910", "412", "88000"], ["1920", "530", "121000"]]
TITLE = "Velmora Harbour"


def _source_words() -> list[str]:
    rows = [c for row in TABLE for c in row]
    return _words(" ".join([TITLE, "History", *INTRO, "Trade", *ITEMS, "Cargo", *rows, "Decline", *LATER]))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _pdf(path):
    from reportlab.lib.styles import getSampleStyleSheet
    from reportlab.platypus import ListFlowable, ListItem, PageBreak, Paragraph, SimpleDocTemplate, Table

    ss = getSampleStyleSheet()
    story = [Paragraph(TITLE, ss["Title"]), Paragraph("History", ss["Heading1"]),
             *[Paragraph(p, ss["BodyText"]) for p in INTRO], Paragraph("Trade", ss["Heading1"]),
             ListFlowable([ListItem(Paragraph(i, ss["BodyText"])) for i in ITEMS], bulletType="bullet"),
             Paragraph("Cargo", ss["Heading2"]), Table(TABLE), PageBreak(), Paragraph("Decline", ss["Heading1"]),
             *[Paragraph(p, ss["BodyText"]) for p in LATER]]
    SimpleDocTemplate(str(path), title=TITLE).build(story)


def _docx(path):
    from docx import Document

    doc = Document()
    doc.core_properties.title = TITLE
    doc.add_heading(TITLE, 0)
    doc.add_heading("History", 1)
    for p in INTRO:
        doc.add_paragraph(p)
    doc.add_heading("Trade", 1)
    for i in ITEMS:
        doc.add_paragraph(i, style="List Bullet")
    doc.add_heading("Cargo", 2)
    table = doc.add_table(rows=0, cols=3)
    for row in TABLE:
        for cell, text in zip(table.add_row().cells, row):
            cell.text = text
    doc.add_heading("Decline", 1)
    for p in LATER:
        doc.add_paragraph(p)
    doc.save(str(path))


def _html(path):
    rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in TABLE)
    path.write_text(f"<html><head><title>{TITLE}</title><script>var tracking = 1;</script></head><body>"
                    "<nav><a href='/'>Home</a> <a href='/about'>About us</a></nav>"
                    f"<h1>{TITLE}</h1><h2>History</h2>" + "".join(f"<p>{p}</p>" for p in INTRO)
                    + "<h2>Trade</h2><ul>" + "".join(f"<li>{i}</li>" for i in ITEMS) + "</ul>"
                    + f"<h3>Cargo</h3><table>{rows}</table><h2>Decline</h2>"
                    + "".join(f"<p>{p}</p>" for p in LATER) + "<footer>Copyright notice</footer></body></html>")


def _markdown(path):
    table = "\n".join("| " + " | ".join(r) + " |" for r in TABLE[:1]) + "\n|---|---|---|\n" + "\n".join(
        "| " + " | ".join(r) + " |" for r in TABLE[1:])
    path.write_text(f"# {TITLE}\n\n## History\n\n" + "\n\n".join(INTRO) + "\n\n## Trade\n\n"
                    + "\n".join(f"- {i}" for i in ITEMS) + f"\n\n### Cargo\n\n{table}\n\n## Decline\n\n"
                    + "\n\n".join(LATER) + "\n")


WRITERS = {"report.pdf": _pdf, "report.docx": _docx, "report.html": _html, "report.md": _markdown}


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("limit", [96, 512])
def test_each_format_chunks_along_its_structure(name, limit, tmp_path, smollm):
    path = tmp_path / name
    WRITERS[name](path)
    [doc] = read_documents(path).documents
    chunks = chunk_document(smollm.tokenizer, doc, limit)
    assert all(len(c.token_ids) <= limit for c in chunks)
    got = [w for c in chunks for w in _words(c.text)]
    source = _source_words()
    matched = sum(b.size for b in difflib.SequenceMatcher(None, source, got, autojunk=False).get_matching_blocks())
    assert matched / len(source) >= 0.98, (matched, len(source))
    with_table = [c for c in chunks if "88000" in c.text or "121000" in c.text]
    assert with_table
    for c in with_table:  # every piece of the table under its heading (the chunk's, or a line of its own)
        lines = c.text.split("\n")
        first_row = next(i for i, line in enumerate(lines) if "|" in line)
        assert any("Cargo" in line for line in lines[:first_row]), c.text
    history = [c for c in chunks if "dredged" in c.text]
    assert all(c.heading.endswith("History") and c.text.split("\n")[0].endswith("History") for c in history)
    assert "Home" not in " ".join(c.text for c in chunks) and "tracking" not in " ".join(c.text for c in chunks)
    if name.endswith(".pdf"):
        assert history[0].page == 1 and [c for c in chunks if "museum" in c.text][0].page == 2
    if limit == 512:
        assert len(chunks) <= 4  # sections merge up to the limit: few seams
    for c in history:  # paragraphs that fit are never cut
        assert all(line in INTRO for line in c.text.split("\n")[1:] if line and "History" not in line), c.text


def test_many_documents_chunk_at_once_as_each_does_alone(tmp_path, smollm):
    """An ingest chunks its documents together, their texts tokenized a batch at a time and each once: every
    document gets the chunks it gets alone, and each chunk's ids are its text's."""
    tok = smollm.tokenizer
    for name, write in WRITERS.items():
        write(tmp_path / name)
    docs = [d for name in sorted(WRITERS) for d in read_documents(tmp_path / name).documents]
    long = " ".join(f"Clause {i} of the charter, as amended, binds the harbour board." for i in range(60))
    docs += [Document("long", "Charter", long), Document("again", "Charter", long), Document("short", "", "Paris.")]
    for limit in (96, 512):
        together = chunk_documents(tok, docs, limit)
        assert together == [chunk_document(tok, d, limit) for d in docs]
        assert together[-3] == together[-2] and len(together[-3]) > 1  # cut at sentences, shared texts
        for c in (c for chunks in together for c in chunks):
            assert c.token_ids == tok(c.text + SEPARATOR, add_special_tokens=False)["input_ids"]


def _image_only_pdf(path):
    from PIL import Image
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path))
    c.drawImage(ImageReader(Image.new("RGB", (40, 20), "gray")), 100, 600, 200, 100)
    c.showPage()
    c.save()


def _encrypted_pdf(path, tmp_path):
    from pypdf import PdfReader, PdfWriter

    _pdf(tmp_path / "plain.pdf")
    writer = PdfWriter(clone_from=PdfReader(tmp_path / "plain.pdf"))
    writer.encrypt("s3cret")
    buf = io.BytesIO()
    writer.write(buf)
    path.write_bytes(buf.getvalue())


def test_bad_files_each_get_their_own_error_and_the_rest_is_read(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    _markdown(folder / "good.md")
    _html(folder / "sub" / "good.html")
    _image_only_pdf(folder / "scan.pdf")
    _encrypted_pdf(folder / "locked.pdf", tmp_path)
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog >> garbage")
    (folder / "broken.docx").write_bytes(b"PK\x03\x04 not really a zip")
    (folder / "data.xyz").write_text("what is this")
    (folder / ".hidden.md").write_text("# skipped")
    reading = read_documents(folder)
    assert [d.external_id for d in reading.documents] == ["good.md", "sub/good.html"]
    errors = dict(e.split(": ", 1) for e in reading.errors)
    assert set(errors) == {"scan.pdf", "locked.pdf", "broken.pdf", "broken.docx", "data.xyz"}
    assert "no text layer" in errors["scan.pdf"]
    assert "encrypted" in errors["locked.pdf"] and "password" in errors["locked.pdf"]
    assert "cannot be read as PDF" in errors["broken.pdf"] or "no text" in errors["broken.pdf"]
    assert "cannot be read as DOCX" in errors["broken.docx"]
    assert "unsupported type '.xyz'" in errors["data.xyz"]
