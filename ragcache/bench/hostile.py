"""What a hostile tenant does besides flooding, for `ragcache bench tenants --hostile`: each loop runs until
`stop` (an Event) is set and counts the server's answers in `seen` by (what it tried, HTTP status).

    pins     pin and unpin its documents, RATE a second (409 past RAGCACHE_PIN_QUOTA_BYTES)
    bodies   a body over RAGCACHE_MAX_BODY_BYTES (413), JSON nested 100,000 deep and a 5,000-digit integer
             (422), RATE a second
    uploads  `n` uploads that send their headers, then one byte a second (408 after RAGCACHE_BODY_TIMEOUT_S)
    ingest   `total` documents of 240 words through POST /v1/documents, INGEST_BATCH a request (not hostile:
             big; the one that ends sets its Event whether or not `stop` cut it short)
"""
from __future__ import annotations

import json
import select
import socket
from collections import Counter
from urllib.parse import urlsplit

import httpx

RATE = 20  # requests a second of each paced loop
TRICKLE_S = 1.0  # a stalled upload's pace: one byte this often
INGEST_BATCH = 4000  # documents a request (~6 MB of JSON, under the default 8 MiB body limit)
WORDS = "the committee met again in the spring to review the harbour accounts and the new charter".split()


def pins(url: str, key: str, namespace: str, docs: list[str], stop, seen: Counter) -> None:
    with httpx.Client(base_url=url, headers=_auth(key), timeout=600) as c:
        i = 0
        while not stop.is_set():
            for route in ("/v1/cache/pin", "/v1/cache/unpin") if i % 4 == 3 else ("/v1/cache/pin",):
                r = c.post(route, json={"namespace": namespace, "doc_id": docs[i % len(docs)]})
                seen[(route.rsplit("/", 1)[1], r.status_code)] += 1
            i += 1
            stop.wait(1 / RATE)


def bodies(url: str, key: str, max_body_bytes: int, stop, seen: Counter) -> None:
    bad = [("huge body", b'{"query": "' + b"x" * (max_body_bytes + 1) + b'"}'),
           ("deep JSON", b"[" * 100_000), ("long integer", b'{"query": "q", "top_k": ' + b"9" * 5000 + b"}")]
    with httpx.Client(base_url=url, headers={**_auth(key), "Content-Type": "application/json"}, timeout=600) as c:
        i = 0
        while not stop.is_set():
            what, body = bad[i % len(bad)]
            try:
                seen[(what, c.post("/v1/rag/generate", content=body).status_code)] += 1
            except httpx.HTTPError:  # the server closed before the whole body was sent: refused unread
                seen[(what, "closed")] += 1
            i += 1
            stop.wait(1 / RATE)


def uploads(url: str, key: str, n: int, stop, seen: Counter) -> None:
    """`n` stalled uploads open at once; one the server answers (or closes) is counted and opened again."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    head = (f"POST /v1/rag/generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{{").encode()
    socks: list[socket.socket] = []
    try:
        while not stop.is_set():
            while len(socks) < n:
                s = socket.create_connection((host, port), timeout=30)
                s.sendall(head)
                socks.append(s)
            readable, _, _ = select.select(socks, [], [], TRICKLE_S)
            for s in readable:
                line = s.recv(4096).split(b"\r\n", 1)[0].split()
                seen[("stalled upload", int(line[1]) if len(line) > 1 else "closed")] += 1
                socks.remove(s)
                s.close()
            for s in list(socks):
                try:
                    s.sendall(b" ")
                except OSError:
                    seen[("stalled upload", "closed")] += 1
                    socks.remove(s)
                    s.close()
    finally:
        for s in socks:
            s.close()


def ingest(url: str, key: str, total: int, max_body_bytes: int, namespace: str, done, stop, seen: Counter) -> None:
    with httpx.Client(base_url=url, headers=_auth(key), timeout=600) as c:
        try:
            for start in range(0, total, INGEST_BATCH):
                if stop.is_set():
                    break
                docs = [{"id": f"bulk-{i}", "text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(240))}
                        for i in range(start, min(total, start + INGEST_BATCH))]
                body = json.dumps({"documents": docs}).encode()
                if len(body) > max_body_bytes:
                    raise ValueError(f"{len(body)} bytes of documents a request: over RAGCACHE_MAX_BODY_BYTES")
                r = c.post("/v1/documents", params={"namespace": namespace, "precompute": "false"}, content=body,
                           headers={"Content-Type": "application/json"})
                seen[("ingest request", r.status_code)] += 1
                if r.status_code == 200:
                    seen[("documents ingested", 200)] += r.json()["documents"]["added"]
        finally:
            done.set()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}
