"""POST /v1/rag/generate against a real server: JSON, SSE streaming, explain, and every error."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from .sse import events


def _ask(server, **body):
    return {"query": server.question, "namespace": server.namespace, **body}


def test_generate_returns_answer_chunks_usage_timings(api_server):
    with api_server.client() as c:
        r = c.post("/v1/rag/generate", json=_ask(api_server, mode="cacheblend", top_k=3, max_tokens=12))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["answer"] and out["mode"] == "cacheblend" and len(out["chunks"]) == 3
    assert out["policy"] == "cacheblend@0.15+ape@1,0.5"  # the server's APE, on by default
    assert {c["tier"] for c in out["chunks"]} <= {"gpu", "cpu", "disk", "redis", "computed"}
    u = out["usage"]
    assert u["prompt_tokens"] == u["reused_tokens"] + u["recomputed_tokens"] and 0 < u["recomputed_tokens"]
    t = out["timings_ms"]
    assert t["ttft"] <= t["total"] and abs(t["retrieve"] + t["load"] + t["queue"] + t["blend"] - t["ttft"]) < 1.0


def test_stream_sends_tokens_before_the_end_and_they_add_up(api_server):
    body = _ask(api_server, mode="epic", max_tokens=16)
    with api_server.client() as c:
        plain = c.post("/v1/rag/generate", json=body).json()
        with c.stream("POST", "/v1/rag/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            got = list(events(r))
    kinds = [k for k, _ in got]
    assert kinds[-1] == "done" and kinds.count("token") >= 2 and set(kinds[:-1]) == {"token"}
    assert "".join(d["text"] for k, d in got if k == "token") == got[-1][1]["answer"] == plain["answer"]


def test_a_stop_string_ends_the_answer_before_it_streamed_or_not_and_in_chat(api_server):
    """The answer without a stop, then with a word of it as a stop (and another string it never writes): the text
    before the word, finish_reason "stop", fewer tokens; streamed, the same deltas; over the chat endpoint, the
    same through `stop`. An empty stop string, a fifth one or a number is a 422 naming it, on both routes."""
    body = _ask(api_server, mode="reuse", top_k=2, max_tokens=16, ignore_eos=True)
    with api_server.client() as c:
        whole = c.post("/v1/rag/generate", json=body).json()
        word = whole["answer"].split()[3]
        want = whole["answer"][:whole["answer"].find(word)].rstrip()
        cut = c.post("/v1/rag/generate", json={**body, "stop": ["qqzzqq", word]}).json()
        assert cut["answer"] == want and cut["finish_reason"] == "stop" and want, (whole["answer"], word)
        assert cut["usage"]["completion_tokens"] < whole["usage"]["completion_tokens"] == 16
        with c.stream("POST", "/v1/rag/generate", json={**body, "stop": word, "stream": True}) as r:
            got = list(events(r))
        assert "".join(d["text"] for k, d in got if k == "token") == got[-1][1]["answer"] == want
        assert got[-1][1]["finish_reason"] == "stop"
        model = c.get("/v1/models").json()["data"][0]["id"]
        chat = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": api_server.question}], "max_tokens": 16,
            "ignore_eos": True, "stop": [word], "rag": {"namespace": api_server.namespace, "top_k": 2, "mode": "reuse"}})
        choice = chat.json()["choices"][0]
        assert choice["message"]["content"] == want and choice["finish_reason"] == "stop", chat.text
        chat_body = {"model": model, "messages": [{"role": "user", "content": "q"}]}
        for bad, param, says in (("", "stop.0", "at least 1 character"), (["a", "", "c"], "stop.1", "at least 1"),
                                 (list("abcde"), "stop", "at most 4 items"), ([3], "stop.0", "valid string")):
            for path, extra in (("/v1/rag/generate", body), ("/v1/chat/completions", chat_body)):
                r = c.post(path, json={**extra, "stop": bad})  # a 422 naming the string, not pydantic's union branch
                assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
                assert says in r.json()["error"]["message"], r.text


def test_explain_marks_every_recomputed_position(api_server):
    with api_server.client() as c:
        out = c.post("/v1/rag/generate", json=_ask(api_server, mode="cacheblend", top_k=2, max_tokens=2,
                                                   explain=True)).json()
    ex = out["explain"]
    assert len(ex["tokens"]) == out["usage"]["prompt_tokens"]
    assert len(ex["recomputed"]) == out["usage"]["recomputed_tokens"]
    chunks = [s for s in ex["segments"] if s["kind"] == "chunk"]
    assert len(chunks) == 2 and ex["segments"][0]["kind"] == "prefix" and ex["segments"][-1]["kind"] == "suffix"
    measured = [d for d in ex["deviation"] if d is not None]
    # chunks computed behind a lead passage (the default): none is exact in place, so each one's deviation is measured
    assert len(measured) == sum(s["end"] - s["start"] for s in chunks)


def test_bad_requests_are_named_4xx(api_server):
    cases = [
        ({"query": "x", "mode": "bogus"}, 422, "mode"),
        ({"query": "x", "top_k": 0}, 422, "top_k"),
        ({"query": "x", "recompute_ratio": 2}, 422, "recompute_ratio"),
        ({"query": ""}, 422, "query"),
        ({"query": "x", "surprise": 1}, 422, "surprise"),
        ({"query": "   ", "namespace": api_server.namespace}, 400, None),
        ({"query": "x", "namespace": "no-such-namespace"}, 404, None),
        ({"query": "x", "namespace": api_server.namespace, "max_tokens": 7000}, 400, None),  # over the cap
        ({"query": "x", "target_kl": -0.1}, 422, "target_kl"),
    ]
    with api_server.client() as c:
        for body, status, param in cases:
            r = c.post("/v1/rag/generate", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and (param is None or err["param"] == param), (body, err)
        for body, says in [({"mode": "epic", "target_kl": 0.05}, "applies to mode auto or adaptive"),
                           ({"mode": "adaptive", "target_kl": 0.05}, "run `ragcache calibrate`")]:  # none here
            r = c.post("/v1/rag/generate", json={"query": "x", "namespace": api_server.namespace, **body})
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        r = c.post("/v1/rag/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]
        assert c.get("/no/such/route").json()["error"]["type"] == "not_found_error"


def test_prompt_over_the_context_names_the_limit(api_server):
    with api_server.client() as c:
        r = c.post("/v1/rag/generate", json=_ask(api_server, top_k=6, max_tokens=6000))
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "context of 8192 tokens" in msg and "lower top_k or max_tokens" in msg


def test_a_client_that_disconnects_mid_stream_frees_its_slot(api_server):
    body = _ask(api_server, mode="reuse", max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=api_server.url, timeout=60) as c:
        with c.stream("POST", "/v1/rag/generate", json=body) as r:
            for kind, _ in events(r):
                if kind == "token":
                    break  # ...and hang up
    deadline = time.monotonic() + 5  # 2000 tokens would take over a minute
    while api_server.metric("ragcache_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api_server.metric("ragcache_running") == 0
    assert api_server.metric("ragcache_kv_in_use_bytes") == 0  # its cache went back with it
    with api_server.client() as c:  # the model thread is free for the next one
        assert c.post("/v1/rag/generate", json=_ask(api_server, mode="reuse", max_tokens=2)).status_code == 200


def test_the_demo_client_answers_through_both_public_doors(api_server):
    """demo/client.py, as a user runs it against a server: the streamed REST answer, then the OpenAI chat."""
    client = Path(__file__).parents[2] / "demo" / "client.py"
    r = subprocess.run([sys.executable, str(client), api_server.question, "--url", api_server.url, "--namespace",
                        api_server.namespace, "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "== POST /v1/rag/generate" in r.stdout and "== POST /v1/chat/completions" in r.stdout
    assert r.stdout.count("KV from ") >= 1 and "chunks: [" in r.stdout
