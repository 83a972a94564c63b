"""A request body of documents: what parses, and each kind of bad body named by its field."""
from __future__ import annotations

import json

import pytest

from ragcache.corpus.body import DOC_ID_CHARS, parse_body
from ragcache.corpus.chunking import Document
from ragcache.errors import Invalid

JSON, LINES = "application/json", "application/x-ndjson"


def test_a_list_an_object_and_json_lines_give_the_same_documents():
    rows = [{"id": 7, "text": "seven", "extra": "ignored"}, {"id": "b", "title": "B", "text": "bee"}]
    want = [Document("7", "", "seven"), Document("b", "B", "bee")]
    assert parse_body(json.dumps(rows).encode(), JSON) == want
    assert parse_body(json.dumps({"documents": rows}).encode(), "application/json; charset=utf-8") == want
    assert parse_body(("\n".join(map(json.dumps, rows)) + "\n\n").encode(), LINES) == want


@pytest.mark.parametrize("body, kind, field, words", [
    (b"\xff\xfe", JSON, "body", "not UTF-8"),
    (b"[{", JSON, "body", "not usable JSON"),
    (b'{"id": 1, "text": "x"}\nnot json', LINES, "line 2", "line 2 is not usable JSON"),
    (b"[]", JSON, "documents", "non-empty list"),
    (b'{"docs": []}', JSON, "docs", "holds only \"documents\""),
    (b'{"documents": [{"id": 1, "text": "x"}], "namespace": "b"}', JSON, "namespace", "?namespace= over HTTP"),
    (b'{"text": "x"}', JSON, "text", "not a field of the body"),
    (b'{}', JSON, "documents", "non-empty list"),
    (b'["text"]', JSON, "documents.0", "JSON object"),
    (b'[{"text": "x"}]', JSON, "documents.0.id", "is required"),
    (b'[{"id": true, "text": "x"}]', JSON, "documents.0.id", "string or an integer"),
    (b'[{"id": "  ", "text": "x"}]', JSON, "documents.0.id", "is empty"),
    (json.dumps([{"id": "x" * (DOC_ID_CHARS + 1), "text": "x"}]).encode(), JSON, "documents.0.id", "over 512"),
    (b'[{"id": "a\\u0000b", "text": "x"}]', JSON, "documents.0.id", "NUL"),
    (b'[{"id": 1}]', JSON, "documents.0.text", "is required"),
    (b'[{"id": 1, "text": "x"}, {"id": 2, "title": 3, "text": "y"}]', JSON, "documents.1.title", "must be a string"),
    (b'[{"id": 1, "text": ["x"]}]', JSON, "documents.0.text", "must be a string"),
    (b'[{"id": 1, "text": "x\\u0000"}]', JSON, "documents.0.text", "NUL"),
    (b'[{"id": "a\\ud800", "text": "x"}]', JSON, "documents.0.id", "lone UTF-16 surrogate (\\ud800 at character 1)"),
    (b'[{"id": 1, "title": "\\udfff", "text": "x"}]', JSON, "documents.0.title", "surrogate"),
    (b'{"id": 1, "text": "ok \\ud83d"}', LINES, "documents.0.text", "surrogate"),  # half of a pair
    (b'[{"id": 1, "text": ""}]', JSON, "documents.0.text", "must not be empty"),
    (b'[{"id": 1, "text": "x"}, {"id": "1", "text": "y"}]', JSON, "documents.id", "repeat"),
])
def test_each_bad_body_is_named_by_its_field(body, kind, field, words):
    with pytest.raises(Invalid) as bad:
        parse_body(body, kind)
    assert bad.value.field == field and words in str(bad.value) and bad.value.usage
