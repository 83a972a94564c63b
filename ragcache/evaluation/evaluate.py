"""Quality vs latency: every mode against full prefill on a MuSiQue/CacheBlend-format file.

Per question, each retrieved passage is one chunk whose KV is computed before any timing and
kept in the chosen tier. TTFT runs from the request start (loading chunk KVs from the tier)
to the first token. Fidelity is measured against full prefill of the same tokens: answer F1,
first-token agreement, KL(full ‖ mode) of the first token and, teacher-forced along the full
answer, of up to 16 more. Cost is reported twice: `recompute_fraction`, the share of passage
tokens recomputed on the last layer, and `work_fraction`, linear-layer work over full prefill's
(CacheBlend's all-row layers up to its check layer and the query probe's pass included).
"""
from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blend import A3, Adaptive, BlendQ, CacheBlend, Deferred, Epic, Full, Prefix, Probe, Reuse, compute_chunk
from blend.labels import label
from blend.reweight import Reweight, Reweighted
from blend.prompt import SEPARATOR, as_ids, encode

from ..config import EVAL_MODES, Settings
from ..lead import pick_lead
from ..database import Database
from ..errors import UserError
from ..store import TieredStore, decode as decode_kv, encode as encode_kv, kv_key
from ..store.disk import DiskTier
from ..store.memory import MemoryTier
from .measure import run_mode
from .retrieve import retriever
from .scores import best_f1, f1, kl



@dataclass
class EvalConfig:
    dataset: Path
    # the defaults are a plain `ragcache eval`'s: the frontier measured so far and the baselines it is held against
    modes: list[str] = field(default_factory=lambda: ["full", "reuse", "cacheblend", "epic", "probe", "adaptive",
                                                      "deferred"])
    ratios: list[float] = field(default_factory=lambda: [0.15])
    epic_ks: list[int] = field(default_factory=lambda: [16])
    probe_ratios: list[float] = field(default_factory=lambda: [0.02, 0.1])
    probe_epic_k: int = 0  # EPIC's first k per chunk inside every probe budget
    probe_layers: list[int] = field(default_factory=lambda: [0, 4])  # layers the probe runs through; 0: all
    coverages: list[float] = field(default_factory=lambda: [Adaptive.coverage])  # adaptive: attention covered
    adaptive_layers: int = Adaptive.layers  # adaptive: layers its probe runs through
    deferred_ratios: list[float] = field(default_factory=lambda: [Deferred.ratio])  # the repair after the first token
    # (temperature, factor): each mode again with APE; the server's built-in default
    ape: list[tuple[float, float]] = field(default_factory=lambda: [(Settings.model_fields["ape_temperature"].default,
                                                                     Settings.model_fields["ape_factor"].default)])
    a3_ratios: list[float] = field(default_factory=lambda: [0.15])
    a3_window: int = 2
    blendq_ratios: list[float] = field(default_factory=lambda: [0.12])
    top_k: int = 4
    retrieval: str = "given"  # given | dense | bm25 | hybrid (retrieve.py)
    rerank: int = 0  # with retrieval: candidates reranked on their chunk KV (by RAGCACHE_RERANKER)
    chunk_prefill: str = Settings.model_fields["chunk_prefill"].default  # alone | prefixed | lead
    kv_dtype: str = "auto"
    codec: str = "raw"  # RAGCACHE_KV_CODEC: every chunk KV goes through its encode and decode, as a disk hit would
    tier: str = "cpu"  # cpu | disk
    limit: int | None = None
    max_new_tokens: int = 24
    tf_tokens: int = 16


def load_dataset(path: Path, limit: int | None) -> list[dict]:
    """A MuSiQue/CacheBlend-format file: [{"question", "answers": [..], "ctxs": [{"title", "text"}]}]."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"dataset {path} not found") from None
    except OSError as e:
        raise UserError(f"dataset {path} cannot be read: {e.strerror}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise UserError(f"dataset {path} is not a JSON file: {e}") from None
    if not isinstance(data, list) or not all(_is_question(item) for item in data):
        raise UserError(f'{path}: expected a list of {{"question", "answers": [..], "ctxs": [{{"title", "text"}}]}}')
    return data[:limit] if limit else data


def _is_question(item) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("question"), str)
            and isinstance(item.get("answers"), list) and all(isinstance(a, str) for a in item["answers"])
            and isinstance(item.get("ctxs"), list)
            and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in item["ctxs"]))


def policies(cfg: EvalConfig) -> list[tuple[str, object]]:
    """(label, policy) in the results' naming: full, reuse, prefix, cacheblend@0.15, epic@16, adaptive@0.9 (its
    coverage), …; a probe through fewer layers is probe@0.1+layers@8, a mode with APE re-weighting cacheblend@0.15+ape@0.9,0.8."""
    unknown = set(cfg.modes) - set(EVAL_MODES)
    if unknown:
        raise UserError(f"unknown mode(s) {', '.join(sorted(unknown))}: use {', '.join(EVAL_MODES)}")
    out = [Full()]  # the reference: always measured
    out += [Reuse()] if "reuse" in cfg.modes else []
    out += [Prefix()] if "prefix" in cfg.modes else []
    try:
        out += [CacheBlend(ratio=r) for r in cfg.ratios] if "cacheblend" in cfg.modes else []
        out += [Epic(k=k) for k in cfg.epic_ks] if "epic" in cfg.modes else []
        out += ([Probe(r, cfg.probe_epic_k, n) for n in cfg.probe_layers for r in cfg.probe_ratios]
                if "probe" in cfg.modes else [])
        out += [Adaptive(c, cfg.adaptive_layers) for c in cfg.coverages] if "adaptive" in cfg.modes else []
        out += [A3(r, window=cfg.a3_window) for r in cfg.a3_ratios] if "a3" in cfg.modes else []
        out += [Deferred(r) for r in cfg.deferred_ratios] if "deferred" in cfg.modes else []
        out += [BlendQ(r, window=cfg.a3_window) for r in cfg.blendq_ratios] if "blendq" in cfg.modes else []
        ape = [Reweight(t, f) for t, f in cfg.ape]
    except ValueError as e:  # a knob out of range, named by the policy
        raise UserError(str(e)) from None
    out += [Reweighted(policy, rw) for rw in ape for policy in out if policy.reads_chunk_kv]
    return [(label(policy), policy) for policy in out]


class _Passages:
    """Each distinct passage's chunk KV, computed once and kept in the chosen tier."""

    def __init__(self, service, cfg: EvalConfig, root: Path, lead: str | None = None):
        self.service, self.cfg = service, cfg
        self.kv_dtype = service.kv_dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype
        self.spec = service.codec_spec(cfg.codec)
        room = 1 << 40 if cfg.tier == "cpu" else 0
        self.store = TieredStore(Database(f"sqlite:///{root / 'eval.db'}"), [MemoryTier("cpu", "cpu", room)],
                                 [DiskTier(root / "kv", 1 << 40)])
        self.behind = service.chunk_prefix(how=cfg.chunk_prefill, lead=lead)
        self.context = self.behind.key if self.behind is not None else ""
        self.token_ids: dict[str, torch.Tensor] = {}

    def ids(self, text: str) -> torch.Tensor:
        return as_ids(encode(self.service.tokenizer, text + SEPARATOR))

    def key(self, ids: torch.Tensor) -> str:
        return kv_key(self.service.model.fingerprint, ids, self.context, self.kv_dtype, "eval")

    def ensure(self, texts: list[str]) -> list[str]:
        keys = []
        for text in texts:
            ids = self.ids(text)
            key = self.key(ids)
            self.token_ids[key] = ids
            if not self.store.contains(key):
                kv = compute_chunk(self.service.runner, ids, self.behind)
                self.store.put(key, encode_kv(kv, self.kv_dtype, self.spec, self.service.runner.inv_freq))
            keys.append(key)
        return keys

    def load(self, keys: list[str]):
        m = self.service.model
        return [decode_kv(hit.entry, m.dtype, m.device) for hit in self.store.get_many(keys)]


def dataset_lead(service, others: list[dict], how: str = "lead") -> str | None:
    """chunk_prefill `how` = lead: RAGCACHE_CHUNK_LEAD, else the lead a deployment of these questions' passages would
    pick (lead.py); None for any other chunk prefill."""
    if how != "lead":
        return None
    if service.settings.chunk_lead:
        return service.settings.chunk_lead
    texts = sorted({c["text"] for item in others for c in item["ctxs"]})
    sizes = [len(encode(service.tokenizer, t)) for t in texts]
    return texts[pick_lead(texts, sizes, service.embedder.embed)]


def _probes_within_depth(cfg: EvalConfig, layers: int) -> None:
    """UserError for a probe asked to run through more layers than the model has: it would run through all of them,
    measured under a label that says otherwise."""
    asked = {"--probe-layers": cfg.probe_layers if "probe" in cfg.modes else [],
             "--adaptive-layers": [cfg.adaptive_layers] if "adaptive" in cfg.modes else []}
    for flag, depths in asked.items():
        if too_deep := [n for n in depths if n > layers]:
            raise UserError(f"{flag} {too_deep[0]}: this model has {layers} layers (0: all of them)")


def evaluate(service, cfg: EvalConfig, progress: bool = True) -> dict:
    every = load_dataset(cfg.dataset, None)
    data = every[: cfg.limit] if cfg.limit else every
    if not data:
        raise UserError(f"{cfg.dataset} holds no questions")
    modes = policies(cfg)
    _probes_within_depth(cfg, service.runner.num_layers)
    tok = service.tokenizer
    per_question = []
    with tempfile.TemporaryDirectory(prefix="ragcache-eval-") as tmp:
        root = Path(tmp)
        # a lead from the questions not evaluated (from every one if the run takes all)
        lead = dataset_lead(service, every[len(data):] or every, cfg.chunk_prefill)
        passages = _Passages(service, cfg, root, lead)
        retrieve = retriever(service, cfg, data, root, passages)
        bar = _bar(len(data), progress)
        for n, item in enumerate(data):
            keys = passages.ensure(retrieve(item))
            suffix = as_ids(encode(tok, "Question: " + item["question"]) + service.frame.tail)
            if n == 0:  # warm every path once, untimed
                for _, policy in modes:
                    run_mode(service, passages, keys, suffix, policy, cfg, reference=[])
            full = run_mode(service, passages, keys, suffix, modes[0][1], cfg)
            full_text = tok.decode(full["answer_ids"], skip_special_tokens=True).strip()
            row = {"question": item["question"], "answers": item["answers"], "modes": {}}
            for label, policy in modes:
                out = full if label == "full" else run_mode(service, passages, keys, suffix, policy, cfg,
                                                            reference=full["answer_ids"])
                text = tok.decode(out["answer_ids"], skip_special_tokens=True).strip()
                m = min(len(full["tf"]), len(out["tf"]))
                row["modes"][label] = {
                    "answer": text, "ttft_s": out["ttft_s"], "f1_gold": best_f1(text, item["answers"]),
                    "f1_vs_full": f1(text, full_text), "top1_agree": float(out["first"] == full["first"]),
                    "kl_first": float(kl(full["tf"][0], out["tf"][0])),
                    "kl_tf": float(kl(full["tf"][:m], out["tf"][:m]).mean()), "repair_s": out["repair_s"],
                    "recompute_fraction": out["recompute_fraction"], "work_fraction": out["work_fraction"]}
            per_question.append(row)
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        passages.store.close()
    return {"model": service.model.name, "dataset": str(cfg.dataset), "n": len(per_question), "top_k": cfg.top_k,
            "retrieval": cfg.retrieval + (f"+rerank@{cfg.rerank}:{service.settings.reranker}" if cfg.rerank else ""),
            "chunk_prefill": cfg.chunk_prefill, "tier": cfg.tier, "lead": lead,
            "knobs": {"probe_epic_k": cfg.probe_epic_k, "a3_window": cfg.a3_window},  # the rest are in the labels
            "kv_dtype": passages.kv_dtype, "codec": cfg.codec,
            "kv_cache_dtype": str(service.kv_cache_dtype).removeprefix("torch."),
            "modes": _aggregate(per_question, [m for m, _ in modes]),
            "per_question": per_question}


def _aggregate(rows: list[dict], labels: list[str]) -> dict:
    full_ttft = statistics.median(r["modes"]["full"]["ttft_s"] for r in rows)
    out = {}
    for label in labels:
        ms = [r["modes"][label] for r in rows]
        ttft = statistics.median(m["ttft_s"] for m in ms)
        mean = lambda key: sum(m[key] for m in ms) / len(ms)  # noqa: E731
        out[label] = {"ttft_s_median": ttft, "speedup_vs_full": full_ttft / ttft,
                      "repair_s_median": statistics.median(m["repair_s"] for m in ms), "f1_gold": mean("f1_gold"),
                      "f1_vs_full": mean("f1_vs_full"), "top1_agree": mean("top1_agree"),
                      "kl_first": mean("kl_first"), "kl_tf": mean("kl_tf"),
                      "recompute_fraction": mean("recompute_fraction"), "work_fraction": mean("work_fraction")}
    return out


def table(results: dict) -> str:
    """The README's Markdown table."""
    lines = ["| mode | TTFT s (median) | speedup vs full | repair s | recomputed | work | F1 vs full | top-1 agree | "
             "KL first | KL teacher-forced | gold F1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in results["modes"].items():
        repair = m.get("repair_s_median", 0.0)  # deferred: between the first token and the second
        lines.append(f"| {label} | {m['ttft_s_median']:.3f} | {m['speedup_vs_full']:.1f}× | "
                     f"{f'{repair:.3f}' if repair else '—'} | "
                     f"{m['recompute_fraction']:.0%} | {m['work_fraction']:.0%} | {m['f1_vs_full']:.2f} | "
                     f"{m['top1_agree']:.2f} | "
                     f"{m['kl_first']:.3f} | {m['kl_tf']:.3f} | {m['f1_gold']:.2f} |")
    return "\n".join(lines)


def _bar(total: int, show: bool):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="question", desc="eval", dynamic_ncols=True)
