"""A large ingest, and a large file's reading, in a child process of its own, so that its Python never holds the
server's interpreter lock.

Chunking and the SQL rows of thousands of documents are seconds of Python; in the server's process every
small op of the model thread's forward pass waits for that lock (BENCHMARKS.md, "An ingest beside a
generate"). The child holds the model's tokenizer and its own database connection, started on the first
large ingest or upload and kept; it runs `ingest_documents` as the thread would, one request at a time. An ingest is
one transaction and idempotent, so a child that dies mid-way loses nothing: the request is answered 503 and
can be sent again (documents already in are left as they are); the next one starts a new child. The child runs at
nice 19: its chunking otherwise took a core from the model's two threads, and every decode step waited for the one
that lost it (BENCHMARKS.md, issue 21: another tenant's slowest request beside a 250K-document ingest 1.2–1.4 s at
nice 0, 0.55–0.57 s at 19, the ingest as fast: it runs in the gaps).
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import UserError
from .chunking import Document
from .ingest import IngestReport

log = logging.getLogger("ragcache.ingest")

APART_CHARS = 1 << 20  # a request with this much text (or a file this many bytes) or more goes to the child
NICE = 19  # the child's: a core it shares with the model's threads is theirs whenever they want it


class IngestProcess:
    """One child process for large ingests; `ingest` blocks (without the interpreter lock) until it answers."""

    def __init__(self, tokenizer_dir: Path, tokenizer_id: str, db_url: str):
        self._args = (str(tokenizer_dir), tokenizer_id, db_url)
        self._lock = threading.Lock()  # one ingest at a time through the one pipe
        self._child = self._conn = None

    def ingest(self, tokenizer_ids: list[str], docs: list[Document], namespace: str,
               max_tokens: int) -> IngestReport:
        return self._call("ingest", tokenizer_ids, docs, namespace, max_tokens)

    def ingest_body(self, tokenizer_ids: list[str], raw: bytes, content_type: str, namespace: str,
                    max_tokens: int) -> IngestReport:
        """`body.parse_body` and then `ingest`, in the child: a body's JSON parse holds no lock here either."""
        return self._call("body", tokenizer_ids, raw, content_type, namespace, max_tokens)

    def read(self, name: str, data: bytes) -> list[Document]:
        """`readers.read_file` in the child: a PDF's text layer is seconds of Python (pypdf)."""
        return self._call("read", name, data)

    def _call(self, what: str, *args):
        with self._lock:
            conn = self._started()
            try:
                conn.send((what, args))
                status, result = conn.recv()
            except (EOFError, OSError):
                code = self._stopped()
                raise UserError(f"the ingest process stopped ({_how(code)}) before answering; send the request "
                                "again: an ingest is idempotent, documents already in are left as they are",
                                usage=False) from None
        if status == "error":
            raise result
        return result

    def _started(self) -> Connection:
        if self._child is not None and self._child.poll() is None:
            return self._conn
        ours, theirs = socket.socketpair()  # one duplex connection; its end closes when the child dies (EOFError)
        # a process of its own (`python -m`), not multiprocessing's spawn: that would import the host's __main__
        self._child = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                       pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # one core
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(self._args)
            status, found = self._conn.recv()  # its tokenizer loaded and checked
        except (EOFError, OSError):
            code = self._stopped()
            raise UserError(f"the ingest process did not start ({_how(code)}); the server log has its error",
                            usage=False) from None
        if status == "error":
            self._stopped()
            raise found
        log.info("ingest process %d started", self._child.pid)
        return self._conn

    def _stopped(self) -> int | None:
        """The child's exit code, once it is gone (killed if it does not go), and its pipes closed."""
        try:
            code = self._child.wait(10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            code = self._child.wait()
        self._conn.close()
        self._child = self._conn = None
        return code

    @property
    def pid(self) -> int | None:
        """The child's, while it runs."""
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                try:
                    self._conn.send(None)  # its last message: it closes its connection and ends
                except OSError:
                    pass
                self._stopped()


def _how(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _serve(conn) -> None:
    """The child: its tokenizer checked against the server's, then one job (an ingest, a body's parse and ingest,
    a file read) per message until None."""
    from transformers import AutoTokenizer

    from blend.model import tokenizer_id as id_of

    from ..database import Database
    from .body import parse_body
    from .ingest import ingest_documents
    from .readers import read_file

    os.nice(NICE)  # the model's threads first (the module's docstring)
    tokenizer_dir, tokenizer_id, db_url = conn.recv()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        if id_of(tokenizer) != tokenizer_id:
            raise UserError(f"{tokenizer_dir}: its tokenizer is not the server's any more", usage=False)
        db = Database(db_url)
    except Exception as e:  # noqa: BLE001 — to the server, which answers with it
        conn.send(("error", _portable(e)))
        return
    conn.send(("ok", None))

    def body(tokenizer_ids, raw, content_type, namespace, max_tokens):
        return ingest_documents(db, tokenizer, tokenizer_ids, parse_body(raw, content_type), namespace, max_tokens)

    jobs = {"ingest": lambda *a: ingest_documents(db, tokenizer, *a), "body": body, "read": read_file}
    while (job := conn.recv()) is not None:
        what, args = job
        try:
            result = jobs[what](*args)
        except Exception as e:  # noqa: BLE001 — the server's thread raises it as its own
            conn.send(("error", _portable(e)))
        else:
            conn.send(("ok", result))
    db.dispose()


def _portable(error: Exception) -> Exception:
    """`error`, if the server can unpickle it (its status kept: a UserError, a database's OperationalError);
    else its words in a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 — an exception class whose arguments do not survive the round trip
        return RuntimeError(f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
