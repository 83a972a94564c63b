"""Serving pieces without a server: streamed text, chat prompts, the model thread's queue."""
from __future__ import annotations

import random
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from blend import Reuse, Runner, compute_chunk, compute_prefix
from blend.batch import fuse_batch
from blend.cores import SWITCH_S, claim_cores
from blend.prompt import QUESTION, as_ids, chat_frame, conversation, encode
from blend.runner import SPARE_CACHES
from ragcache.config import Settings
from ragcache.errors import Busy
import ragcache.serving.admission as admission_module
from ragcache.serving.admission import SHARED_WINDOW_S, Admission, Limits
from ragcache.serving.groups import groups
from ragcache.serving.prefixes import PrefixCache
from ragcache.serving.scheduler import Scheduler
from ragcache.serving.sequence import Prepared
from ragcache.serving.tally import ServingStats
from ragcache.serving.textstream import TextStream
from ragcache.serving.ticket import Ticket


@pytest.mark.parametrize("text", ["  Exeter College, Oxford.  ", "Zürich — 東京 café 🙂 done", "a\n\n b  c ", " "])
def test_streamed_deltas_add_up_to_the_stripped_answer(smollm, text):
    tok = smollm.tokenizer
    ids = encode(tok, text)
    stream, deltas = TextStream(tok), []
    for i in ids:
        deltas.append(stream.push(i))
        assert "\ufffd" not in "".join(deltas)  # never half a character
    deltas.append(stream.finish())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True).strip() == stream.sent


def _streamed(tok, ids) -> tuple[str, TextStream]:
    stream = TextStream(tok)
    return "".join(stream.push(i) for i in ids) + stream.finish(), stream


def test_split_characters_and_stray_bytes_stream_as_the_whole_decode(smollm):
    """Byte-level tokens (half a character, a lone continuation byte) mixed with whole words."""
    tok, rng = smollm.tokenizer, random.Random(0)
    byte_ids = [i for t, i in tok.get_vocab().items() if len(t) == 1]
    for _ in range(200):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(len(tok))
               for _ in range(rng.randrange(1, 40))]
        text, stream = _streamed(tok, ids)
        assert text == tok.decode(ids, skip_special_tokens=True).strip() == stream.sent, ids


def test_a_stop_string_ends_the_answer_before_it_and_no_delta_ever_holds_a_piece_of_it(smollm):
    """OpenAI's `stop`: the answer is the text before the first stop string written (stripped, as every answer is),
    the stream says `stopped` at the token that completes it, and a piece of a stop string (which the next token
    may or may not complete) is held back, never sent: the deltas are a prefix of the answer at every token."""
    tok, rng = smollm.tokenizer, random.Random(1)
    words = ["Paris", " is", " the", "\n", "\n\n", " Question", ":", " capital", " of", " France", ".", " Q", "ue"]
    for _ in range(300):
        ids = encode(tok, "".join(rng.choice(words) for _ in range(rng.randrange(1, 14))))
        text = tok.decode(ids, skip_special_tokens=True)
        stops = tuple(rng.sample(["\n\n", "Question:", " of F", ".", "xyz", "Q"], rng.randrange(1, 3)))
        stream, deltas, pushed = TextStream(tok, stops), [], 0
        for i in ids:
            deltas.append(stream.push(i))
            pushed += 1
            assert not any(s in d for d in deltas for s in stops)
            if stream.stopped:
                break
        deltas.append(stream.finish())
        starts = [at for at in (text.lstrip().find(s) for s in stops) if at >= 0]
        want = text.lstrip()[:min(starts)].strip() if starts else text.strip()
        assert "".join(deltas) == want == stream.sent, (text, stops, deltas)
        assert stream.stopped == bool(starts)
        if starts:  # it stopped at the token that completed the first stop string, not later
            before = tok.decode(ids[:pushed - 1], skip_special_tokens=True).lstrip()
            assert not any(s in before for s in stops), (text, stops)
    stream = TextStream(tok, ("Question:",))  # a piece held back, then let go when the next token settles it
    assert [stream.push(i) for i in encode(tok, "Paris Quest")] and stream.sent == "Paris"
    assert stream.finish() == " Quest" and stream.sent == "Paris Quest" and not stream.stopped


class _Counting:
    """The real tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_streaming_decodes_each_token_a_few_times_not_the_whole_answer(smollm):
    ids = encode(smollm.tokenizer, "Zürich — 東京 café 🙂 word " * 200)
    counting = _Counting(smollm.tokenizer)
    text, _ = _streamed(counting, ids)
    assert text == smollm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    assert counting.decoded < 8 * len(ids)  # re-decoding the answer per token: ~len(ids)**2 / 2


def test_one_turn_conversation_is_the_plain_prompt(smollm):
    tok, system = smollm.tokenizer, "Answer briefly."
    frame = chat_frame(tok, system)
    head, suffix = conversation(tok, system, [("user", "Where is it?")])
    assert head == frame.head and suffix == encode(tok, QUESTION + "Where is it?") + frame.tail


def test_earlier_turns_follow_the_passages_and_a_system_prompt_makes_its_own_head(smollm):
    tok = smollm.tokenizer
    head, suffix = conversation(tok, "Be terse.", [("user", "Who wrote it?"), ("assistant", "Nabbes."),
                                                  ("user", "Where was he educated?")])
    text = tok.decode(suffix)
    assert text.startswith(QUESTION + "Who wrote it?") and text.index("Nabbes.") < text.index("Where was he")
    assert "Be terse." in tok.decode(head) and head != chat_frame(tok, "Other.").head
    with pytest.raises(ValueError):
        conversation(tok, "x", [("user", "q"), ("assistant", "a")])


def _scheduler(max_queue: int, threads: int = 1) -> Scheduler:
    settings = Settings(threads=threads)
    service = SimpleNamespace(settings=settings, jobs=SimpleNamespace(working=lambda: 0),
                              generation=SimpleNamespace(prefixes=PrefixCache(SimpleNamespace(settings=settings))))
    return Scheduler(service, max_queue)


def _call(sched: Scheduler, work):
    """Submit and wait: (kind, payload) of the end event."""
    done, box = threading.Event(), []
    sched.submit(lambda _t: work(), lambda kind, payload: (box.append((kind, payload)), done.set()))
    assert done.wait(30)
    return box[-1]


def test_a_full_queue_says_busy_and_a_cancelled_waiter_never_runs():
    sched = _scheduler(max_queue=1)
    release, started, ran, events = threading.Event(), threading.Event(), [], []

    def blocking(_t):
        started.set()
        release.wait(10)
        return "first"

    sched.submit(blocking, lambda k, p: events.append((k, p)))
    started.wait(10)
    waiting = sched.submit(lambda _t: ran.append(1), lambda k, p: events.append((k, p)))
    with pytest.raises(Busy) as busy:
        sched.submit(lambda _t: None, lambda k, p: None)
    assert busy.value.retry_after >= 1 and sched.waiting == 1 and sched.running == 1
    waiting.cancel()
    release.set()
    while sched.waiting:  # the cancelled one leaves the queue without running
        time.sleep(0.01)
    assert _call(sched, lambda: "after") == ("done", "after")
    assert ran == [] and ("done", "first") in events and ("cancelled", None) in events
    sched.close()


def test_errors_reach_the_caller_and_the_thread_lives_on():
    sched = _scheduler(max_queue=4)
    kind, error = _call(sched, lambda: 1 / 0)
    assert kind == "error" and isinstance(error, ZeroDivisionError)
    assert _call(sched, lambda: 42) == ("done", 42)
    sched.close()


def test_side_work_runs_torch_on_one_core_and_leaves_the_others_their_count():
    """Only the computing thread may keep an OpenMP team (blend/cores.py): a second team made every decode
    step 1.3x slower. The count is per thread: the side worker's 1 reaches neither the caller, which
    claimed its count, nor a thread that starts later and claims its own."""
    claim_cores()
    before = torch.get_num_threads()
    sched = _scheduler(max_queue=4)
    assert _call(sched, torch.get_num_threads) == ("done", 1)
    later = []
    worker = threading.Thread(target=lambda: (claim_cores(2), later.append(torch.get_num_threads())))
    worker.start()
    worker.join()
    assert torch.get_num_threads() == before and later == [2]
    sched.close()


def test_the_model_thread_leaves_a_core_to_side_work_and_takes_the_lock_back_quickly():
    """While the side worker runs an item (an ingest's Python keeps a core busy) the model thread's team is a
    thread smaller, and every thread waits at most SWITCH_S for the interpreter lock: beside an ingest, a
    generate's small ops each waited out the default 5 ms (blend/cores.py)."""
    claim_cores()
    before, interval = torch.get_num_threads(), sys.getswitchinterval()
    sched = _scheduler(max_queue=4, threads=2)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_S)
    release, started = threading.Event(), threading.Event()
    sched.submit(lambda _t: (started.set(), release.wait(30)), lambda k, p: None)
    assert started.wait(30)
    sched._share_cores()  # what every step does first, here on this thread
    assert torch.get_num_threads() == 1
    release.set()
    deadline = time.monotonic() + 30
    while sched.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sched._share_cores()
    assert torch.get_num_threads() == 2
    sched.close()
    claim_cores(before)
    sys.setswitchinterval(interval)


def test_close_cancels_what_waits():
    sched = _scheduler(max_queue=4)
    started, events = threading.Event(), []
    sched.submit(lambda t: started.set() or t.cancelled.wait(30), lambda k, p: events.append((k, p)))
    sched.submit(lambda _t: "never", lambda k, p: events.append((k, p)))
    started.wait(10)
    sched.close()  # the running one sees its cancel at once, the waiting one never starts
    assert sorted(events) == [("cancelled", None), ("done", True)]


class _NoHead(list):
    """An empty prompt head: no tokens, no key."""
    key = None


def _request(admission: Admission, tenant: str, recompute: int = 20) -> None:
    """One request of `tenant` through the door and ready (100 bytes of KV, 20 rows; `recompute` of them)."""
    who = SimpleNamespace(who=tenant)
    policy = SimpleNamespace(plan=lambda layout, num_layers: SimpleNamespace(recompute_rows=recompute))
    prep = Prepared(ask=who, policy=policy, sampling=SimpleNamespace(max_new_tokens=10), prefix=_NoHead(),
                    suffix=torch.zeros(10),
                    chunks=[], hits=[], tiers=[], stops=frozenset(), kv_bytes=100)
    admission.enter(0, tenant)
    admission.ready(Ticket(lambda kind, payload: None, ask=who), prep)


def test_tenant_shares_hold_only_while_another_tenant_is_ready():
    """A tenant alone may use the whole budget past its share; once another is ready, it passes."""
    limits = Limits(max_queue=10, kv_budget=400, tenant_queue=10, tenant_running=1, tenant_tokens=0, step_rows=1000,
                    shared_step_rows=50)  # 4 fit
    admission = Admission(limits, ServingStats(), SimpleNamespace(shrink=lambda room: None))
    for _ in range(3):
        _request(admission, "a")
    admission.admit()
    assert len(admission.admitted) == 3  # alone: three running, its share is one
    _request(admission, "a")
    _request(admission, "b")
    admission.admit()
    assert [t.tenant for t, _ in admission.admitted][3:] == ["b"]  # a's turn, but past its share while b waits
    assert [t.tenant for t, _ in admission.ready_lines] == ["a"]


def test_a_step_is_short_while_two_tenants_share_the_model_and_its_batch_takes_tenants_in_turn():
    limits = Limits(max_queue=10, kv_budget=10_000, tenant_queue=10, tenant_running=10, tenant_tokens=0,
                    step_rows=1000, shared_step_rows=50)
    admission = Admission(limits, ServingStats(), SimpleNamespace(shrink=lambda room: None))
    for _ in range(3):
        _request(admission, "a", recompute=40)
    admission.admit()
    assert admission.step_rows == 1000  # a alone
    _request(admission, "b", recompute=10)
    admission.admit()
    assert admission.step_rows == 50
    batch, too_long, _ = admission.take_prefill(num_layers=2)
    assert [t.tenant for t, _ in batch] == ["a", "b"] and not too_long  # b passes a's next two
    batch, too_long, _ = admission.take_prefill(num_layers=2)
    assert [t.tenant for t, _ in batch] == ["a"]
    admission = Admission(limits, ServingStats(), SimpleNamespace(shrink=lambda room: None))
    _request(admission, "a", recompute=60)  # longer than a shared step: alone, in pieces
    _request(admission, "b", recompute=10)
    admission.admit()
    batch, _, _ = admission.take_prefill(num_layers=2, long_ok=False)  # while another long one runs
    assert [t.tenant for t, _ in batch] == ["b"]  # the long one waits, the short one passes it
    batch, too_long, _ = admission.take_prefill(num_layers=2)
    assert [t.tenant for t, _ in batch] == ["a"] and too_long


def test_a_step_takes_at_most_a_group_of_prompts_tenants_in_turn_and_the_rest_wait_admitted():
    """`most` (the scheduler's `group_size` where running KV is compacted): a step's prefill takes that many
    prompts, rows to spare or not; the others stay admitted, in their turn, for the next steps."""
    limits = Limits(max_queue=10, kv_budget=10_000, tenant_queue=10, tenant_running=10, tenant_tokens=0,
                    step_rows=1000, shared_step_rows=1000)
    admission = Admission(limits, ServingStats(), SimpleNamespace(shrink=lambda room: None))
    for tenant in "aaab":
        _request(admission, tenant, recompute=10)
    admission.admit()
    taken = [[t.tenant for t, _ in admission.take_prefill(num_layers=2, most=2)[0]] for _ in range(3)]
    assert taken == [["a", "b"], ["a", "a"], []] and not admission.admitted
    for tenant in "ab":
        _request(admission, tenant, recompute=10)
    admission.admit()
    assert len(admission.take_prefill(num_layers=2)[0]) == 2  # no `most`: every prompt that fits


def test_steps_stay_short_for_the_window_after_two_tenants_end_then_grow(monkeypatch):
    """Both tenants' requests end: the step stays short for SHARED_WINDOW_S (the next request of either
    may be about to arrive), then one tenant's step is long again. A clock of our own: no waiting."""
    now = [1000.0]
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                                  perf_counter=time.perf_counter))
    limits = Limits(max_queue=10, kv_budget=10_000, tenant_queue=10, tenant_running=10, tenant_tokens=0,
                    step_rows=1000, shared_step_rows=50)
    admission = Admission(limits, ServingStats(), SimpleNamespace(shrink=lambda room: None))
    _request(admission, "a", recompute=10)
    _request(admission, "b", recompute=10)
    admission.admit()
    batch, _, _ = admission.take_prefill(num_layers=2)
    assert admission.step_rows == 50
    for _ticket, prep in batch:
        admission.release(prep)
    now[0] += SHARED_WINDOW_S - 1
    assert admission.step_rows == 50 and not admission.shares  # ended, still within the window
    now[0] += 2
    assert admission.step_rows == 1000


@torch.inference_mode()
def test_a_compacted_batch_runs_in_groups_each_writing_into_the_last_groups_working_caches(smollm):
    """On the CPU with int8 running KV, a batch's fused prefills run SPARE_CACHES at a time: each group's float
    working caches are the ones the group before released (warm pages), and each request's first token is the
    whole batch's. With float running KV (nothing compacted) the batch runs whole."""
    runner, tok = Runner(smollm), smollm.tokenizer  # a runner of its own: its spare caches start empty
    prefix = compute_prefix(runner, as_ids(encode(tok, "Passages:")))
    requests = [(prefix, [compute_chunk(runner, as_ids(encode(tok, f"Passage {i}: the college opened in 16{i}0.")),
                                        prefix)], as_ids(encode(tok, f" Question {i}: when?")), Reuse(), 4)
                for i in range(5)]
    assert groups(runner, torch.float32, requests) == [requests]
    grouped = groups(runner, torch.int8, requests)
    assert [len(g) for g in grouped] == [SPARE_CACHES, SPARE_CACHES, 1] and sum(grouped, []) == requests
    whole = [r.logits for r in fuse_batch(runner, requests)]
    first, logits = None, []
    for group in grouped:
        fused = fuse_batch(runner, group)
        working = {f.cache.k.data_ptr() for f in fused}
        first = first or working
        assert working <= first  # the first group's caches, released below, reused
        for f in fused:
            runner.compact(f.cache, torch.int8)
            logits.append(f.logits)
    for a, b in zip(logits, whole):
        assert int(a.argmax()) == int(b.argmax()) and torch.allclose(a, b, atol=1e-3)
