"""The one model thread, in process on the session's precomputed corpus (the real model, store and SQL):
an exception at any stage fails that request alone, the budget comes back exactly once, and the thread
never waits on the jobs side (SQL, a child process starting)."""
from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import ragcache.serving.decoding as decoding_module
import ragcache.serving.scheduler as scheduler_module
from api.metrics import Metrics
from ragcache.config import Settings
from ragcache.serving.generation import Ask
from ragcache.serving.piecewise import Piecewise
from ragcache.serving.scheduler import Scheduler
from ragcache.serving.sequence import Prepared, Sequence
from ragcache.service import RagCache

from .conftest import NAMESPACE, copy_home

VICTIM = "Which college is mentioned?"
OTHERS = ["Who wrote the play?", "Where was the author educated?"]


class Injected(RuntimeError):
    """The fault a test raises in one request."""


@pytest.fixture(scope="module")
def sched(corpus_home, tmp_path_factory, smollm):
    """A scheduler whose step takes 256 recomputed rows: `full` mode (every row) runs in pieces, `reuse` batches."""
    home = copy_home(corpus_home, tmp_path_factory.mktemp("model-thread"))
    service = RagCache(Settings(home=home, model=str(smollm.path), chunk_tokens=1024, threads=1, max_step_rows=256))
    service.__dict__["model"] = smollm  # the session's model, loaded once
    s = Scheduler(service, max_queue=16)
    yield s
    s.close()
    service.close()


def _submit(sched: Scheduler, query: str, mode: str = "reuse", tokens: int = 4):
    done, box = threading.Event(), []

    def on_event(kind, payload):
        if kind != "text":
            box.append((kind, payload))
            done.set()

    sched.submit_generation(Ask(query, NAMESPACE, top_k=2, mode=mode, max_new_tokens=tokens, ignore_eos=True), on_event)
    return done, box


def _is_victim(query: str) -> None:
    if query == VICTIM:
        raise Injected(f"injected into {query!r}")


def _inject(monkeypatch, sched: Scheduler, stage: str) -> None:
    """Wrap the real function of `stage` so that it raises for the victim's request only."""
    def wrap(owner, name, who):
        real = getattr(owner, name)

        def faulty(*args, **kw):
            _is_victim(who(*args))
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, faulty)

    tok = sched.service.tokenizer
    victim_in = lambda items: VICTIM if any(VICTIM in tok.decode(x) for x in items) else ""  # noqa: E731
    if stage == "plan":
        wrap(Prepared, "plan", lambda prep, *_: prep.ask.query)
    elif stage == "prefill":
        wrap(scheduler_module, "fuse_batch", lambda _runner, requests: victim_in([r[2] for r in requests]))
    elif stage == "piece":
        wrap(Piecewise, "step", lambda piece, *_: piece.prep.ask.query)
    elif stage == "advance":
        wrap(Sequence, "advance", lambda seq: seq.prep.ask.query)
    elif stage == "result":
        wrap(Sequence, "result", lambda seq, *_: seq.prep.ask.query)
    elif stage == "decode":
        wrap(decoding_module, "decode_batch", lambda _runner, caches, _tokens: VICTIM if any(
            seq.cache in caches and seq.prep.ask.query == VICTIM for _, seq in list(sched._seqs.running)) else "")


@pytest.mark.parametrize("stage", ["plan", "prefill", "piece", "advance", "result", "decode"])
def test_an_exception_at_any_stage_fails_that_request_alone(sched, monkeypatch, stage):
    _inject(monkeypatch, sched, stage)
    if stage == "decode":  # the victim joins a decode batch of the others
        others = [_submit(sched, q, tokens=12) for q in OTHERS]
        victim = _submit(sched, VICTIM)
    else:  # the victim leads a prefill batch
        victim = _submit(sched, VICTIM, mode="full" if stage == "piece" else "reuse")
        others = [_submit(sched, q) for q in OTHERS]
    for done, _ in [victim, *others]:
        assert done.wait(180), f"a request never answered after a fault in {stage}"
    assert victim[1][0][0] == "error" and isinstance(victim[1][0][1], Injected)
    assert [box[0][0] for _, box in others] == ["done", "done"], [box for _, box in others]
    monkeypatch.undo()
    again = _submit(sched, OTHERS[0])  # the thread lives on
    assert again[0].wait(180) and again[1][0][0] == "done"
    assert sched.kv_in_use == 0 and sched.admission.waiting == 0  # released exactly once


def test_a_generate_answers_while_the_jobs_lock_is_held(sched):
    """`Jobs.start` holds its lock across SQL and a child's spawn: the model thread must not wait on it."""
    with sched.service.jobs._lock:
        done, box = _submit(sched, OTHERS[1])
        assert done.wait(120), "the model thread waited on the jobs lock"
    assert box[0][0] == "done"


def test_a_custom_system_prompt_is_cached_per_namespace_inside_the_budget(sched):
    """Tenant A's prompt X is computed on the side worker and kept for A; B's first use of X is a miss."""
    gen, x = sched.service.generation, "Answer in as few words as you can, and never guess."
    a = Ask(OTHERS[0], NAMESPACE, top_k=2, mode="reuse", max_new_tokens=4, system=x)
    assert gen.needs_prefix(a)
    done, box = threading.Event(), []
    sched.submit_generation(a, lambda kind, p: kind != "text" and (box.append((kind, p)), done.set()))
    assert done.wait(180) and box[0][0] == "done", box
    assert not gen.needs_prefix(a)  # cached for A's namespace
    assert gen.needs_prefix(Ask(OTHERS[0], "another-tenant", system=x))  # a miss for B, as a cold prompt is
    assert 0 < gen.prefixes.nbytes <= gen.prefixes.max_bytes
    assert _gauge(Metrics(sched.service, sched), "ragcache_prompt_heads_bytes") == gen.prefixes.nbytes
    with sched._cond:
        sched.admission.prefixes.shrink(0)  # what admission does when a request needs the budget
    assert gen.prefixes.nbytes == 0 and gen.needs_prefix(a)
    assert _gauge(Metrics(sched.service, sched), "ragcache_prompt_heads_bytes") == 0


def _gauge(metrics: Metrics, name: str) -> float:
    text = metrics.render().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_another_tenants_short_prefill_runs_between_the_pieces_of_a_long_one(sched):
    """Tenant A's `full` prompt (~1,300 rows, at most 256 a step) runs in pieces; tenant B's `reuse` request,
    submitted just after it, is prefilled between two pieces, so B answers first."""
    order, done = [], threading.Semaphore(0)

    def on_event(tenant):
        return lambda kind, _p: kind != "text" and (order.append((tenant, kind)), done.release())

    long_query = " ".join([OTHERS[0]] * 200)
    sched.submit_generation(Ask(long_query, NAMESPACE, top_k=2, mode="full", max_new_tokens=1, tenant="a"),
                            on_event("a"))
    sched.submit_generation(Ask(OTHERS[1], NAMESPACE, top_k=2, mode="reuse", max_new_tokens=1, tenant="b"),
                            on_event("b"))
    for _ in range(2):
        assert done.acquire(timeout=300), f"a request never answered: {order}"
    assert order == [("b", "done"), ("a", "done")]



def test_an_error_outside_any_request_fails_what_the_thread_holds_and_it_waits_again(sched, monkeypatch):
    """A step that raises before any request's own work (here: sharing the cores) at every step must not
    leave the requests it holds waiting forever nor spin: each hears the error, the budget comes back, and
    once the fault is gone the thread serves again."""
    streaming, calls = threading.Event(), []
    real = Scheduler._share_cores

    def broken(self):
        calls.append(1)
        raise Injected("outside any request")

    done, box = threading.Event(), []

    def on_event(kind, payload):
        if kind == "text":
            streaming.set()
        else:
            box.append((kind, payload))
            done.set()

    sched.submit_generation(Ask(OTHERS[0], NAMESPACE, top_k=2, mode="reuse", max_new_tokens=64, ignore_eos=True),
                            on_event)
    assert streaming.wait(180), "the request never started"
    monkeypatch.setattr(Scheduler, "_share_cores", broken)  # from its next step on, every step fails
    assert done.wait(120), "a request held by the model thread never heard of the failure"
    assert box[0][0] == "error" and isinstance(box[0][1], Injected)
    waiting = _submit(sched, OTHERS[1])  # arrives while every step fails: it fails too, it does not hang
    assert waiting[0].wait(120) and waiting[1][0][0] == "error"
    seen = len(calls)
    time.sleep(0.5)  # not a deadline: a spinning thread only fails more steps meanwhile
    assert len(calls) <= seen + 1, "the thread spins on a failing step with nothing to do"
    assert sched.kv_in_use == 0 and sched.admission.waiting == 0 and sched.running == 0
    monkeypatch.setattr(Scheduler, "_share_cores", real)
    again = _submit(sched, OTHERS[0])
    assert again[0].wait(180) and again[1][0][0] == "done"


def test_a_repair_longer_than_a_step_runs_in_pieces_between_the_others_and_answers_as_alone(sched, monkeypatch):
    """Tenant A's `deferred@1` repair recomputes every row after its first token (~1,300, at most 256 a step):
    it runs in pieces, as a long prompt does, so tenant B's request, submitted as A's first token goes out,
    answers first; A's answer is the one it gets alone."""
    pieces, real_step = [], Piecewise.step

    def step(piece, *args):
        pieces.append(piece.seq is not None)
        return real_step(piece, *args)

    monkeypatch.setattr(Piecewise, "step", step)
    a = Ask(OTHERS[0], NAMESPACE, top_k=2, mode="deferred", ratio=1.0, max_new_tokens=2, ignore_eos=True, tenant="a")
    b = Ask(OTHERS[1], NAMESPACE, top_k=2, mode="reuse", max_new_tokens=1, tenant="b")
    order, boxes, done = [], {}, threading.Semaphore(0)

    def on_event(tenant):
        def handle(kind, payload):
            if kind == "text" and tenant == "a" and "b" not in boxes:
                boxes["b"] = None
                sched.submit_generation(b, on_event("b"))
            elif kind != "text":
                order.append((tenant, kind))
                boxes[tenant] = payload
                done.release()
        return handle

    sched.submit_generation(a, on_event("a"))
    for _ in range(2):
        assert done.acquire(timeout=300), f"a request never answered: {order}"
    assert order == [("b", "done"), ("a", "done")], order
    assert sum(pieces) >= 2, "the repair ran in one step"
    alone = sched.service.generation.generate(a)
    assert boxes["a"]["answer"] == alone["answer"]
    assert boxes["a"]["usage"]["recomputed_tokens"] == alone["usage"]["recomputed_tokens"]
    assert sched.kv_in_use == 0 and sched.running == 0
