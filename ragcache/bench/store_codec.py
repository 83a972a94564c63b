"""The blob codecs on real chunk KV: size (every scale, sum and header counted), encode and decode speed
on one core, and fidelity (ΔKL per mode against the float32 store, with `evaluate`'s pieces)."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from blend import Full

from ..evaluation.evaluate import EvalConfig, _Passages, dataset_lead, load_dataset, policies
from ..evaluation.measure import run_mode
from ..evaluation.scores import kl
from ..store import decode, encode
from ..store.codec import to_bytes
from .timing import interleaved, median, table

RAW = {"raw float32": "float32", "raw bfloat16": "bfloat16", "raw int8": "int8"}


def real_chunks(service, item: dict, passages: int) -> list:
    """One dev question's passages as the server would store them (prefixed behind the system prompt)."""
    from blend import compute_chunk
    from blend.prompt import as_ids, encode as tokenize

    return [compute_chunk(service.runner, as_ids(tokenize(service.tokenizer, c["text"] + "\n\n")), service.prefix)
            for c in item["ctxs"][:passages]]


def sizes_and_speeds(service, chunks: list, codecs: list[str], repeats: int) -> list[list]:
    """Per codec: bits per element, × smaller than bf16, encode and decode GB/s of bf16-equivalent bytes on one
    core, decode ms per 512 tokens. The decode is to float32 on the CPU: what the runner reads."""
    elements = sum(2 * c.k.numel() for c in chunks)
    tokens = sum(len(c) for c in chunks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the target is per core
    rows = []
    try:
        for name in [*RAW, *codecs]:
            kv_dtype = RAW.get(name, "float32")
            spec = None if name in RAW else service.codec_spec(name)
            encode_one = lambda: [encode(c, kv_dtype, spec, service.runner.inv_freq) for c in chunks]  # noqa: E731
            entries = encode_one()
            blobs = [to_bytes(e) for e in entries]
            times = interleaved({"encode": lambda: [to_bytes(e) for e in encode_one()],
                                 "decode": lambda: [decode(e, torch.float32, torch.device("cpu")) for e in entries]},
                                repeats)
            bits = 8 * sum(len(b) for b in blobs) / elements
            enc, dec = median(times["encode"]), median(times["decode"])
            rows.append([name, bits, 16 / bits, 2 * elements / enc / 1e9, 2 * elements / dec / 1e9,
                         dec / tokens * 512 * 1000])
    finally:
        torch.set_num_threads(threads)
    return rows


def print_sizes(rows: list[list], chunks: list, model) -> None:
    print(f"\n{len(chunks)} real chunks ({sum(len(c) for c in chunks)} tokens, {model.name}); GB/s of "
          "bf16-equivalent bytes (2 per element) on one core, median of interleaved repeats")
    print(table(rows, ["codec", "bits/element", "× smaller than bf16", "encode GB/s", "decode GB/s",
                       "decode ms per 512 tokens"]))


def fidelity(service, dataset: str, codecs: list[str], passages: list[int], limit: int, root: Path,
             chunk_prefill: str = "prefixed") -> list[list]:
    """ΔKL (teacher-forced ± its paired standard error, and first token), the KL from raw's own output and Δ top-1
    agreement of each codec against raw float32, per mode;
    full prefill (the reference) computed once per question, every codec's chunks through encode and decode, each
    computed behind `chunk_prefill` (lead: picked from the passages of the questions past `limit`, as eval does)."""
    from blend.prompt import as_ids, encode as tokenize

    every = load_dataset(Path(dataset), None)
    data = every[:limit] if limit else every
    lead = dataset_lead(service, every[limit:] or every, chunk_prefill)
    rows = []
    for n in passages:
        cfg = EvalConfig(Path(dataset), modes=["reuse", "cacheblend", "epic", "probe"], ratios=[0.15], epic_ks=[16],
                         probe_ratios=[0.1], probe_layers=[0], ape=[], top_k=n, chunk_prefill=chunk_prefill,
                         kv_dtype="float32", max_new_tokens=16)
        modes = policies(cfg)[1:]  # full is the reference
        stores = {}
        for codec in ["raw", *codecs]:
            (root / f"fidelity-{n}-{codec}").mkdir()
            stores[codec] = _Passages(service, replace(cfg, codec=codec), root / f"fidelity-{n}-{codec}", lead)
        # (codec, mode) → per question [KL tf, KL first, top-1 agreement, KL tf from the float32 store's own output]
        per_q: dict[tuple[str, str], list[list[float]]] = {}
        t0 = time.perf_counter()
        for item in data:
            texts = [c["text"] for c in item["ctxs"][:n]]
            suffix = as_ids(tokenize(service.tokenizer, "Question: " + item["question"]) + service.frame.tail)
            keys = {codec: p.ensure(texts) for codec, p in stores.items()}
            full = run_mode(service, stores["raw"], keys["raw"], suffix, Full(), cfg)
            own = {}
            for codec, p in stores.items():  # raw first: its outputs are what each codec's are held against
                for label, policy in modes:
                    out = run_mode(service, p, keys[codec], suffix, policy, cfg, reference=full["answer_ids"])
                    m = min(len(full["tf"]), len(out["tf"]))
                    own.setdefault(label, out["tf"][:m])
                    j = min(m, len(own[label]))
                    per_q.setdefault((codec, label), []).append([
                        float(kl(full["tf"][:m], out["tf"][:m]).mean()), float(kl(full["tf"][0], out["tf"][0])),
                        float(out["first"] == full["first"]), float(kl(own[label][:j], out["tf"][:j]).mean())])
        print(f"  fidelity, {n} passages: {len(data)} questions in {time.perf_counter() - t0:.0f} s", flush=True)
        for p in stores.values():
            p.store.close()
        for label, _ in modes:
            base = torch.tensor(per_q["raw", label], dtype=torch.float64)  # (questions, 4)
            for codec in codecs:
                got = torch.tensor(per_q[codec, label], dtype=torch.float64)
                d = got - base
                se = float(d[:, 0].std() / len(data) ** 0.5) if len(data) > 1 else float("nan")
                rows.append([n, label, codec, float(base[:, 0].mean()), float(d[:, 0].mean()), se,
                             float(got[:, 3].mean()), float(d[:, 1].mean()), float(base[:, 2].mean()),
                             float(d[:, 2].mean())])
    return rows


def print_fidelity(rows: list[list], limit: int, chunk_prefill: str = "prefixed") -> None:
    print(f"\nfidelity against full prefill, first {limit} dev questions, chunks {chunk_prefill}: each codec's ΔKL "
          "against the float32 store (raw) in the same run; ± its standard error over the questions (paired); KL from "
          "the float32 store's own output (≥ 0: the codec's effect alone, without the first-order luck a ΔKL carries)")
    print(table(rows, ["passages", "mode", "codec", "KL tf (float32 store)", "ΔKL tf", "±", "KL from float32 store",
                       "ΔKL first", "top-1 (float32 store)", "Δ top-1"]))
