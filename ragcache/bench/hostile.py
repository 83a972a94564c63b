"""What a hostile tenant does besides flooding, for `ragcache bench tenants --hostile`: each loop runs until
`stop` (an Event) is set and counts the server's answers in `seen` by (what it tried, HTTP status).

    pins     pin and unpin its documents, RATE a second (409 past RAGCACHE_PIN_QUOTA_BYTES)
    bodies   a body over RAGCACHE_MAX_BODY_BYTES (413), JSON nested 100,000 deep and a 5,000-digit integer
             (422), RATE a second
    uploads  `n` uploads that send their headers, then one byte a second (408 after RAGCACHE_BODY_TIMEOUT_S)
"""
from __future__ import annotations

import select
import socket
from collections import Counter
from urllib.parse import urlsplit

import httpx

RATE = 20  # requests a second of each paced loop
TRICKLE_S = 1.0  # a stalled upload's pace: one byte this often


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


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}
