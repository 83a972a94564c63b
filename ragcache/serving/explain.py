"""What a request reused and what it recomputed, position by position, for people to look at.

    {"tokens": [str] (one per prompt position), "segments": [{"kind", "start", "end", "chunk"}],
     "recomputed": [positions whose K/V the last layer recomputed: usage.recomputed_tokens of them],
     "deviation": [float | None per position] (cacheblend: ||new − cached||² at its check layer) or None}
"""
from __future__ import annotations

from blend import FusedResult


def explain(tokenizer, fused: FusedResult, policy) -> dict:
    layout = fused.layout
    ids = fused.token_ids.tolist()
    segments = [{"kind": "prefix", "start": 0, "end": layout.prefix_len, "chunk": None}]
    segments += [{"kind": "chunk", "start": a, "end": b, "chunk": i} for i, (a, b) in enumerate(layout.spans)]
    segments.append({"kind": "suffix", "start": layout.suffix_start, "end": layout.total, "chunk": None})
    deviation = None
    if fused.deviations:
        first = min(fused.deviations)  # the check layer that ranked the rows
        rows, dev_k, dev_v = fused.deviations[first]
        dev = dev_k if getattr(policy, "by", "v") == "k" else dev_v
        deviation = [None] * layout.total
        for r, d in zip(rows.tolist(), dev.float().tolist()):
            if layout.prefix_len <= r < layout.suffix_start:  # the suffix is always recomputed: not ranked
                deviation[r] = round(d, 6)
    return {"tokens": tokenizer.batch_decode([[i] for i in ids]), "segments": segments,
            "recomputed": fused.kv_rows[-1].tolist(), "deviation": deviation}
