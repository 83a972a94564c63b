"""A large ingest in a child process, the server's way: the rows the thread would write, a large file read there
to the same documents, a large JSON body parsed there with the same errors, and a child killed mid-ingest loses
nothing."""
from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import threading
import time

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from ragcache import RagCache, Settings
from ragcache.corpus.chunking import Document
from ragcache.corpus.ingest_process import APART_CHARS, NICE
from ragcache.corpus.readers import read_file
from ragcache.errors import Invalid, UserError
from ragcache.meta import Chunk

WORDS = "the committee met again in the spring to review the harbour accounts and the new charter".split()


def _bulk(n: int, tag: str) -> list[Document]:
    return [Document(f"{tag}-{i}", "", " ".join(WORDS[(i + j) % len(WORDS)] for j in range(240))) for i in range(n)]


def _rows(rc: RagCache, namespace: str) -> list:
    with rc.db.session() as s:
        return s.execute(select(Chunk.text, Chunk.token_ids, Chunk.ordinal, Chunk.n_tokens, Chunk.model)
                         .where(Chunk.namespace == namespace).order_by(Chunk.id)).all()


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_large_ingest_apart_writes_the_threads_rows_reads_files_alike_and_a_killed_child_loses_nothing(tmp_path, smollm):
    docs = _bulk(1000, "d")
    assert sum(len(d.text) for d in docs) >= APART_CHARS
    with RagCache(Settings(home=tmp_path, model=str(smollm.path))) as rc:
        rc.corpus.ingest_documents(docs, "thread")
        assert rc.corpus.apart_pid is None  # the thread's way unless asked
        report = rc.corpus.ingest_documents(docs, "apart", apart=True)
        child = rc.corpus.apart_pid
        assert child not in (None, os.getpid()) and report.added == 1000
        assert os.getpriority(os.PRIO_PROCESS, child) == min(os.getpriority(os.PRIO_PROCESS, 0) + NICE, 19)
        assert _rows(rc, "apart") == _rows(rc, "thread")
        assert rc.corpus.ingest_documents(docs[:10], "small", apart=True).added == 10  # under APART_CHARS: here
        # a large upload is read there too, to the same documents, its errors the same words
        big = ("# Harbour\n\n" + "\n\n".join(f"## Year {i}\n\n{d.text}" for i, d in enumerate(docs))).encode()
        assert len(big) >= APART_CHARS and rc.corpus.read_file("big.md", big) == read_file("big.md", big)
        broken = b"%PDF-1.7\n1 0 obj << /Type /Catalog >> garbage" + b" " * APART_CHARS
        with pytest.raises(UserError) as here:
            read_file("broken.pdf", broken)
        with pytest.raises(UserError, match=re.escape(str(here.value))):
            rc.corpus.read_file("broken.pdf", broken)
        # a large JSON body is parsed there as well: the same rows, the same named error (nothing written)
        body = json.dumps({"documents": [{"id": d.external_id, "text": d.text} for d in docs]}).encode()
        assert len(body) >= APART_CHARS and rc.corpus.ingest_body(body, "application/json", "body").added == 1000
        assert _rows(rc, "body") == _rows(rc, "thread")
        rows = [{"id": d.external_id, "text": d.text} for d in _bulk(1000, "b")] + [{"id": "last", "text": ""}]
        for raw, last in ((json.dumps(rows).encode(), 1000), (json.dumps(rows[-2:]).encode(), 1)):  # there, here
            with pytest.raises(Invalid) as bad:
                rc.corpus.ingest_body(raw, "application/json", "bad")
            field = f"documents.{last}.text"
            assert (bad.value.field, str(bad.value)) == (field, f"{field}: must not be empty")
        assert _rows(rc, "bad") == []
        assert rc.corpus.apart_pid == child

        # Killed mid-ingest: our write lock holds the child at its first write, so it cannot finish first.
        blocker = sqlite3.connect(make_url(rc.settings.db_url).database, timeout=60, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        before, box = _cpu_ticks(child), []

        def ingest():
            try:
                box.append(rc.corpus.ingest_documents(_bulk(1000, "k"), "killed", apart=True))
            except UserError as e:
                box.append(e)

        t = threading.Thread(target=ingest, daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while _cpu_ticks(child) < before + 5:  # it has the job: it is chunking
            assert time.monotonic() < deadline, "the child never took the job"
            time.sleep(0.01)
        os.kill(child, signal.SIGKILL)
        t.join(120)
        blocker.execute("ROLLBACK")
        blocker.close()
        assert isinstance(box[0], UserError) and not box[0].usage, box  # 503, not 400
        assert "send the request again" in str(box[0])
        assert _rows(rc, "killed") == []
        again = rc.corpus.ingest_documents(_bulk(1000, "k"), "killed", apart=True)  # a new child
        assert again.added == 1000 and rc.corpus.apart_pid not in (None, child)
