"""Documents → chunks → SQL: word-boundary chunking, stable ids, idempotent re-ingest, replacement."""
from __future__ import annotations

import json
import re
import sqlite3
import threading

import pytest
from sqlalchemy import event, func, select, update

from ragcache.corpus.chunking import SEPARATOR, Document, chunk_document
from ragcache.corpus.readers import read_documents
from ragcache.errors import UserError
from ragcache.corpus.ingest import ingest_documents
from ragcache.corpus.versions import swap_ready
from ragcache.database import SCHEMA_VERSION, Database
from ragcache.meta import Chunk, SchemaInfo
from ragcache.meta import Document as DocRow

from .conftest import pg_database

LONG = " ".join(f"word{i} is followed by another, rather unremarkable, sentence." for i in range(120))


def test_chunks_respect_the_limit_and_word_boundaries(smollm):
    tok = smollm.tokenizer
    chunks = chunk_document(tok, Document("d", "A title", LONG), 64)
    assert len(chunks) > 5
    for c in chunks:
        assert len(c.token_ids) <= 64
        assert c.text.startswith("A title\n")
        body = c.text.split("\n", 1)[1]
        at = LONG.index(body)
        assert at == 0 or LONG[at - 1] == " "  # starts on a word
        assert at + len(body) == len(LONG) or LONG[at + len(body)] == " "  # ends on a word
        assert tok.decode(c.token_ids) == c.text + SEPARATOR
    assert " ".join(c.text.split("\n", 1)[1] for c in chunks) == LONG
    assert chunks == chunk_document(tok, Document("d", "A title", LONG), 64)  # stable


def test_a_short_passage_is_one_chunk(smollm):
    chunks = chunk_document(smollm.tokenizer, Document("d", "", "Paris is the capital of France."), 512)
    assert [c.text for c in chunks] == ["Paris is the capital of France."]


def test_readers_and_their_errors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("alpha")
    (tmp_path / "docs" / "b.txt").write_text("beta")
    assert [d.external_id for d in read_documents(tmp_path / "docs").documents] == ["a.md", "b.txt"]
    good = tmp_path / "c.jsonl"
    good.write_text('{"id": 1, "title": "T", "text": "x"}\n\n{"id": "2", "text": "y"}\n')
    assert [(d.external_id, d.title) for d in read_documents(good).documents] == [("1", "T"), ("2", "")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "x"}\n{"id": 2}\n')
    with pytest.raises(UserError, match="bad.jsonl: line 2"):
        read_documents(bad)
    mus = tmp_path / "m.json"
    mus.write_text(json.dumps([{"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": "same"}] * 2}]))
    assert len(read_documents(mus).documents) == 1  # the same passage twice is one document
    # what SQL cannot store is named where it is (was a traceback, or a 500 over HTTP): a lone surrogate, a NUL
    (tmp_path / "s.jsonl").write_text('{"id": 1, "text": "x"}\n{"id": 2, "text": "half a pair \\ud83d"}\n')
    (tmp_path / "n.json").write_text(json.dumps([{"question": "q", "answers": [], "ctxs": [{"text": "ok"},
                                                                                        {"text": "a\x00b"}]}]))
    (tmp_path / "n.txt").write_bytes(b"a\x00b")
    for name, where in (("s.jsonl", "line 2: text holds a lone UTF-16 surrogate (\\ud83d at character 12)"),
                        ("n.json", "passage 1: text holds a NUL"), ("n.txt", "text holds a NUL")):
        with pytest.raises(UserError, match=re.escape(f"{name}: {where}")):
            read_documents(tmp_path / name)
    with pytest.raises(UserError, match="not found"):
        read_documents(tmp_path / "nope.jsonl")


def test_reingest_is_idempotent_and_a_changed_document_is_replaced(db, smollm):
    tok = smollm.tokenizer
    docs = [Document("a", "", LONG), Document("b", "", "Short text about Paris.")]
    first = ingest_documents(db, tok, ["fp"], docs, "ns", 64)
    assert first.added == 2 and first.chunks_added > 2
    with db.session() as s:
        before = {(c.document_id, c.ordinal): c.id for c in s.scalars(select(Chunk))}
    again = ingest_documents(db, tok, ["fp"], docs, "ns", 64)
    assert (again.added, again.unchanged, again.chunks_added) == (0, 2, 0)
    with db.session() as s:
        assert {(c.document_id, c.ordinal): c.id for c in s.scalars(select(Chunk))} == before
        s.execute(Chunk.__table__.update().where(Chunk.text.like("Short%")).values(state="done", kv_key="k-b"))
    changed = ingest_documents(db, tok, ["fp"], [docs[0], Document("b", "", "Short text about Rome.")], "ns", 64)
    assert (changed.replaced, changed.staged, changed.unchanged) == (1, 1, 1) and changed.orphan_kv_keys == []
    with db.session() as s:  # b's done chunk is served until its successor is done too
        assert {c.text: c.staged for c in s.scalars(select(Chunk).where(Chunk.text.like("Short%")))} == \
            {"Short text about Paris.": False, "Short text about Rome.": True}
        s.execute(Chunk.__table__.update().where(Chunk.staged).values(state="done", kv_key="k-rome"))
    swapped = swap_ready(db, "ns")
    assert swapped.documents == 1 and swapped.orphan_kv_keys == ["k-b"]
    with db.session() as s:
        texts = [(c.text, c.staged) for c in s.scalars(select(Chunk).where(Chunk.text.like("Short%")))]
        assert texts == [("Short text about Rome.", False)]
    pending = ingest_documents(db, tok, ["fp"], [Document("a", "", LONG + " More.")], "ns", 64)
    assert (pending.replaced, pending.staged) == (1, 0)  # nothing of it was retrievable: replaced at once
    assert pending.chunks_removed == first.chunks_added - 1 and len(pending.removed_chunk_ids) == pending.chunks_removed
    other_ns = ingest_documents(db, tok, ["fp"], docs, "ns2", 64)
    assert other_ns.added == 2  # namespaces never share documents
    retokenized = ingest_documents(db, tok, ["another tokenizer"], docs, "ns2", 64)
    assert (retokenized.replaced, retokenized.unchanged) == (2, 0)  # same text, new tokenizer: not a no-op
    with db.session() as s:
        assert set(s.scalars(select(Chunk.model).where(Chunk.namespace == "ns2"))) == {"another tokenizer"}
    twice = ingest_documents(db, tok, ["fp"], [Document("c", "", "First text."), Document("c", "", "Second.")], "ns", 64)
    assert (twice.added, twice.replaced, twice.chunks_added) == (1, 0, 1)  # an id given twice: its last version
    with db.session() as s:
        c = s.scalars(select(DocRow).where(DocRow.external_id == "c")).one()
        assert [t for t in s.scalars(select(Chunk.text).where(Chunk.document_id == c.id))] == ["Second."]


def test_processes_starting_together_on_a_fresh_postgresql_take_turns():
    url, drop = pg_database()
    barrier, errors = threading.Barrier(6), []

    def start():
        barrier.wait()
        try:
            Database(url).dispose()
        except Exception as e:  # noqa: BLE001 — what the test looks for
            errors.append(repr(e))

    threads = [threading.Thread(target=start) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    finally:
        drop()


def test_a_database_newer_than_the_code_is_refused_by_name(tmp_path):
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    db = Database(url)
    with db.session() as s:
        s.execute(update(SchemaInfo).values(version=SCHEMA_VERSION + 1))
    db.dispose()
    with pytest.raises(UserError, match="newer than this ragcache"):
        Database(url)


def test_a_schema_4_database_gains_heading_and_page_and_keeps_its_chunks(db_url):
    from sqlalchemy import text

    db = Database(db_url)
    with db.session() as s:  # back to schema 4: chunks without heading and page, one chunk in them
        for column in ("heading", "page"):
            s.execute(text(f"ALTER TABLE chunks DROP COLUMN {column}"))
        s.execute(update(SchemaInfo).values(version=4))
        s.execute(text("INSERT INTO documents (namespace, external_id, title, text_hash, created) "
                       "VALUES ('ns', 'd', '', 'h', CURRENT_TIMESTAMP)"))
        s.execute(text("INSERT INTO chunks (document_id, namespace, ordinal, text, n_tokens, token_ids, model, state, "
                       "attempts, created) SELECT id, 'ns', 0, 'old text', 2, :ids, 'fp', 'done', 0, CURRENT_TIMESTAMP "
                       "FROM documents"), {"ids": b"\x01\x00\x00\x00\x02\x00\x00\x00"})
    db.dispose()
    db = Database(db_url)
    with db.session() as s:
        assert s.get(SchemaInfo, 1).version == SCHEMA_VERSION
        [chunk] = s.scalars(select(Chunk)).all()
        assert (chunk.text, chunk.heading, chunk.page) == ("old text", None, None)
    db.dispose()


def test_a_schema_5_database_gains_staged_versions_and_keeps_serving_its_chunks(db_url, smollm):
    from sqlalchemy import text

    db = Database(db_url)
    ingest_documents(db, smollm.tokenizer, ["fp"], [Document("d", "", "Old text.")], "ns", 64)
    with db.session() as s:  # back to schema 5: one version per document, unique by ordinal
        s.execute(text("DROP INDEX ux_chunks_doc_staged_ordinal"))
        s.execute(text("ALTER TABLE chunks DROP COLUMN staged"))
        s.execute(text("CREATE UNIQUE INDEX ux_chunks_doc_ordinal ON chunks (document_id, ordinal)"))
        for column in ("staged_hash", "staged_title"):
            s.execute(text(f"ALTER TABLE documents DROP COLUMN {column}"))
        s.execute(text("UPDATE chunks SET state = 'done'"))
        s.execute(update(SchemaInfo).values(version=5))
    db.dispose()
    db = Database(db_url)
    with db.session() as s:
        assert s.get(SchemaInfo, 1).version == SCHEMA_VERSION
        assert [(c.text, c.staged) for c in s.scalars(select(Chunk))] == [("Old text.", False)]
    report = ingest_documents(db, smollm.tokenizer, ["fp"], [Document("d", "", "New text.")], "ns", 64)
    assert report.staged == 1  # ordinal 0 twice: once served, once staged
    db.dispose()


def test_a_schema_6_database_keeps_its_calibration_and_gains_the_measured_points_ape_and_chunk_prefill(db_url):
    from sqlalchemy import text

    from ragcache.meta import ModelDefault

    db = Database(db_url)
    with db.session() as s:  # back to schema 6: a calibration is one mode and its knob
        s.execute(text("ALTER TABLE model_defaults DROP COLUMN points"))
        s.execute(text("ALTER TABLE model_defaults DROP COLUMN ape"))
        s.execute(text("ALTER TABLE model_defaults DROP COLUMN chunk_prefill"))
        s.execute(text("INSERT INTO model_defaults (fingerprint, mode, param, target_kl, measured_kl, speedup, dataset, "
                       "created) VALUES ('fp', 'probe', 0.2, 0.1, 0.05, 5.0, 'x', CURRENT_TIMESTAMP)"))
        s.execute(update(SchemaInfo).values(version=6))
    db.dispose()
    db = Database(db_url)
    with db.session() as s:
        assert s.get(SchemaInfo, 1).version == SCHEMA_VERSION
        row = s.get(ModelDefault, "fp")
        assert (row.mode, row.param, row.points, row.ape) == ("probe", 0.2, None, None) and row.fastest(0.1) is None
        assert row.measured_for("prefixed") and not row.measured_for("lead")  # what every calibration measured then
    db.dispose()


def test_a_corpus_ingested_in_float32_serves_a_bfloat16_model(tmp_path, smollm):
    """Chunks depend on the tokenizer, KV on weights and dtypes: the other dtype computes its own KV."""
    from ragcache import RagCache, Settings
    from ragcache.jobs.precompute import run_precompute

    docs = [Document("a", "", "Short text about Rome."), Document("b", "", "Short text about Paris.")]
    settings = Settings(home=tmp_path, model=str(smollm.path), dtype="float32")
    with RagCache(settings) as cpu:
        cpu.corpus.ingest_documents(docs)
    run_precompute(settings, progress=False)
    bf16 = RagCache(Settings(home=tmp_path, model=str(smollm.path), dtype="bfloat16"))
    assert bf16.model.tokenizer_id == smollm.tokenizer_id and bf16.model.fingerprint != smollm.fingerprint
    out = bf16.generate("What is Paris?", top_k=2, max_new_tokens=2)
    assert out["answer"] and {c["tier"] for c in out["chunks"]} == {"computed"}  # its own KV, not float32's
    assert bf16.corpus.ingest_documents(docs).unchanged == 2  # nothing to re-ingest
    bf16.close()


def test_chunks_precomputed_behind_the_lead_are_keyed_apart_and_served(tmp_path, smollm):
    """RAGCACHE_CHUNK_PREFILL=lead: each chunk's KV is computed behind the system prompt and RAGCACHE_CHUNK_LEAD (the
    rows of a prefill of all three), stored under a key of its own, and served from the store."""
    import torch

    from blend.prompt import as_ids, encode
    from ragcache import RagCache, Settings
    from ragcache.jobs.precompute import run_precompute

    docs = [Document("a", "", "Short text about Rome."), Document("b", "", "Short text about Paris.")]
    settings = Settings(home=tmp_path, model=str(smollm.path), chunk_prefill="lead", chunk_lead="The Lark\nA song.")
    with RagCache(settings) as lead:
        lead.corpus.ingest_documents(docs)
    run_precompute(settings, progress=False)
    with RagCache(settings) as lead, RagCache(settings.model_copy(update={"chunk_prefill": "prefixed"})) as plain:
        behind = lead.chunk_prefix("default")
        head = plain.prefix.token_ids
        assert torch.equal(behind.token_ids, torch.cat([head, as_ids(encode(lead.tokenizer, "The Lark\nA song.\n\n"))]))
        ids = as_ids(encode(lead.tokenizer, "Short text about Rome.\n\n"))
        kv = lead.compute_chunk_kv(ids, "default")
        assert (kv.start, kv.context) == (len(behind), behind.key)
        whole = lead.runner.prefill(torch.cat([behind.token_ids, ids]))
        assert (kv.k - whole.k[:, :, len(behind):]).abs().max() <= 1e-3 * whole.k.abs().max()  # one pass or two
        assert lead.kv_key_of(ids, "default") != plain.kv_key_of(ids, "default")
        out = lead.generate("What is Paris?", top_k=2, max_new_tokens=2)
        assert out["answer"] and "computed" not in {c["tier"] for c in out["chunks"]}  # precompute's KV, served


def test_the_lead_is_the_most_typical_passage_of_the_median_length():
    """lead.py's pick: only passages of about the median length (of those up to LONGEST tokens) are candidates,
    and of those the one nearest their embeddings' centroid wins (an outlier of the right length does not)."""
    from index import Embedder
    from ragcache.lead import pick_lead

    texts = ["a short note", "the river flows past the old mill into the lake", "a very long passage " * 40,
             "the river runs by the mill and on to the lake", "stock prices fell sharply on monday morning",
             "the stream passes the mill and reaches the lake", "x"]
    sizes = [3, 10, 80, 10, 10, 10, 1]
    picked = pick_lead(texts, sizes, Embedder().embed)
    assert picked in (1, 3, 5)  # a river passage of the median length: not the outlier, not the short or long ones
    assert pick_lead(texts[:3], sizes[:3], Embedder().embed) == 1  # of one length only the median one is a candidate
    # a lead precedes every chunk within the model's positions: never one past LONGEST tokens, even at the median
    assert pick_lead(["Paris is in France.", "word " * 9000], [5, 9000], Embedder().embed) == 0
    assert pick_lead(["word " * 3000, "word " * 2000], [3000, 2000], Embedder().embed) == 1  # none fits: the shortest
    with pytest.raises(ValueError):
        pick_lead([], [], Embedder().embed)


def test_each_namespace_computes_behind_a_lead_picked_once_from_its_own_chunks(tmp_path, smollm):
    """RAGCACHE_CHUNK_PREFILL=lead without RAGCACHE_CHUNK_LEAD: a namespace's lead is one of its own chunks
    (never another tenant's), kept in SQL, so another process, a later ingest and the deletion of the document it
    came from all leave it as it was; precompute and serving agree on it (the KV is served from the store); an
    empty namespace is a named error; with caching shared across namespaces one lead serves all."""
    from ragcache import RagCache, Settings
    from ragcache.jobs.precompute import run_precompute
    from ragcache.meta import Lead

    rivers = ["The river flows past the old mill into the lake.", "The river runs by the mill and on to the lake.",
              "The stream passes the mill and reaches the lake below."]
    stocks = ["Stock prices fell sharply on Monday morning.", "Shares rose again on Tuesday after the report."]
    docs = {"a": [Document(f"r{i}", "", t) for i, t in enumerate(rivers)],
            "b": [Document(f"s{i}", "", t) for i, t in enumerate(stocks)]}
    settings = Settings(home=tmp_path, model=str(smollm.path), chunk_prefill="lead")
    with RagCache(settings) as service:
        for ns, ds in docs.items():
            service.corpus.ingest_documents(ds, ns)
        leads = {ns: service.lead_text(ns) for ns in docs}
        with pytest.raises(UserError, match="RAGCACHE_CHUNK_LEAD"):
            service.lead_text("empty")
    assert leads["a"] in rivers and leads["b"] in stocks
    run_precompute(settings, progress=False)
    with RagCache(settings) as service:
        service.corpus.ingest_documents([Document("r9", "", "A new passage about the lake.")], "a")
        service.corpus.delete_document("a", f"r{rivers.index(leads['a'])}")
        assert {ns: service.lead_text(ns) for ns in docs} == leads  # read back from SQL, not picked again
        behind = service.chunk_prefix("b")
        assert service.tokenizer.decode(behind.token_ids[len(service.prefix):]).strip() == leads["b"]
        out = service.generate("When did stock prices fall?", namespace="b", top_k=2, max_new_tokens=2)
        assert out["answer"] and "computed" not in {c["tier"] for c in out["chunks"]}  # precompute's KV, served
        with service.db.session() as s:
            assert {row.namespace for row in s.scalars(select(Lead))} == {"a", "b"}
    with RagCache(settings.model_copy(update={"share_across_namespaces": True})) as shared:
        assert shared.lead_text("a") == shared.lead_text("b") in rivers + stocks


class _Tokenizer:
    """The real tokenizer, with `during(n)` run at each of its calls (another writer, a meeting point)."""

    def __init__(self, tokenizer, during):
        self.tokenizer, self.during, self.calls = tokenizer, during, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.during(self.calls)
        return self.tokenizer(*args, **kwargs)


def test_another_writer_commits_while_an_ingest_tokenizes(tmp_path, smollm):
    db = Database(f"sqlite:///{tmp_path / 'meta.db'}")
    commits = []

    def write(n):  # no waiting for a lock: the ingest must not hold SQLite's write lock while tokenizing
        conn = sqlite3.connect(tmp_path / "meta.db", timeout=0)
        with conn:
            conn.execute("INSERT INTO index_versions (namespace, version) VALUES (?, 1)", (f"other{n}",))
        conn.close()
        commits.append(n)

    docs = [Document(f"d{i}", "", LONG) for i in range(3)]
    report = ingest_documents(db, _Tokenizer(smollm.tokenizer, write), ["fp"], docs, "ns", 64)
    assert report.added == 3 and len(commits) > 3
    db.dispose()


def test_the_same_new_document_ingested_by_two_connections_at_once_is_one_document(smollm):
    url, drop = pg_database()
    meet, reports, errors = threading.Barrier(2), [], []

    def together(_n):  # both ingests tokenize at the same moment, then both write
        try:
            meet.wait(timeout=5)
        except threading.BrokenBarrierError:
            pass

    def ingest(i):
        db = Database(url)
        try:
            docs = [Document("shared", "", LONG), Document(f"own{i}", "", "Its own short text.")]
            reports.append(ingest_documents(db, _Tokenizer(smollm.tokenizer, together), ["fp"], docs, "ns", 64))
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)
        finally:
            db.dispose()

    try:
        threads = [threading.Thread(target=ingest, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        db = Database(url)
        with db.session() as s:
            ext = sorted(s.scalars(select(DocRow.external_id)))
            per_doc = {d: n for d, n in s.execute(select(Chunk.document_id, func.count()).group_by(Chunk.document_id))}
        db.dispose()
        assert ext == ["own0", "own1", "shared"]
        assert len(per_doc) == 3 and sum(r.added for r in reports) == 3
    finally:
        drop()


def test_swapping_out_a_document_of_40k_done_chunks_stays_under_sqlites_variable_limit(tmp_path, smollm):
    db = Database(f"sqlite:///{tmp_path / 'meta.db'}")
    limit = lambda conn, _: conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32766)  # noqa: E731 — a stock
    event.listen(db.engine, "connect", limit)  # build's limit (Debian's is 250,000)
    db.engine.dispose()
    ingest_documents(db, smollm.tokenizer, ["fp"], [Document("big", "", "Short.")], "ns", 64)
    with db.session() as s:
        doc = s.scalars(select(DocRow.id)).one()
        s.execute(Chunk.__table__.insert(), [dict(document_id=doc, namespace="ns", ordinal=i + 1, text="x", n_tokens=1,
                                                  token_ids=b"\0\0\0\0", model="fp", kv_key=f"k{i}", state="done")
                                             for i in range(40_000)])
    report = ingest_documents(db, smollm.tokenizer, ["fp"], [Document("big", "", "Changed.")], "ns", 64)
    assert report.staged == 1 and report.chunks_removed == 0  # served until "Changed." is done
    with db.session() as s:
        s.execute(Chunk.__table__.update().where(Chunk.staged).values(state="done", kv_key="new"))
    swapped = swap_ready(db, "ns")
    assert len(swapped.chunk_ids) == 40_001 and len(swapped.orphan_kv_keys) == 40_000
    db.dispose()


def test_a_replaced_staged_version_frees_only_the_kv_no_chunk_will_use_again(tmp_path, smollm):
    """KV is keyed by content: when a staged version is replaced before it is swapped in, its done chunks' KV is
    deleted from the store, except an entry the served version still names or a new version's chunk will use
    again (the same text, so the same key: deleting it would throw away work the next precompute needs)."""
    from ragcache import RagCache, Settings
    from ragcache.corpus.ingest import unpack_ids

    p0, p1, p2, p3, p4 = (f"Paragraph {w} says something plain about the {w} valley and its old stone bridge."
                          for w in ("first", "second", "third", "fourth", "fifth"))

    def mark_done(rc, staged: bool) -> dict[str, str]:
        """As precompute would: each such chunk's KV computed, stored under its key, the chunk done."""
        keys = {}
        with rc.db.session() as s:
            for c in s.scalars(select(Chunk).where(Chunk.staged.is_(staged))):
                ids = unpack_ids(c.token_ids)
                key = rc.kv_key_of(ids, "default")
                rc.store.put(key, rc.prefill_for_store(ids, "default")[1], durable=True)
                c.state, c.kv_key, keys[c.text] = "done", key, key
        return keys

    with RagCache(Settings(home=tmp_path, model=str(smollm.path), chunk_prefill="prefixed", chunk_tokens=32)) as rc:
        rc.corpus.ingest_documents([Document("a", "", f"{p0}\n\n{p1}")])
        served = mark_done(rc, staged=False)
        assert sorted(served) == [p0, p1]  # a chunk a paragraph
        assert rc.corpus.ingest_documents([Document("a", "", f"{p0}\n\n{p2}")]).staged == 1
        staged = mark_done(rc, staged=True)
        assert staged[p0] == served[p0] and staged[p2] != served[p1]  # the same text, the same key
        # v3 keeps p2: its staged KV is no orphan, nor p0's (the served version names it)
        assert rc.corpus.ingest_documents([Document("a", "", f"{p0}\n\n{p2}\n\n{p3}")]).orphan_kv_keys == []
        assert all(rc.store.contains(k) for k in {*served.values(), *staged.values()})
        staged = mark_done(rc, staged=True)
        # v4 is new text only: the staged p2's and p3's KV goes; p0's stays (the served version names it), p1's too
        gone = rc.corpus.ingest_documents([Document("a", "", p4)]).orphan_kv_keys
        assert sorted(gone) == sorted([staged[p2], staged[p3]])
        assert [rc.store.contains(k) for k in (served[p0], served[p1], staged[p2], staged[p3])] == \
            [True, True, False, False]
