"""`make gpu-check`'s codec step: one Llama-3-8B-shaped 512-token chunk's KV through the compact codec, decoded
into CUDA tensors (zstd on the host's CPU, unpacking and scaling on the GPU) and into CPU tensors on one
core, in GB/s of bf16-equivalent output (2 bytes per element)."""
from __future__ import annotations

import time

import torch

from .timing import median, table

SHAPE = (32, 8, 512, 128)  # layers, KV heads, tokens, head dim: 64 MB of bf16 K and V


def codec_rows() -> tuple[str, list[list]]:
    try:
        from ..store.compact import Decoder, encode_frames
        from ..store.widths import Spec
    except ImportError as e:  # zstandard is not among what a bare CUDA machine has
        return f"\ncodec decode: not measured ({e})", [["codec decode (compact)", "not run", str(e)]]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    frames = encode_frames(k, v, Spec.uniform("compact-k3v3", SHAPE[0], 3, 3))
    decoder, rows = Decoder(), []
    for device in ("cuda", "cpu"):
        out_k, out_v = torch.empty(SHAPE, device=device), torch.empty(SHAPE, device=device)

        def decode():
            for l in range(SHAPE[0]):
                decoder.layer(frames[2 * l], frames[2 * l + 1], out_k[l], out_v[l])
            if device == "cuda":
                torch.cuda.synchronize()

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        times = []
        for r in range(6):
            t = time.perf_counter()
            decode()
            if r:
                times.append(time.perf_counter() - t)
        torch.set_num_threads(threads)
        s = median(times)
        rows.append([f"into {device} float32", s * 1000, 2 * 2 * k.numel() / s / 1e9])
    text = (f"\ncodec decode, compact-k3v3, {SHAPE} K and V (random), one host core, median of 5\n"
            + table(rows, ["decode", "ms per chunk", "GB/s bf16-equivalent"]))
    return text, [[f"codec decode {r[0]}", "measured", f"{r[1]:.1f} ms per 512-token chunk, {r[2]:.2f} GB/s"]
                  for r in rows]
