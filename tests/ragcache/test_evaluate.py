"""`ragcache eval` and `ragcache calibrate` on a 2-question, 2-passage file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blend import A3, Adaptive, BlendQ, CacheBlend, Epic, Full, Probe, Reuse
from blend.reweight import Reweight, Reweighted
from blend.labels import parse
from ragcache.config import Settings
from ragcache.evaluation.evaluate import EvalConfig, evaluate, load_dataset, policies
from ragcache.evaluation.results import METRICS
from ragcache.errors import UserError

DEMO = Path(__file__).resolve().parents[2] / "demo" / "data" / "musique_demo.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Two questions, each with its first two passages cut to 100 words (about 150 tokens)."""
    path = tmp_path_factory.mktemp("eval") / "tiny.json"
    items = json.loads(DEMO.read_text())[:2]
    path.write_text(json.dumps([{**q, "ctxs": [{**c, "text": " ".join(c["text"].split()[:100])} for c in q["ctxs"][:2]]}
                                for q in items]))
    return path


def test_eval_writes_valid_results_and_full_recompute_matches_full(tmp_path, tiny, smollm):
    env = {**os.environ, "RAGCACHE_HOME": str(tmp_path / "home"), "RAGCACHE_MODEL": str(smollm.path)}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ragcache.cli", "eval", "--dataset", str(tiny), "--top-k", "2",
                        "--modes", "full,reuse,cacheblend,epic,probe,deferred", "--ratios", "1.0,0.15", "--epic-k", "4",
                        "--probe-ratios", "1.0,0.1", "--probe-epic-k", "2", "--probe-layers", "0",
                        "--deferred-ratios", "1", "--no-ape",
                        "--chunk-prefill", "alone",
                        "--max-new-tokens", "8", "--out", str(out), "--quiet"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    assert {"model", "dataset", "n", "top_k", "modes", "per_question"} <= set(res) and res["n"] == 2
    assert list(res["modes"]) == ["full", "reuse", "cacheblend@1", "cacheblend@0.15", "epic@4", "probe@1+epic@2",
                                 "probe@0.1+epic@2", "deferred@1"]
    assert res["knobs"]["probe_epic_k"] == 2
    for m in res["modes"].values():
        assert set(m) == set(METRICS)
    full, exact = res["modes"]["full"], res["modes"]["cacheblend@1"]
    assert full["f1_vs_full"] == 1 and full["kl_tf"] == 0 and full["top1_agree"] == 1
    assert exact["f1_vs_full"] == 1 and exact["top1_agree"] == 1 and exact["kl_tf"] < 1e-6
    assert exact["recompute_fraction"] == 1 and res["modes"]["reuse"]["recompute_fraction"] == 0
    assert exact["work_fraction"] == pytest.approx(1)
    assert res["modes"]["reuse"]["work_fraction"] < 0.1  # the question's rows, against ~300 passage tokens
    assert res["modes"]["reuse"]["speedup_vs_full"] > 1
    probe, probe_exact = res["modes"]["probe@0.1+epic@2"], res["modes"]["probe@1+epic@2"]
    assert probe_exact["kl_tf"] < 1e-6 and probe_exact["top1_agree"] == 1
    assert 0 < probe["recompute_fraction"] < probe["work_fraction"] < 0.5  # work counts the suffix and the probe
    reuse, deferred = res["modes"]["reuse"], res["modes"]["deferred@1"]  # reuse's first token, then full's KV
    assert deferred["kl_first"] == pytest.approx(reuse["kl_first"]) and deferred["top1_agree"] == reuse["top1_agree"]
    assert deferred["kl_tf"] < reuse["kl_tf"] and deferred["recompute_fraction"] == 1
    assert deferred["repair_s_median"] > 0 and reuse["repair_s_median"] == 0
    assert (out / "results.csv").read_text().splitlines()[0] == "mode," + ",".join(METRICS)
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_with_hybrid_retrieval_and_the_reranker_runs_and_reorders(tmp_path, tiny, smollm):
    """`eval --retrieval hybrid --rerank N` end to end: the passages retrieved over the whole file, their chunk KV
    computed, reordered by the deployment's reranker (attention), then every mode over the top-k (its first real run
    crashed on a spare cache; test_cache holds that case)."""
    from ragcache.evaluation.evaluate import evaluate
    from ragcache.service import RagCache

    service = RagCache(Settings(home=tmp_path / "home", model=str(smollm.path), ape_factor=1.0))
    cfg = EvalConfig(tiny, modes=["full", "cacheblend"], ratios=[1.0], top_k=2, max_new_tokens=4, retrieval="hybrid",
                     rerank=3, ape=[])
    try:
        res = evaluate(service, cfg, progress=False)
    finally:
        service.close()
    assert res["n"] == 2 and res["retrieval"] == "hybrid+rerank@3:attention"
    exact = res["modes"]["cacheblend@1"]  # the passages the reranker chose, recomputed whole: full's answer
    assert exact["top1_agree"] == 1 and exact["kl_tf"] < 1e-6


def test_eval_with_lead_computes_chunks_behind_a_passage_of_the_questions_it_does_not_evaluate(tmp_path, tiny, smollm):
    """`ragcache eval --chunk-prefill lead` without RAGCACHE_CHUNK_LEAD: the lead is picked (lead.py) from the
    passages of the questions past --limit, named in the results; RAGCACHE_CHUNK_LEAD, when set, is used instead."""
    from ragcache import RagCache
    from ragcache.evaluation.evaluate import dataset_lead, evaluate

    with RagCache(Settings(home=tmp_path, model=str(smollm.path))) as service:
        cfg = EvalConfig(tiny, modes=["full", "reuse"], ape=[], top_k=2, chunk_prefill="lead", limit=1,
                         max_new_tokens=2)
        results = evaluate(service, cfg, progress=False)
        data = load_dataset(tiny, None)
        assert results["lead"] in {c["text"] for c in data[1]["ctxs"]}
        assert results["modes"]["reuse"]["kl_tf"] > 0  # every chunk stale, the first too
    with RagCache(Settings(home=tmp_path, model=str(smollm.path), chunk_lead="A passage.")) as named:
        assert dataset_lead(named, data) == "A passage."


def test_calibrate_stores_the_fastest_mode_within_the_target(tmp_path, tiny, smollm):
    from ragcache.evaluation.calibrate import calibrate
    from ragcache.meta import ModelDefault
    from ragcache.service import RagCache

    service = RagCache(Settings(home=tmp_path / "home", model=str(smollm.path), ape_factor=1.0))  # APE off
    # also the other paths: passages found by FAISS, chunk KV read back from the disk tier
    cfg = EvalConfig(tiny, modes=["full", "reuse", "cacheblend"], ratios=[0.5], top_k=2, max_new_tokens=4,
                     retrieval="dense", tier="disk", ape=[])
    loose = calibrate(service, cfg, target_kl=10.0, progress=False)
    assert loose.label == "reuse" and loose.speedup > 1  # everything fits: the fastest wins
    assert service.policy_for("auto") == Reuse()
    with service.db.session() as s:
        row = s.get(ModelDefault, service.model.fingerprint)
        points = {p["label"]: p["kl"] for p in json.loads(row.points)}
    assert set(points) == {"full", "reuse", "cacheblend@0.5"} and (row.mode, row.param) == ("reuse", None)
    assert service.policy_for("auto", target_kl=0.0) == Full()  # a request's own target picks again: nothing
    # approximate has zero KL
    with pytest.raises(UserError, match="ragcache calibrate"):  # adaptive was not measured
        service.policy_for("adaptive", target_kl=0.05)
    with pytest.raises(UserError, match="auto or adaptive"):
        service.policy_for("probe", target_kl=0.05)
    assert service.policy_for("adaptive") == Adaptive()  # without a target: its own default coverage
    with service.db.session() as s:  # a calibration from before schema 7 (a mode and its knob), read back by `auto`
        s.merge(ModelDefault(fingerprint=service.model.fingerprint, mode="probe", param=0.2, target_kl=0.1,
                             measured_kl=0.05, speedup=5.0, dataset="x", points=None))
    assert service.policy_for("auto") == Probe(ratio=0.2)
    assert service.policy_for("blendq", ratio=0.3) == BlendQ(ratio=0.3) and service.policy_for("a3") == A3()
    service.generation.p.settings = Settings(home=tmp_path / "home", model=str(smollm.path), ape_factor=0.5,
                                             probe_layers=4)
    ape = service.policy_for("epic", k=8)  # APE set for the server: every policy reading chunk KV gets it
    assert ape == Reweighted(Epic(k=8), Reweight(1.0, 0.5)) and ape.name == "epic" and ape.k == 8
    assert service.policy_for("probe", ratio=0.02) == Reweighted(Probe(0.02, layers=4), Reweight(1.0, 0.5))
    assert service.policy_for("auto") == Reweighted(Probe(0.2), Reweight(1.0, 0.5))  # as calibrate measured it
    assert service.policy_for("full") == Full()
    service.generation.p.settings = Settings(home=tmp_path / "home", model=str(smollm.path))
    served = service.policy_for(Settings().mode)  # the defaults: what measured best at cacheblend's speed
    assert served == Reweighted(Probe(0.1), Reweight(1.0, 0.5)) and served.layers == 0
    assert Settings().chunk_prefill == "lead" and not Settings().chunk_lead  # each namespace's own lead: measured best
    service.close()


def test_calibrate_measures_the_servers_own_ape_beside_the_variants_and_the_server_uses_what_it_stores(tmp_path, tiny,
                                                                                                        smollm):
    from ragcache.evaluation.calibrate import calibrate
    from ragcache.meta import ModelDefault
    from ragcache.service import RagCache

    home = tmp_path / "home"
    service = RagCache(Settings(home=home, model=str(smollm.path)))
    server = (service.settings.ape_temperature, service.settings.ape_factor)
    cfg = EvalConfig(tiny, modes=["full", "reuse"], top_k=2, max_new_tokens=4, ape=[(0.8, 0.25)])  # and none
    choice = calibrate(service, cfg, target_kl=10.0, progress=False)
    with service.db.session() as s:
        row = s.get(ModelDefault, service.model.fingerprint)
    kls = {p["label"]: p["kl"] for p in json.loads(row.points)}
    assert set(kls) == {"full", "reuse", "reuse+ape@0.8,0.25", f"reuse+ape@{server[0]:g},{server[1]:g}"}
    assert choice.ape.n == 2 and choice.ape.ape == server  # 2 questions: no variant beats the server's beyond chance
    assert row.ape == f"{server[0]:g},{server[1]:g}" and "APE for this model" in choice.line()
    with service.db.session() as s:  # a calibration that found another APE: the server serves it
        s.get(ModelDefault, service.model.fingerprint).ape = "0.8,0.25"
    assert service.policy_for("reuse") == Reweighted(Reuse(), Reweight(0.8, 0.25))
    service.generation.p.settings = Settings(home=home, model=str(smollm.path), ape_temperature=0.9)
    assert service.policy_for("reuse") == Reweighted(Reuse(), Reweight(0.9, 0.5))  # named: the settings win
    assert row.chunk_prefill == "lead" and service.policy_for("auto").name == "reuse"
    service.generation.p.settings = Settings(home=home, model=str(smollm.path), chunk_prefill="prefixed")
    default = Settings()  # measured over chunk KV behind a lead: not this server's, so neither its APE nor its points
    assert service.policy_for("reuse") == Reweighted(Reuse(), Reweight(default.ape_temperature, default.ape_factor))
    assert service.policy_for("auto").name == default.mode
    service.close()


def _questions(kls: dict[str, list[float]]) -> list[dict]:
    """An eval's per_question from each label's KL per question."""
    n = len(next(iter(kls.values())))
    return [{"modes": {text: {"kl_tf": v[i]} for text, v in kls.items()}} for i in range(n)]


def test_an_ape_displaces_the_servers_only_where_lower_on_the_same_questions_beyond_chance():
    from ragcache.evaluation.calibrate import OFF, ape_kls, pick_ape
    from ragcache.evaluation.paired import p_lower

    server, other = (1.0, 0.5), (0.9, 0.4)
    kls = {"full": [0.0] * 6, "reuse": [0.10] * 6, "probe@0.1": [0.06] * 6,
           "epic@16": [0.2] * 6,  # no APE variant of it: not compared
           "reuse+ape@1,0.5": [0.07] * 6, "probe@0.1+ape@1,0.5": [0.05] * 6,  # the server's APE
           "reuse+ape@0.9,0.4": [0.05] * 6, "probe@0.1+ape@0.9,0.4": [0.04] * 6}
    assert ape_kls(_questions(kls))[other] == pytest.approx([0.045] * 6)  # the mean over reuse and probe
    pick = pick_ape(_questions(kls), server)  # lower on all 6 questions: p = 1/64
    assert pick.ape == other and pick.p == pytest.approx(1 / 64) and pick.mean[OFF] == pytest.approx(0.08)
    one = {**kls, "reuse+ape@0.9,0.4": [0.07] * 5 + [-0.01], "probe@0.1+ape@0.9,0.4": [0.05] * 5 + [-0.05]}
    pick = pick_ape(_questions(one), server)  # its mean is lower (0.052 against 0.06), all of it one question's
    assert pick.mean[other] < pick.mean[server] and pick.ape == server and pick.p > 0.05
    assert "within chance" in pick.line() and "temperature 1, factor 0.5" in pick.line()
    worse = {**kls, "reuse+ape@1,0.5": [0.2] * 6, "reuse+ape@0.9,0.4": [0.2] * 6}
    assert pick_ape(_questions(worse), server).ape == OFF  # APE hurts on every question: off
    assert pick_ape(_questions({"full": [0.0], "reuse": [0.1]}), server) is None  # no variant measured
    assert p_lower([0.0] * 3) == 1 and p_lower([-1.0, 1.0]) == 0.75 and p_lower([-1.0] * 20) < 1e-3  # 20: sampled


def test_calibrated_points_give_the_fastest_within_a_target_else_the_closest():
    from ragcache.meta import ModelDefault

    points = [("full", 0.0, 1.0), ("reuse", 0.2, 30.0), ("probe@0.1+ape@1,0.5", 0.05, 6.0),
              ("adaptive@0.5", 0.08, 12.0), ("adaptive@0.9+ape@1,0.5", 0.03, 5.0)]
    row = ModelDefault(points=json.dumps([{"label": l, "kl": k, "speedup": s} for l, k, s in points]))
    assert [row.fastest(t) for t in (0.0, 0.05, 0.1, 1.0)] == ["full", "probe@0.1+ape@1,0.5", "adaptive@0.5", "reuse"]
    assert [row.fastest(t, "adaptive") for t in (0.01, 0.05, 0.1)] == ["adaptive@0.9+ape@1,0.5"] * 2 + ["adaptive@0.5"]
    assert row.fastest(0.05, "epic") is None and ModelDefault().fastest(0.05) is None  # not measured


def test_eval_labels_name_every_variant(tmp_path):
    cfg = EvalConfig(tmp_path / "x.json", modes=["full", "reuse", "probe"], probe_ratios=[0.1], probe_layers=[0, 8],
                     ape=[(1.0, 0.5)])
    labels = dict(policies(cfg))
    assert list(labels) == ["full", "reuse", "probe@0.1", "probe@0.1+layers@8", "reuse+ape@1,0.5",
                            "probe@0.1+ape@1,0.5", "probe@0.1+layers@8+ape@1,0.5"]
    assert labels["probe@0.1+layers@8+ape@1,0.5"] == Reweighted(Probe(0.1, layers=8), Reweight(1.0, 0.5))
    more = dict(policies(EvalConfig(tmp_path / "x.json", modes=["cacheblend", "epic", "probe", "adaptive", "a3",
                                                                "deferred"],
                                    ratios=[0.15], epic_ks=[16], probe_ratios=[0.1], probe_layers=[4], probe_epic_k=2,
                                    coverages=[0.9], adaptive_layers=2, a3_window=1, ape=[(1.0, 0.5)])))
    assert {"adaptive@0.9+layers@2+ape@1,0.5", "epic@16", "probe@0.1+layers@4+epic@2", "a3@0.15+window@1",
            "deferred@0.2", "deferred@0.2+ape@1,0.5"} <= set(more)
    for label, policy in {**labels, **more}.items():  # what `auto` serves is the policy its label names
        assert parse(label) == policy, label
    for bad in ("nope@1", "epic@x", "reuse@0.5", "probe@2", "cacheblend@0.1+layers@2", "reuse+ape@0,1"):
        with pytest.raises(ValueError, match="nope|bad policy label"):
            parse(bad)
    with pytest.raises(UserError, match="temperature and factor"):
        policies(EvalConfig(tmp_path / "x.json", modes=["reuse"], ape=[(0.0, 1.0)]))


def test_bad_eval_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"question": "q"}]')
    with pytest.raises(UserError, match="expected a list"):
        load_dataset(bad, None)
    with pytest.raises(UserError, match="not found"):
        load_dataset(tmp_path / "missing.json", None)
    with pytest.raises(UserError, match="unknown mode"):
        policies(EvalConfig(bad, modes=["full", "turbo"]))


def test_a_probe_deeper_than_the_model_is_refused_by_name_not_run_through_every_layer(tmp_path, tiny, smollm):
    """30 layers: a probe through 99 would run through all 30 under a label that says 99. The eval refuses it by its
    flag, a server's setting at its warm-up (/ready says why) and at a probe request's policy (`ask` too)."""
    from ragcache import RagCache

    with RagCache(Settings(home=tmp_path, model=str(smollm.path))) as service:
        with pytest.raises(UserError, match="--probe-layers 99: this model has 30 layers"):
            evaluate(service, EvalConfig(tiny, modes=["full", "probe"], probe_layers=[4, 99]), progress=False)
        with pytest.raises(UserError, match="--adaptive-layers 31"):
            evaluate(service, EvalConfig(tiny, modes=["full", "adaptive"], adaptive_layers=31), progress=False)
    with RagCache(Settings(home=tmp_path, model=str(smollm.path), probe_layers=99)) as service:
        with pytest.raises(UserError, match="setting probe_layers: 99 is past this model's 30 layers"):
            service.policy_for("probe")
        assert service.policy_for("reuse").policy == Reuse()  # the setting is the probe's alone (APE around it)
        with pytest.raises(UserError, match="setting probe_layers"):
            service.warm(None)
    with RagCache(Settings(home=tmp_path, model=str(smollm.path), probe_layers=30)) as service:
        assert service.policy_for("probe").policy.layers == 30  # every layer, named: allowed


def test_frontier_keeps_the_modes_nothing_beats_on_speed_and_kl():
    from ragcache.evaluation.plot import frontier

    modes = {"full": {"speedup_vs_full": 1.0, "kl_tf": 0.0}, "a": {"speedup_vs_full": 5.0, "kl_tf": 0.08},
             "b": {"speedup_vs_full": 6.0, "kl_tf": 0.05}, "c": {"speedup_vs_full": 20.0, "kl_tf": 0.1},
             "d": {"speedup_vs_full": 4.0, "kl_tf": 0.05}}
    assert frontier(modes) == ["c", "b", "full"]  # a is slower and worse than b; d ties b's KL, slower


def test_the_widths_go_where_a_bit_saves_the_most_sensitivity_within_the_budget():
    """`allocate` on tables where the answer is known: from every tensor at the lowest width, each next raise to the one
    that saves the most per bit (sensitivity as measured, × 4^(m − w) at a width above the measured m), ties to K and
    the lower layer; a raise that does not fit is passed over for one that does; nothing goes where it saves nothing; a
    raise may skip a width that measured no gain; a pinned width is set and paid first."""
    from ragcache.evaluation.codec_calibrate import allocate

    flat = {w: [[float(w - 3)] * 2 for _ in "kv"] for w in range(2, 9)}  # every step a bit; 0 at the base

    def at3(k, v=(0.0, 0.0)):  # measured at 3 bits only
        return [{3: list(k)}, {3: list(v)}]

    assert allocate(at3([1.0, 0.0]), flat, (2, 5), 0.0) == [[5, 2], [2, 2]]  # 4 bits, 3 save
    # k0's steps save 3, 0.75, 0.19; k1's 0.75, 0.19: three bits go to k0, k0 (the tie's K0 first), then k1
    assert allocate(at3([1.0, 0.25]), flat, (2, 5), -1.0) == [[4, 3], [2, 2]]
    dear = {w: [[10.0 * (w - 3), 0.1 * (w - 3)], [0.1 * (w - 3)] * 2] for w in range(2, 9)}
    assert allocate(at3([1.0, 0.01]), dear, (2, 5), -9.5) == [[2, 5], [2, 2]]  # k0's step: 10 bits
    # V of layer 1 pinned at 8: its 5 bits paid first, 2 left (k0 to 4); it never moves, however sensitive
    assert allocate(at3([1.0, 0.0], [0.0, 5.0]), flat, (2, 5), 4.0, (1, 1, 8)) == [[4, 2], [2, 8]]
    # measured at 2 bits too: k1's step down costs 32x its 3-bit KL, k0's 4x; the one bit goes to k1, not to k0
    assert allocate([{3: [1.0, 0.5], 2: [4.0, 16.0]}, {3: [0.0, 0.0]}], flat, (2, 5), -3.0) == [[2, 3], [2, 2]]
    # k0's step to 3 measured no gain, its next one 0.75: both its bits go there (0.375 a bit), not to k1 (0.2)
    assert allocate([{3: [1.0, 0.1], 2: [1.0, 0.3]}, {3: [0.0, 0.0]}], flat, (2, 5), -2.0) == [[4, 2], [2, 2]]


def test_calibrate_codec_sets_each_tensors_width_by_its_sensitivity_and_cost_and_compact_then_uses_them(
        tmp_path, tiny, smollm):
    """`ragcache calibrate-codec` on one question: its chunks computed behind the deployment's lead (picked from the
    other question's passages, as `eval` picks it); V of cacheblend's check layer at 8 bits; every other tensor's
    width in 2..6 as `allocate` sets it from the measured sensitivities and costs, within the bits asked for;
    `compact` is then those widths, K's symbols by feedback against the weighting stored beside them."""
    from ragcache import RagCache
    from ragcache.evaluation.codec_calibrate import allocate, calibrate_codec, measured
    from ragcache.evaluation.evaluate import dataset_lead
    from ragcache.store.codecs import DEFAULT

    with RagCache(Settings(home=tmp_path, model=str(smollm.path), chunk_prefill="lead")) as service:
        items, behind = measured(service, tiny, 0, 1)
        lead = dataset_lead(service, load_dataset(tiny, None)[1:])
        assert [i["question"] for i in items] == [load_dataset(tiny, None)[0]["question"]]
        assert behind.key == service.chunk_prefix(how="lead", lead=lead).key != service.prefix.key
        assert service.codec_spec("compact") == service.codec_spec(DEFAULT)  # not calibrated yet
        spec, report = calibrate_codec(service, tiny, 0, 1, [2, 1], (3, 3), 3.2, progress=lambda _: None)
        sens, layers = report["sensitivity"], service.runner.num_layers
        cost = {int(w): [c["k"], c["v"]] for w, c in report["cost_bits"].items()}
        assert report["chunk_prefill"] == "lead" and report["top_k"] == [2, 1]  # both counts' sensitivities add
        assert sorted(cost) == [2, 3, 4, 5, 6, 8] and sorted(sens["k"]) == sorted(sens["v"]) == ["2", "3"]  # base, lo
        every = [s for x in "kv" for s in sens[x].values()]
        assert all(len(s) == layers for s in every) and min(map(min, every)) >= 0  # a KL between two stores' outputs
        assert sum(sens["k"]["2"]) > sum(sens["k"]["3"]) > 0 and sens["v"]["2"][1] == sens["v"]["3"][1] == 0  # pinned
        for t in (0, 1):  # each width costs more than the one below it, on the sum over layers
            sums = [sum(cost[w][t]) for w in sorted(cost)]
            assert sums == sorted(sums) and len(set(sums)) == len(sums) and sums[1] == 0, sums
        assert report["check"] == {"tensor": "v", "layer": 1, "bits": 8} and spec.v_bits[1] == 8
        widths = [list(spec.k_bits), list(spec.v_bits)]
        measured_at = [{int(w): s for w, s in sens[x].items()} for x in "kv"]
        assert widths == allocate(measured_at, cost, (2, 6), 3.2 - report["base_bits"], (1, 1, 8))
        spent = report["base_bits"] + sum(cost[w][t][l] for t, row in enumerate(widths) for l, w in enumerate(row))
        assert abs(report["bits_per_element"] - spent) < 1e-9 and spent <= 3.2
        assert min(spec.k_bits + spec.v_bits) == 2 and max(spec.k_bits) > 4  # the widths move both ways
        assert service.codec_spec("compact") == spec
        assert torch.equal(service.codec_spec("compact").keys.h, spec.keys.h)  # K's feedback weighting stored too
        assert service.codec_spec("compact-k3v3+b+f").keys is not None
        with pytest.raises(UserError, match="--first 2"):
            measured(service, tiny, 2, 1)
