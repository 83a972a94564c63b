"""The 8B timeline on paper: a 10-chunk request on Llama-3-8B (bf16) served from each tier with each codec,
from the codec speeds measured here and the H200 host's published bandwidths, against recomputing.

Bringing a chunk's KV = moving its stored bytes over the tier's link, then decoding them (compact); with
layer-wise loading the two overlap, so the time is the larger of them, else their sum. The prefill side
is FLOPs ÷ (the H200's dense bf16 peak × an assumed utilisation): a paper number, until `make gpu-check`
measures `bench blend` on a lent GPU.
"""
from __future__ import annotations

from .timing import table

LAYERS, KV_HEADS, HEAD_DIM, PARAMS = 32, 8, 128, 8.03e9  # Llama-3-8B
CHUNK_TOKENS, CHUNKS = 512, 10
ELEMENTS = 2 * LAYERS * KV_HEADS * HEAD_DIM * CHUNK_TOKENS  # K and V of one chunk: 64 MB in bf16
HBM_GBS = 4800.0  # H200 HBM3e: the GPU tier holds decoded bf16
LINKS_GBS = {  # published, per direction
    "CPU tier over PCIe 5 x16": 64.0,
    "local NVMe (PCIe 4, one drive)": 7.0,
    "Redis over 100 GbE": 12.5,
    "Redis over 25 GbE": 3.125,
}
PEAK_TFLOPS, UTILISATION = 989.0, 0.5  # H200 dense bf16; half of it in a long prefill (assumed)


def prefill_seconds(tokens: int, share: float = 1.0) -> float:
    """Linear layers (2 × params per token) plus causal attention (2 × 2 × L × d × T² / 2), × share."""
    attention = 2 * 2 * LAYERS * 4096 * tokens * tokens / 2
    return share * (2 * PARAMS * tokens + attention) / (PEAK_TFLOPS * 1e12 * UTILISATION)


def _row(tier: str, codec: str, moved_gb: float, move_s: float, decode_s: float, blend: float, full: float) -> list:
    overlapped = max(move_s, decode_s)
    return [tier, codec, moved_gb * 1000, move_s * 1000, decode_s * 1000, (move_s + decode_s) * 1000,
            overlapped * 1000, (overlapped + blend) * 1000, "beats it" if overlapped + blend < full else "loses"]


def rows(codecs: dict[str, tuple[float, float | None]], cores: int, blend_share: float) -> tuple[list[list], float, float]:
    """codecs: name → (bits per element, decode GB/s of bf16-equivalent output on one core measured here; None:
    nothing to decode)."""
    full, blend = prefill_seconds(CHUNK_TOKENS * CHUNKS), prefill_seconds(CHUNK_TOKENS * CHUNKS, blend_share)
    bf16_gb = CHUNKS * ELEMENTS * 2 / 1e9
    out = [_row("GPU tier (HBM3e)", "decoded bf16", bf16_gb, bf16_gb / HBM_GBS, 0.0, blend, full)]
    for link, gbs in LINKS_GBS.items():
        for name, (bits, decode_gbs) in codecs.items():
            moved = bf16_gb * bits / 16
            decode_s = bf16_gb / (decode_gbs * cores) if decode_gbs else 0.0
            out.append(_row(link, name, moved, moved / gbs, decode_s, blend, full))
    return out, full, blend


def per_tb(codecs: dict[str, tuple[float, float | None]]) -> list[list]:
    return [[name, ELEMENTS * bits / 8 / 1e6, 1e12 / (ELEMENTS * bits / 8)] for name, (bits, _) in codecs.items()]


def print_timeline(codecs: dict[str, tuple[float, float | None]], cores: int = 16, blend_share: float = 0.17) -> None:
    out, full, blend = rows(codecs, cores, blend_share)
    print(f"\n8B timeline on paper: {CHUNKS} chunks of {CHUNK_TOKENS} tokens on Llama-3-8B bf16; full prefill "
          f"{full * 1000:.0f} ms and cacheblend@0.15's recompute ({blend_share:.0%} of its work) {blend * 1000:.0f} ms "
          f"at {UTILISATION:.0%} of {PEAK_TFLOPS:g} TFLOPS; decode on {cores} host cores at this machine's per-core speed")
    print(table(out, ["tier", "codec", "MB moved", "move ms", "decode ms", "load first ms", "layer-wise ms",
                      "layer-wise + cacheblend ms", "vs full prefill"]))
    print(table(per_tb(codecs), ["codec", "MB per 512-token chunk", "chunks per TB"]))
