"""The compact KV codec: its error bound on real KV, its size, old and new blobs side by side, corrupt frames."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blend import ChunkKV, Reuse, compute_chunk, compute_prefix, fuse_and_prefill
from ragcache.store import CorruptBlob, TieredStore, decode, encode
from ragcache.store.codec import rotate_k, from_bytes, to_bytes
from ragcache.store.codecs import spec_for
from ragcache.store.compact import hadamard
from ragcache.store.widths import Spec
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
    """A clipped K block (H, G, hd), groups along tokens: each group's squared error at most plain min–max's (the
    encoder's unclipped candidate: the whole range around its middle, lo and step as float16; min and max rounded
    apart can land an ulp of lo away, which cost 0.16% of a 6-bit group's error on one host), each element within
    (max − min)/4 + step/2 (its range is never clipped below half)."""
    top = (1 << bits) - 1
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    step, base = ((mid + half - (mid - half)) / top).half().float(), (mid - half).half().float()
    plain = ((x - base) / torch.where(step > 0, step, 1)).round().clamp(0, top) * step + base
    sq, sq_plain = (x - x_hat).square().sum(1), (x - plain).square().sum(1)
    loose = (hi - lo) / 4 + (hi - lo) / (4 * top) + _slack(x, 1)
    return bool((sq <= sq_plain * (1 + 1e-3) + 1e-9).all() and ((x - x_hat).abs() <= loose).all())


@pytest.mark.parametrize("name", ["compact", "compact-k3v3+L1+g96", "compact-k3v3"])  # the default, the one
# before it (float16 scales), the first format
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
        if spec.byte_scales:  # scales on a grid (scales.py)
            assert _grid_bounds_hold(k_pre[l], back.k[l], real_chunk.v[l], back.v[l], spec.k_group, spec.k_bits[l],
                                     spec.v_bits[l]), l
            continue
        if spec.k_group:  # K: per (head, channel) in blocks of tokens, clipped
            g = spec.k_group
            assert all(_clipped_within_bound(k_pre[l, :, s : s + g], back.k[l, :, s : s + g], spec.k_bits[l])
                       for s in range(0, n, g))
        else:  # K: per (head, channel) over the chunk
            assert _within_bound(k_pre[l], back.k[l], spec.k_bits[l], dim=1)
        assert _within_bound(real_chunk.v[l] @ rot, back.v[l] @ rot, spec.v_bits[l], dim=2)  # V: per (head, token)


def _decoded(frames: list[bytes], shape) -> tuple[torch.Tensor, torch.Tensor]:
    from ragcache.store.compact import Decoder

    decoder, k, v = Decoder(), torch.empty(shape), torch.empty(shape)
    for l in range(shape[0]):
        decoder.layer(frames[2 * l], frames[2 * l + 1], k[l], v[l])
    return k, v


def _grid_bound(x: torch.Tensor, dim: int, bits: int, largest: float | None = None) -> torch.Tensor:
    """+b's bound: lo within an eighth of a step of the group's, so every element of the range is within half
    a step of a level; a step is the group's min–max one rounded up on the grid (≤ 2^(1/32) over it), or the
    grid's first (the frame's `largest` — by default x's — over 2^(255/32))."""
    ideal = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / ((1 << bits) - 1)
    floor = (ideal.max() if largest is None else largest) / 2 ** (255 / 32)
    return 0.5 * torch.clamp(ideal, min=floor) * 2 ** (1 / 32) * (1 + 1e-4) + 1e-6


def _grid_bounds_hold(k: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, v_hat: torch.Tensor, g: int, k_bits: int,
                      v_bits: int) -> bool:
    """A layer's K (pre-RoPE) and V (H, n, hd) against their +b decoding: V within the grid's half step, K too
    but clipped in blocks of g tokens (beyond the kept range an element is off by up to a quarter more)."""
    return bool(((v_hat - v).abs() <= _grid_bound(v, 2, v_bits)).all()) and _k_grid_bound_holds(k, k_hat, g, k_bits)


def _k_grid_bound_holds(k: torch.Tensor, k_hat: torch.Tensor, g: int, bits: int) -> bool:
    blocks = [k[:, s : s + g] for s in range(0, k.shape[1], g)]
    largest = max(float((x.amax(1) - x.amin(1)).max()) for x in blocks) / ((1 << bits) - 1)
    return all(((k_hat[:, s : s + g] - x).abs() <= (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 4
                + _grid_bound(x, 1, bits, largest)).all() for s, x in zip(range(0, k.shape[1], g), blocks))


def test_byte_scales_cost_half_the_scales_bits_and_keep_the_error_bound_on_real_kv(real_chunk, smol_runner):
    """+b writes a group's lo and step in a byte each (scales.py). On real KV its frames' scales and headers take
    little over half the bytes of float16 scales, no element is further off than the grid's half step, and
    no layer errs more than 10% over the same widths with float16 scales."""
    from ragcache.store.compact import BYTES, encode_frames

    n = len(real_chunk)
    k_pre = rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n), smol_runner.inv_freq)
    specs = [spec_for(name, smol_runner.num_layers, None, "fp") for name in
             ("compact-k3v3+k16:30+L1+g96", "compact-k3v3+k16:30+L1+g96+b")]
    frames = [encode_frames(k_pre, real_chunk.v, s) for s in specs]
    bits = sum(map(len, frames[1])) * 8 / (2 * k_pre.numel())
    head = [sum(len(f) - (int.from_bytes(f[:4], "little") & (1 << 28) - 1) for f in fs) for fs in frames]  # scales
    assert bits <= 3.2 and head[1] < 0.55 * head[0], (bits, head)
    assert all(f[3] >> 4 & BYTES for f in frames[1])  # no frame of real KV needed float16 scales
    (k16, v16), (kb, vb) = (_decoded(f, k_pre.shape) for f in frames)
    for l, kbits, vbits in zip(range(smol_runner.num_layers), specs[1].k_bits, specs[1].v_bits):
        assert (kb[l] - k_pre[l]).square().sum() < 1.1 * (k16[l] - k_pre[l]).square().sum(), l
        assert (vb[l] - real_chunk.v[l]).square().sum() < 1.1 * (v16[l] - real_chunk.v[l]).square().sum(), l
        assert _grid_bounds_hold(k_pre[l], kb[l], real_chunk.v[l], vb[l], 96, kbits, vbits), l


def test_a_k_block_too_far_from_its_channel_center_gets_float16_scales():
    """A K channel whose blocks sit hundreds of steps apart has no byte-sized lo: that layer's K frame is
    written with float16 scales (and decodes within their bound), its V frame with bytes."""
    from ragcache.store.compact import BYTES, encode_frames

    torch.manual_seed(0)
    k, v = torch.rand(1, 1, 32, 8), torch.rand(1, 1, 32, 8)
    k[0, 0, 16:, 0] += 100.0  # channel 0's second block of 16 tokens
    frames = encode_frames(k, v, spec_for("compact-k3v3+g16+b", 1, None, "fp"))
    assert not frames[0][3] >> 4 & BYTES and frames[1][3] >> 4 & BYTES
    kb, vb = _decoded(frames, k.shape)
    assert all(_clipped_within_bound(k[0, :, s : s + 16], kb[0, :, s : s + 16], 3) for s in (0, 16))
    assert ((vb - v).abs() <= _grid_bound(v[0, 0], 1, 3)).all()


@pytest.mark.parametrize("shape, k", [((3, 37, 1), False), ((3, 5, 8), True)])
def test_byte_scales_dither_lo_by_the_golden_ratio_of_each_v_token_or_k_channel(shape, k):
    """The decoder's lo is center + (m + dither) · step / 4, dither = frac(i · golden ratio) for the i-th V token
    or K channel (a channel's blocks share it): on a grid whose first quarter step is 1, with m = 0 and centers
    0, lo is the dither itself. The encoder places lo with the same compiled code (nibbles._lo, ._dither)."""
    from ragcache.store import scales

    e = np.zeros(shape, np.uint8)
    lo, step = scales.values(scales.grid(4.0), e, e.view(np.int8), np.zeros((3, 1, 8), np.int8) if k else None)
    own = (3, 1, 8) if k else shape
    want = (np.arange(np.prod(own)) * 0.6180339887498949 % 1.0).astype(np.float32).reshape(own)
    assert np.array_equal(lo, np.broadcast_to(want, shape)) and (step == 4).all()


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


def test_a_tensor_past_4_bits_takes_a_byte_a_symbol_within_its_finer_bound_and_the_others_are_unchanged(
        real_chunk, smol_runner):
    """`+v1=8` (cacheblend's check layer) and `+k18=6` on real KV: those two frames are WIDE, their error the
    finer step's (8 bits: V within half a step of its own per-token range; each tensor's squared error far under
    the 4-bit one's), every other frame byte for byte the one without them."""
    from ragcache.store.compact import BYTES, WIDE, encode_frames

    n = len(real_chunk)
    k_pre = rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n), smol_runner.inv_freq)
    names = ["compact-k3v3+k16:30+L1+g96+b", "compact-k3v3+k16:30+L1+v1=8+k18=6+g96+b",
             "compact-k3v3+k16:30+L1+v1=4+k18=4+g96+b"]
    specs = [spec_for(x, smol_runner.num_layers, None, "fp") for x in names]
    assert (specs[1].v_bits[1], specs[1].k_bits[18], specs[0].v_bits[1], specs[0].k_bits[18]) == (8, 6, 4, 4)
    frames = [encode_frames(k_pre, real_chunk.v, s) for s in specs]
    wide = {3, 36}  # V of layer 1, K of layer 18
    for i, (plain, widened) in enumerate(zip(frames[0], frames[1])):
        assert bool(widened[3] >> 4 & WIDE) == (i in wide), i
        assert (plain == widened) == (i not in wide), i
    (k4, v4), (kw, vw) = _decoded(frames[2], k_pre.shape), _decoded(frames[1], k_pre.shape)
    v, k = real_chunk.v[1], k_pre[18]
    if frames[1][3][3] >> 4 & BYTES:  # a wide V's lo rarely fits a byte's reach: float16 scales then
        assert ((vw[1] - v).abs() <= _grid_bound(v, 2, 8)).all()
    else:
        assert _within_bound(v, vw[1], 8, dim=2)
    if frames[1][36][3] >> 4 & BYTES:
        assert _k_grid_bound_holds(k, kw[18], 96, 6)
    else:
        assert all(_clipped_within_bound(k[:, s : s + 96], kw[18, :, s : s + 96], 6) for s in range(0, n, 96))
    assert (vw[1] - v).square().sum() < (v4[1] - v).square().sum() / 100  # steps 17× finer: ~289× less
    assert (kw[18] - k).square().sum() < (k4[18] - k).square().sum() / 8  # 5× finer: ~25× less, clipping aside


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


@pytest.mark.parametrize("name", ["compact-k2v2", "compact-k2v2+g16+r", "compact-k2v2+g16+b", "compact-k2v2+v1=8+k1=5"])
def test_a_frame_damaged_in_memory_does_not_decode(name):
    spec = spec_for(name, 4, None, "fp")
    entry = encode(fake_chunk(8, n=40), "float32", spec, 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    entry.frames[2] = entry.frames[2][:-5]  # a K frame
    entry.frames[3] = bytes(entry.frames[3][:4]) + entry.frames[3][8:]  # a V frame's scales cut short
    with pytest.raises(CorruptBlob):
        decode(entry, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["compact-k3v3", "compact-k3v2+g16+r", "compact-k3v2+g16+r+b", "compact-k3v3+b",
                                  "compact-k3v3+k0=6+v1=8+g16+b"])
def test_the_cpu_unpacking_equals_the_torch_one_the_gpu_runs(name):
    """A contiguous float32 output is unpacked by numba in one compiled call a frame; any other (CUDA's, or a
    strided view here) by torch. Both give the same floats and report the same rounding noise, for every frame
    kind, a short last K block included."""
    from ragcache.store.compact import Decoder, encode_frames

    k, v = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 8)
    frames = encode_frames(k, v, spec_for(name, 2, None, "fp"))
    decoder = Decoder()
    for frame, per_token in zip(frames, [False, True] * 2):
        fast, slow = torch.empty(3, 37, 8), torch.empty(3, 8, 37).transpose(1, 2)  # the second not contiguous
        noise = torch.full((2, 37), -1.0)
        decoder.frame_into(frame, fast, per_token, noise[0])
        decoder.frame_into(frame, slow, per_token, noise[1])
        assert torch.allclose(fast, slow, rtol=1e-6, atol=1e-6)
        assert fast.abs().max() > 0
        assert torch.equal(noise[0], noise[1]) and (noise > 0).all()


@pytest.mark.parametrize("name", ["compact", "compact-k3v3+k16:30+L1+g96+b", "compact-k3v3+k16:30+L1+v1=8+k18=6+g96+b"])
def test_the_rounding_error_the_decoder_reports_is_the_error_it_made_on_real_v(real_chunk, smol_runner, tmp_path,
                                                                                 name):
    """cacheblend takes it off its deviation: per token, summed over heads and hd, step²/12 an element."""
    spec = spec_for(name, smol_runner.num_layers, tmp_path, "uncalibrated")
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
    assert spec_for("compact-k3v3+g96+b", 4, None, "fp").byte_scales and not spec_for("compact-k3v3", 4, None, "fp").byte_scales
    Settings(kv_codec="compact-k3v3+k16:30-v0:16+L1+g96")
    wide = spec_for("compact-k3v3+k0:2+L1+v1=8+k0=2+v2=5+v9=8+g96", 4, None, "fp")  # set last; past the layers: none
    assert wide.k_bits == (2, 4, 3, 3) and wide.v_bits == (3, 8, 5, 3) and wide.k_group == 96
    for bad in ("compact-k3v3+k16", "compact-k3v3+x0:4", "compact-k3v3+L1+k0:4", "compact-k3v3+b+r",
                "compact-k3v3+v1=9", "compact-k3v3+v1=1", "compact-k3v3+v1=8+L1", "compact-k3v3+v1=8+k0:4"):
        with pytest.raises(ValidationError, match="compact-kXvY"):
            Settings(kv_codec=bad)
