"""The compact KV codec: its error bound on real KV, its size, old and new blobs side by side, corrupt frames."""
from __future__ import annotations

import pytest
import torch

from blend import ChunkKV, Reuse, compute_chunk, compute_prefix, fuse_and_prefill
from ragcache.store import CorruptBlob, TieredStore, decode, encode
from ragcache.store.codec import rotate_k, from_bytes, to_bytes
from ragcache.store.codecs import spec_for
from ragcache.store.compact import Spec, hadamard
from ragcache.store.disk import DiskTier
from ragcache.store.memory import MemoryTier

from .conftest import fake_chunk

TEXT = ("The Amazon river rises in the Andes of Peru and flows east across Brazil to the Atlantic. Its basin "
        "holds the largest rainforest on Earth, and its discharge is greater than the next seven rivers together. ")


@pytest.fixture(scope="module")
def real_chunk(smol_runner, smollm):
    """A ~300-token chunk of SmolLM2's real KV, computed behind a short prefix (start > 0)."""
    prefix = compute_prefix(smol_runner, torch.tensor(smollm.tokenizer.encode("Read the passages.")))
    ids = torch.tensor(smollm.tokenizer.encode(TEXT * 7))[:300]
    return compute_chunk(smol_runner, ids, prefix)


def _slack(x: torch.Tensor, dim) -> torch.Tensor:
    """The float16 rounding of a group's lo and step."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return 2.0**-10 * (lo.abs() + (hi - lo)) + 1e-6


def _within_bound(x: torch.Tensor, x_hat: torch.Tensor, bits: int, dim: int) -> bool:
    """|x − x̂| ≤ step/2 per group, plus the float16 rounding of the group's lo and step."""
    step = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / ((1 << bits) - 1)
    return bool(((x - x_hat).abs() <= step / 2 + _slack(x, dim)).all())


def _clipped_within_bound(x: torch.Tensor, x_hat: torch.Tensor, bits: int) -> bool:
    """A clipped K block (H, G, hd), groups along tokens: each group's squared error at most plain min–max's,
    each element within (max − min)/4 + step/2 (its range is never clipped below half)."""
    top = (1 << bits) - 1
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    step = ((hi - lo) / top).half().float()
    plain = ((x - lo.half().float()) / torch.where(step > 0, step, 1)).round().clamp(0, top) * step + lo.half().float()
    sq, sq_plain = (x - x_hat).square().sum(1), (x - plain).square().sum(1)
    loose = (hi - lo) / 4 + (hi - lo) / (4 * top) + _slack(x, 1)
    return bool((sq <= sq_plain * (1 + 1e-3) + 1e-9).all() and ((x - x_hat).abs() <= loose).all())


@pytest.mark.parametrize("name", ["compact", "compact-k3v3"])  # the default; the first format
def test_compact_round_trip_on_real_kv_is_within_its_bound_and_under_3_2_bits(real_chunk, smol_runner, tmp_path,
                                                                              name):
    spec = spec_for(name, smol_runner.num_layers, tmp_path, "uncalibrated")
    entry = from_bytes(to_bytes(encode(real_chunk, "float32", spec, smol_runner.inv_freq)))
    bits = len(to_bytes(entry)) * 8 / (2 * real_chunk.k.numel())  # every scale, sum and header counted
    assert bits <= 3.2, bits
    back = decode(entry, torch.float32, torch.device("cpu"))
    assert back.k_pre_rope and not back.lossless and torch.equal(back.token_ids, real_chunk.token_ids)
    n, hd = len(real_chunk), real_chunk.k.shape[-1]
    k_pre = rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n), smol_runner.inv_freq)
    rot = hadamard(hd) if spec.v_rotate else torch.eye(hd)  # its own inverse: the bound holds for V rotated
    for l in range(smol_runner.num_layers):
        if spec.k_group:  # K: per (head, channel) in blocks of tokens, clipped
            g = spec.k_group
            assert all(_clipped_within_bound(k_pre[l, :, s : s + g], back.k[l, :, s : s + g], spec.k_bits[l])
                       for s in range(0, n, g))
        else:  # K: per (head, channel) over the chunk
            assert _within_bound(k_pre[l], back.k[l], spec.k_bits[l], dim=1)
        assert _within_bound(real_chunk.v[l] @ rot, back.v[l] @ rot, spec.v_bits[l], dim=2)  # V: per (head, token)


def test_pre_rope_k_is_rotated_to_its_new_place_when_fused(real_chunk, smol_runner):
    """A chunk whose K comes back before RoPE fuses as its post-RoPE original does, at a new offset."""
    n = len(real_chunk)
    pre = ChunkKV(real_chunk.token_ids, rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n),
                                                smol_runner.inv_freq),
                  real_chunk.v, real_chunk.start, real_chunk.context, lossless=False, k_pre_rope=True)
    post = ChunkKV(real_chunk.token_ids, real_chunk.k, real_chunk.v, real_chunk.start, real_chunk.context,
                   lossless=False)
    suffix = torch.tensor([42, 43, 44])
    a = fuse_and_prefill(smol_runner, None, [post, post], suffix, Reuse())
    b = fuse_and_prefill(smol_runner, None, [pre, pre], suffix, Reuse())
    assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=1e-4)
    smol_runner.release(a.cache)
    smol_runner.release(b.cache)


def _store(db, root) -> TieredStore:
    return TieredStore(db, [MemoryTier("cpu", "cpu", 0)], [DiskTier(root, 1 << 30)])  # every get reads the disk


@pytest.mark.parametrize("damage", ["frame", "head"])
def test_raw_and_compact_blobs_share_a_store_and_a_corrupt_frame_is_never_served(db, tmp_path, damage):
    spec = Spec.uniform("compact-k3v3+g16+r", 4, 3, 3, k_group=16, v_rotate=True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    chunk = fake_chunk(7, n=40)
    store = _store(db, tmp_path / "kv")
    store.put("old", encode(chunk, "float32"))  # a raw blob, as every store held before codecs
    store.put("new", encode(chunk, "float32", spec, inv_freq))
    old, new = store.get("old"), store.get("new")
    assert old.tier == new.tier == "disk" and old.entry.codec == "raw" and new.entry.codec == "compact-k3v3+g16+r"
    assert torch.equal(decode(old.entry, torch.float32, torch.device("cpu")).v, chunk.v)
    assert (decode(new.entry, torch.float32, torch.device("cpu")).v - chunk.v).abs().max() < 0.6
    path = next((tmp_path / "kv").glob("*/new.safetensors"))
    data = bytearray(path.read_bytes())
    data[-20 if damage == "frame" else 40] ^= 0x10  # inside the last frame, or inside the JSON header
    path.write_bytes(bytes(data))
    assert store.get("new") is None and store.corrupt["disk"] == 1 and not path.exists()
    assert store.get("old") is not None


@pytest.mark.parametrize("name, k_group, v_rotate", [("compact-k2v2", 0, False), ("compact-k2v2+g16+r", 16, True)])
def test_a_frame_damaged_in_memory_does_not_decode(name, k_group, v_rotate):
    spec = Spec.uniform(name, 4, 2, 2, k_group=k_group, v_rotate=v_rotate)
    entry = encode(fake_chunk(8, n=40), "float32", spec, 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    entry.frames[2] = entry.frames[2][:-5]  # a K frame
    entry.frames[3] = bytes(entry.frames[3][:4]) + entry.frames[3][8:]  # a V frame's scales cut short
    with pytest.raises(CorruptBlob):
        decode(entry, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name, v_bits, k_group, v_rotate", [("compact-k3v3", 3, 0, False),
                                                             ("compact-k3v2+g16+r", 2, 16, True)])
def test_the_cpu_unpacking_equals_the_torch_one_the_gpu_runs(name, v_bits, k_group, v_rotate):
    """A contiguous float32 output is unpacked by numba in one pass; any other (CUDA's, or a strided view
    here) by torch. Both give the same floats, for every frame kind, a short last K block included."""
    from ragcache.store.compact import Decoder, encode_frames

    k, v = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 8)
    frames = encode_frames(k, v, Spec.uniform(name, 2, 3, v_bits, k_group=k_group, v_rotate=v_rotate))
    decoder = Decoder()
    for frame, per_token in zip(frames, [False, True] * 2):
        fast, slow = torch.empty(3, 37, 8), torch.empty(3, 8, 37).transpose(1, 2)  # the second not contiguous
        decoder.frame_into(frame, fast, per_token)
        decoder.frame_into(frame, slow, per_token)
        assert torch.allclose(fast, slow, rtol=1e-6, atol=1e-6)
        assert fast.abs().max() > 0


def test_the_rounding_error_the_decoder_reports_is_the_error_it_made_on_real_v(real_chunk, smol_runner, tmp_path):
    """cacheblend takes it off its deviation: per token, summed over heads and hd, step²/12 an element."""
    spec = spec_for("compact", smol_runner.num_layers, tmp_path, "uncalibrated")
    back = decode(from_bytes(to_bytes(encode(real_chunk, "float32", spec, smol_runner.inv_freq))), torch.float32,
                  torch.device("cpu"))
    n = len(real_chunk)
    assert back.noise.shape == (smol_runner.num_layers, 2, n)
    k_pre = rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n), smol_runner.inv_freq)
    for which, (made, original) in enumerate([(back.k, k_pre), (back.v, real_chunk.v)]):
        err = (made - original).square().sum(dim=(1, 3))  # (L, n)
        ratio = err.sum(1) / back.noise[:, which].sum(1)  # per layer: made / reported
        assert ((ratio > 0.75) & (ratio < 1.25)).all(), (which, ratio)  # a group's extremes are exact; K is clipped


def test_a_damaged_calibration_file_falls_back_to_the_default_widths(tmp_path):
    from ragcache.store.codecs import DEFAULT, calibration_path

    path = calibration_path(tmp_path, "fp")
    path.parent.mkdir(parents=True)
    default = spec_for(DEFAULT, 4, tmp_path, "fp")
    for damage in (b"\xff\xfe{garbage", b'{"k_bits": 3}', b"[]"):
        path.write_bytes(damage)
        assert spec_for("compact", 4, tmp_path, "fp") == default  # it used to raise at every store write


def test_a_codec_name_moves_k_and_v_bits_by_layer_range_and_a_boost_wins():
    from pydantic import ValidationError

    from ragcache.config import Settings

    spec = spec_for("compact-k3v3+k4:8-v0:4+L1+g96", 8, None, "fp")
    assert spec.k_bits == (3, 4, 3, 3, 4, 4, 4, 4) and spec.v_bits == (2, 4, 2, 2, 3, 3, 3, 3) and spec.k_group == 96
    assert spec_for("compact-k4v2+k0:99-v0:2", 3, None, "fp").k_bits == (4, 4, 4)  # clamped to 2..4 and to the layers
    assert spec_for("compact-k4v2+k0:99-v0:2", 3, None, "fp").v_bits == (2, 2, 2)
    assert spec_for("compact-k3v3", 4, None, "fp") == Spec.uniform("compact-k3v3", 4, 3, 3)  # no shift: as before
    Settings(kv_codec="compact-k3v3+k16:30-v0:16+L1+g96")
    for bad in ("compact-k3v3+k16", "compact-k3v3+x0:4", "compact-k3v3+L1+k0:4"):
        with pytest.raises(ValidationError, match="compact-kXvY"):
            Settings(kv_codec=bad)
