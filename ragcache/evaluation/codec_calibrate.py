"""`ragcache calibrate-codec`: how many bits each layer's K and V get in the `compact` codec, measured once per model.

Each (layer, tensor)'s sensitivity is measured alone: that layer's K, or its V, through the codec at the base widths
(and at the lowest), everything else exact, on real chunks of the given dev questions; its cost is the KL from reuse
over the exact chunks to reuse over those, teacher-forced along full prefill's answer (reuse: the mode that trusts
stored KV most). A KL between the two stores' outputs is ≥ 0 and grows with the error's effect alone; the rise of the
KL against full prefill (the measure before this one) also moves with the error's first-order luck, up or down, and on
ten questions that swamped most layers' effect (BENCHMARKS.md). Each tensor then takes a width in `--widths` (2..6):
its cost at every width is measured on the chunks (every scale, sum and header counted), its sensitivity at the base
widths and at the lowest (on dev 40–49 the step down to 2 bits multiplied it by 3–11, not by the 4 a model gives:
BENCHMARKS.md), at any other width taken as the nearest measured one below's × 4^(m − w); from every tensor at the
lowest width, the raise that saves the most sensitivity per bit goes next, as long as the mean stays under `max_bits`
(`allocate`). Several passage counts (`--top-k 4,10`) add their sensitivities. K's symbols are chosen by error feedback
(`+f`) against the queries of the same questions' full prompts (key_weighting.py), measured first and stored beside the
widths; the sensitivities are measured with it. CacheBlend's check-layer tensor (V of layer 1) is set to `check_bits`
(8) before the others and not measured, its cost counted: its deviation ranks the rows cacheblend recomputes, and 4-bit
rounding there changed half of them (BENCHMARKS.md), an effect reuse's KL does not see. The chunks' KV is computed as
the deployment computes it (RAGCACHE_CHUNK_PREFILL; a lead is picked from the other questions' passages, as `ragcache
eval` picks it, unless RAGCACHE_CHUNK_LEAD names one). K's token blocks and V's rotation are the uncalibrated default's
(codecs.DEFAULT). The widths are stored per model in RAGCACHE_HOME/codec/ (store/codecs.py), where
`RAGCACHE_KV_CODEC=compact` finds them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from blend import CacheBlend, ChunkKV, Full, PrefixKV, Reuse, compute_chunk
from blend.prompt import SEPARATOR, as_ids, encode as tokenize

from ..errors import UserError
from ..store import decode, encode
from ..store.codec import rotate_k, to_bytes
from ..store.codecs import DEFAULT, save_calibration, spec_for
from ..store.widths import Spec
from ..store.feedback import KeyWeighting
from .evaluate import EvalConfig, dataset_lead, load_dataset
from .key_weighting import query_moments
from .measure import run_mode
from .scores import kl


class _Given:
    """The chunk KVs of one measurement, in the shape `run_mode` loads them."""

    def __init__(self, chunks: list[ChunkKV]):
        self.chunks = chunks
        self.token_ids = {i: c.token_ids for i, c in enumerate(chunks)}

    def load(self, keys):
        return self.chunks


def _pre_rope(exact: ChunkKV, inv_freq: torch.Tensor) -> ChunkKV:
    """The chunk with K rotated back to before RoPE, as a decoded compact chunk comes, and its own copy of V: K and V
    tensors of its own, which `_one_coded` swaps layers in."""
    k = rotate_k(exact.k, -torch.arange(exact.start, exact.start + len(exact)), inv_freq)  # a new tensor
    return ChunkKV(exact.token_ids, k, exact.v.clone(), exact.start, exact.context, lossless=False, k_pre_rope=True)


@contextmanager
def _one_coded(chunks: list[ChunkKV], coded: list[ChunkKV], layer: int, tensor: int):
    """`chunks` exact but for `tensor` (0: K, 1: V) of `layer`, which is the codec's, until the block ends: one layer
    swapped in place and back, not every chunk's KV copied per measurement."""
    held = [(c.k if tensor == 0 else c.v)[layer].clone() for c in chunks]  # (Hkv, n, hd) each
    try:
        for c, d in zip(chunks, coded):
            (c.k if tensor == 0 else c.v)[layer] = (d.k if tensor == 0 else d.v)[layer]
        yield chunks
    finally:
        for c, h in zip(chunks, held):
            (c.k if tensor == 0 else c.v)[layer] = h


def _reuse_tf(service, chunks, suffix, cfg, full) -> torch.Tensor:
    """(m, V): reuse over `chunks`, teacher-forced along full prefill's answer (its own answer, one token, unused)."""
    out = run_mode(service, _Given(chunks), list(range(len(chunks))), suffix, Reuse(), replace(cfg, max_new_tokens=1),
                    reference=full["answer_ids"])
    return out["tf"]


def allocate(sens: list[dict[int, list[float]]], cost: dict[int, list[list[float]]], span: tuple[int, int],
             budget: float, pinned: tuple[int, int, int] | None = None) -> list[list[int]]:
    """Each tensor's width in span (lo, hi): sens[K/V] {width: (L,)} as measured at those widths; cost {width: (K/V, L)}
    bits per element over the base's; budget: bits per element the widths may add to the base's; pinned (K/V, layer,
    width) set first, its cost counted. At a width not measured a tensor is taken to cost the nearest measured width
    below's sensitivity × 4^(m − w) (half the step, a quarter of the rounding's power; the lowest measured one's if none
    is below). From every tensor at lo, the raise that saves the most sensitivity per bit goes next, as long as it fits
    and saves something; a raise may skip widths, so a step that measured no gain does not hide the ones after it
    (ties: the shorter raise, K first, then the lower layer) → widths (K/V, L)."""
    lo, hi = span

    def level(t: int, l: int, w: int) -> float:
        m = max((x for x in sens[t] if x <= w), default=min(sens[t]))
        return sens[t][m][l] * 4.0 ** (m - w)

    widths = [[lo] * len(next(iter(sens[0].values()))) for _ in (0, 1)]
    if pinned is not None:
        widths[pinned[0]][pinned[1]] = pinned[2]
    spent = sum(cost[w][t][l] for t, row in enumerate(widths) for l, w in enumerate(row))
    while True:
        best, pick = 0.0, None
        for t, row in enumerate(widths):
            for l, w in enumerate(row):
                if pinned is not None and (t, l) == pinned[:2]:
                    continue
                for to in range(w + 1, hi + 1):
                    step = cost[to][t][l] - cost[w][t][l]
                    per_bit = (level(t, l, w) - level(t, l, to)) / max(step, 1e-9)
                    if spent + step <= budget and per_bit > best:
                        best, pick = per_bit, (t, l, to, step)
        if pick is None:
            return widths
        widths[pick[0]][pick[1]] = pick[2]
        spent += pick[3]


def calibrate_codec(service, dataset, first: int, count: int, top_k: list[int], base: tuple[int, int],
                    max_bits: float, check_bits: int = 8, span: tuple[int, int] = (2, 6), progress=print
                    ) -> tuple[Spec, dict]:
    runner = service.runner
    layers = runner.num_layers
    if not span[0] <= min(base) <= max(base) <= span[1]:
        raise UserError(f"--widths {span[0]}:{span[1]} must hold the base widths K {base[0]}, V {base[1]}")
    blend = CacheBlend()  # the check layer, and the tensor whose deviation ranks rows there, of the default mode
    check = ("kv".index(blend.by), min(blend.check_layer, layers - 1), check_bits) if check_bits else None
    default = spec_for(DEFAULT, layers, service.settings.home, "")  # K's blocks, V's rotation, scales: the default's
    items, behind = measured(service, dataset, first, count)
    cases = [([as_ids(tokenize(service.tokenizer, c["text"] + SEPARATOR)) for c in item["ctxs"][:k]],
              as_ids(tokenize(service.tokenizer, "Question: " + item["question"]) + service.frame.tail))
             for k in top_k for item in items]
    head = as_ids(service.frame.head)
    keys = KeyWeighting.of(query_moments(runner, [(torch.cat([head, *ids, suffix]), len(head) + sum(map(len, ids)))
                                                  for ids, suffix in cases]))
    form = dict(k_group=default.k_group, v_rotate=default.v_rotate, byte_scales=default.byte_scales, keys=keys)
    base_spec = Spec.uniform("compact", layers, *base, **form)
    measures = sorted({*range(span[0], span[1] + 1), *([check_bits] if check_bits else [])})
    cost_of = {w: torch.zeros(2, layers) for w in measures}  # (K/V, L): the bytes each width adds to the base's
    specs = {w: Spec.uniform("compact", layers, w, w, **form) for w in measures if (w, w) != base}  # the base: 0
    probes = [base] + ([(span[0],) * 2] if span[0] < max(base) else [])  # each tensor's sensitivity measured there
    sensitivity = [{p[t]: torch.zeros(layers) for p in probes} for t in (0, 1)]  # K/V: {width: (L,)}
    elements, total = 0, 0
    for n, (ids, suffix) in enumerate(cases):
        cfg = EvalConfig(dataset, top_k=len(ids), max_new_tokens=16)
        chunks = [compute_chunk(runner, x, behind) for x in ids]
        full = run_mode(service, _Given(chunks), list(range(len(chunks))), suffix, Full(), cfg)
        coded, mixed = {p: [] for p in probes}, []
        for c in chunks:
            entry = encode(c, "float32", base_spec, runner.inv_freq)
            at = {base: entry} | {(w, w): encode(c, "float32", u, runner.inv_freq) for w, u in specs.items()}
            for p in probes:
                coded[p].append(decode(at[p], torch.float32, torch.device("cpu")))
            mixed.append(_pre_rope(c, runner.inv_freq))
            for w in specs:
                cost_of[w] += torch.tensor([[len(at[w, w].frames[2 * l + t]) - len(entry.frames[2 * l + t])
                                             if w != base[t] else 0 for l in range(layers)] for t in (0, 1)])
            total += len(to_bytes(entry))
            elements += 2 * c.k.numel()
        exact = _reuse_tf(service, mixed, suffix, cfg, full)
        for p in probes:
            for t, l in ((t, l) for t in (0, 1) for l in range(layers) if p == base or p[t] != base[t]):
                if check is None or (t, l) != check[:2]:  # the pinned tensor never moves: not measured
                    with _one_coded(mixed, coded[p], l, t):
                        out = _reuse_tf(service, mixed, suffix, cfg, full)
                    m = min(len(exact), len(out))
                    sensitivity[t][p[t]][l] += float(kl(exact[:m], out[:m]).mean()) / len(items)
        progress(f"question {first + n % len(items)} at {len(ids)} passages: done")
    cost = {w: (c * 8 / elements).tolist() for w, c in cost_of.items()}  # bits per element over the base's
    sens, start = [{w: s.tolist() for w, s in at.items()} for at in sensitivity], 8 * total / elements
    widths = allocate(sens, cost, span, max_bits - start, check)
    spec = Spec("compact", *map(tuple, widths), default.k_group, default.v_rotate, default.byte_scales, keys)
    report = {"base": list(base), "widths": list(span), "bits_per_element": start + sum(
                  cost[w][t][l] for t, row in enumerate(widths) for l, w in enumerate(row)),
              "check": None if check is None else {"tensor": "kv"[check[0]], "layer": check[1], "bits": check_bits},
              "cost_bits": {str(w): dict(zip("kv", c)) for w, c in cost.items()}, "base_bits": start,
              "sensitivity": {x: {str(w): s for w, s in at.items()} for x, at in zip("kv", sens)},
              "questions": [first, first + len(items)], "dataset": str(dataset), "top_k": list(top_k),
              "chunk_prefill": service.settings.chunk_prefill}
    save_calibration(service.settings.home, service.model.fingerprint, spec, report)
    return spec, report


def measured(service, dataset, first: int, count: int) -> tuple[list[dict], PrefixKV | None]:
    """Questions first.. (count of them) of `dataset`, and what their chunks' KV is computed behind: the deployment's
    chunk prefix, its lead (if any) from the passages of the file's other questions."""
    every = load_dataset(dataset, None)
    if not 0 <= first < len(every):
        raise UserError(f"--first {first}: {dataset} holds questions 0-{len(every) - 1}")
    items = every[first : first + count]
    how = service.settings.chunk_prefill
    lead = dataset_lead(service, every[:first] + every[first + count:] or every, how)
    return items, service.chunk_prefix(how=how, lead=lead)


def command(service, args) -> int:
    """`ragcache calibrate-codec`: measure, store, and say what `compact` now is."""
    spec, report = calibrate_codec(service, args.dataset, args.first, args.count, args.top_k,
                                   (args.k_bits, args.v_bits), args.max_bits, args.check_bits, args.widths,
                                   progress=(lambda _: None) if args.quiet else print)
    moved = "; ".join(f"{x} at {w} in layers {[l for l, b in enumerate(row) if b == w]}"
                      for x, row, b0 in (("K", spec.k_bits, args.k_bits), ("V", spec.v_bits, args.v_bits))
                      for w in sorted(set(row) - {b0}))
    print(f"compact for this model: K {args.k_bits} and V {args.v_bits} bits ({DEFAULT}'s blocks), "
          f"{moved or 'no other'}: {report['bits_per_element']:.2f} bits per element on the dev chunks "
          f"({report['chunk_prefill']} chunk KV), K's symbols by error feedback against these questions' queries; "
          "RAGCACHE_KV_CODEC=compact uses it")
    return 0
