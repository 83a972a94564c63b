"""`ragcache calibrate-codec`: which layers the `compact` codec gives one more bit, measured once per model.

Each layer's sensitivity is measured alone: that layer's KV through the codec at the base widths, every
other layer exact, on real chunks of the given dev questions; its cost is the rise of the teacher-forced
KL against full prefill in reuse mode (the mode that trusts stored KV most) over the exact store's. The
most sensitive layers get one more bit for K and V, as many as keep the mean under `max_bits` per
element (every scale, sum and header counted, on those chunks). K's symbols are chosen by error feedback (`+f`)
against the queries of the same questions' full prompts (key_weighting.py), measured first and stored beside
the widths; the layers' sensitivities are measured with it. The chunks' KV is computed as the deployment
computes it (RAGCACHE_CHUNK_PREFILL; a lead is picked from the other questions' passages, as `ragcache eval` picks
it, unless RAGCACHE_CHUNK_LEAD names one). K's token blocks and V's rotation are the
uncalibrated default's (codecs.DEFAULT). The widths are stored per model in
RAGCACHE_HOME/codec/ (store/codecs.py), where `RAGCACHE_KV_CODEC=compact` finds them.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from blend import ChunkKV, Full, PrefixKV, Reuse, compute_chunk
from blend.prompt import SEPARATOR, as_ids, encode as tokenize

from ..errors import UserError
from ..store import decode, encode
from ..store.codec import rotate_k, to_bytes
from ..store.codecs import DEFAULT, save_calibration, spec_for
from ..store.compact import Spec
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


def _mixed(exact: ChunkKV, k_pre: torch.Tensor, coded: ChunkKV, layer: int | None) -> ChunkKV:
    """The chunk with K before RoPE, exact in every layer but `layer`, which is the codec's."""
    k, v = k_pre.clone(), exact.v.clone()
    if layer is not None:
        k[layer], v[layer] = coded.k[layer], coded.v[layer]
    return ChunkKV(exact.token_ids, k, v, exact.start, exact.context, lossless=False, k_pre_rope=True)


def _kl_tf(service, chunks, suffix, cfg, full) -> float:
    """Reuse over `chunks`, teacher-forced along full prefill's answer (its own answer, one token, unused)."""
    out = run_mode(service, _Given(chunks), list(range(len(chunks))), suffix, Reuse(), replace(cfg, max_new_tokens=1),
                    reference=full["answer_ids"])
    m = min(len(full["tf"]), len(out["tf"]))
    return float(kl(full["tf"][:m], out["tf"][:m]).mean())


def calibrate_codec(service, dataset, first: int, count: int, top_k: int, base: tuple[int, int],
                    max_bits: float, progress=print) -> tuple[Spec, dict]:
    runner = service.runner
    layers = runner.num_layers
    default = spec_for(DEFAULT, layers, service.settings.home, "")  # K's blocks, V's rotation, scales: the default's
    items, behind = measured(service, dataset, first, count)
    texts = [[as_ids(tokenize(service.tokenizer, c["text"] + SEPARATOR)) for c in item["ctxs"][:top_k]] for item in items]
    suffixes = [as_ids(tokenize(service.tokenizer, "Question: " + item["question"]) + service.frame.tail)
                for item in items]
    head = as_ids(service.frame.head)
    keys = KeyWeighting.of(query_moments(runner, [(torch.cat([head, *ids, suffix]), len(head) + sum(map(len, ids)))
                                                  for ids, suffix in zip(texts, suffixes)]))
    form = dict(k_group=default.k_group, v_rotate=default.v_rotate, byte_scales=default.byte_scales, keys=keys)
    base_spec = Spec.uniform("compact", layers, *base, **form)
    boosted = Spec.uniform("compact", layers, min(4, base[0] + 1), min(4, base[1] + 1), **form)
    cfg = EvalConfig(dataset, top_k=top_k, max_new_tokens=16)
    rise, elements = torch.zeros(layers), 0
    layer_bytes = {w: torch.zeros(layers) for w in ("base", "boosted")}
    overhead = 0
    for n, (item, ids, suffix) in enumerate(zip(items, texts, suffixes)):
        chunks = [compute_chunk(runner, x, behind) for x in ids]
        full = run_mode(service, _Given(chunks), list(range(len(chunks))), suffix, Full(), cfg)
        coded, pre = [], []
        for c in chunks:
            entry = encode(c, "float32", base_spec, runner.inv_freq)
            coded.append(decode(entry, torch.float32, torch.device("cpu")))
            pre.append(rotate_k(c.k, -torch.arange(c.start, c.start + len(c)), runner.inv_freq))
            up = encode(c, "float32", boosted, runner.inv_freq)
            for w, e in (("base", entry), ("boosted", up)):
                layer_bytes[w] += torch.tensor([len(e.frames[2 * l]) + len(e.frames[2 * l + 1]) for l in range(layers)],
                                               dtype=torch.float32)
            overhead += len(to_bytes(entry)) - sum(len(f) for f in entry.frames)
            elements += 2 * c.k.numel()
        exact = _kl_tf(service, [_mixed(c, p, d, None) for c, p, d in zip(chunks, pre, coded)], suffix, cfg, full)
        for l in range(layers):
            rise[l] += _kl_tf(service, [_mixed(c, p, d, l) for c, p, d in zip(chunks, pre, coded)], suffix, cfg,
                              full) - exact
        progress(f"question {first + n}: done")
    rise /= len(items)
    order = sorted(range(layers), key=lambda l: -float(rise[l]))
    chosen: list[int] = []
    bits = lambda boost: 8 * (overhead + sum(float(layer_bytes["boosted" if l in boost else "base"][l])  # noqa: E731
                                             for l in range(layers))) / elements
    for l in order:
        if bits({*chosen, l}) <= max_bits:
            chosen.append(l)
    spec = Spec.uniform("compact", layers, *base, boost=tuple(chosen), **form)
    cost = [bits({l}) - bits(set()) for l in range(layers)]  # bits per element a layer's boost adds
    report = {"base": list(base), "boosted_layers": sorted(chosen), "bits_per_element": bits(set(chosen)),
              "boost_cost_bits": cost,
              "kl_rise_per_layer": [round(float(x), 6) for x in rise], "questions": [first, first + len(items)],
              "dataset": str(dataset), "top_k": top_k, "chunk_prefill": service.settings.chunk_prefill}
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
    _, report = calibrate_codec(service, args.dataset, args.first, args.count, args.top_k, (args.k_bits, args.v_bits),
                                args.max_bits, progress=(lambda _: None) if args.quiet else print)
    print(f"compact for this model: K {args.k_bits} and V {args.v_bits} bits ({DEFAULT}'s blocks), one more in layers "
          f"{report['boosted_layers']}: {report['bits_per_element']:.2f} bits per element on the dev chunks "
          f"({report['chunk_prefill']} chunk KV), K's symbols by error feedback against these questions' queries; "
          "RAGCACHE_KV_CODEC=compact uses it")
    return 0
