"""The compact KV codec: its error bound on real KV, its size, old and new blobs side by side, corrupt frames."""
from __future__ import annotations

import pytest
import torch

from blend import ChunkKV, Reuse, compute_chunk, compute_prefix, fuse_and_prefill
from ragcache.store import CorruptBlob, TieredStore, decode, encode
from ragcache.store.codec import rotate_k, from_bytes, to_bytes
from ragcache.store.codecs import spec_for
from ragcache.store.compact import Spec
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


def _within_bound(x: torch.Tensor, x_hat: torch.Tensor, bits: int, dim: int) -> bool:
    """|x − x̂| ≤ step/2 per group, plus the float16 rounding of the group's lo and step."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (hi - lo) / ((1 << bits) - 1)
    slack = 2.0**-10 * (lo.abs() + (hi - lo))
    return bool(((x - x_hat).abs() <= step / 2 + slack + 1e-6).all())


def test_compact_round_trip_on_real_kv_is_within_its_bound_and_under_3_2_bits(real_chunk, smol_runner, tmp_path):
    spec = spec_for("compact", smol_runner.num_layers, tmp_path, "uncalibrated")  # the default widths
    entry = from_bytes(to_bytes(encode(real_chunk, "float32", spec, smol_runner.inv_freq)))
    bits = len(to_bytes(entry)) * 8 / (2 * real_chunk.k.numel())  # every scale, sum and header counted
    assert bits <= 3.2, bits
    back = decode(entry, torch.float32, torch.device("cpu"))
    assert back.k_pre_rope and not back.lossless and torch.equal(back.token_ids, real_chunk.token_ids)
    n = len(real_chunk)
    k_pre = rotate_k(real_chunk.k, -torch.arange(real_chunk.start, real_chunk.start + n), smol_runner.inv_freq)
    for l in range(smol_runner.num_layers):
        assert _within_bound(k_pre[l], back.k[l], spec.k_bits[l], dim=1)  # K: per (head, channel)
        assert _within_bound(real_chunk.v[l], back.v[l], spec.v_bits[l], dim=2)  # V: per (head, token)


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
    spec = Spec.uniform("compact-k3v3", 4, 3, 3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    chunk = fake_chunk(7, n=40)
    store = _store(db, tmp_path / "kv")
    store.put("old", encode(chunk, "float32"))  # a raw blob, as every store held before codecs
    store.put("new", encode(chunk, "float32", spec, inv_freq))
    old, new = store.get("old"), store.get("new")
    assert old.tier == new.tier == "disk" and old.entry.codec == "raw" and new.entry.codec == "compact-k3v3"
    assert torch.equal(decode(old.entry, torch.float32, torch.device("cpu")).v, chunk.v)
    assert (decode(new.entry, torch.float32, torch.device("cpu")).v - chunk.v).abs().max() < 0.6
    path = next((tmp_path / "kv").glob("*/new.safetensors"))
    data = bytearray(path.read_bytes())
    data[-20 if damage == "frame" else 40] ^= 0x10  # inside the last frame, or inside the JSON header
    path.write_bytes(bytes(data))
    assert store.get("new") is None and store.corrupt["disk"] == 1 and not path.exists()
    assert store.get("old") is not None


def test_a_frame_damaged_in_memory_does_not_decode():
    spec = Spec.uniform("compact-k2v2", 4, 2, 2)
    entry = encode(fake_chunk(8, n=40), "float32", spec, 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    entry.frames[3] = entry.frames[3][:-5]
    with pytest.raises(CorruptBlob):
        decode(entry, torch.float32, torch.device("cpu"))


def test_a_damaged_calibration_file_falls_back_to_the_default_widths(tmp_path):
    from ragcache.store.codecs import DEFAULT, calibration_path

    path = calibration_path(tmp_path, "fp")
    path.parent.mkdir(parents=True)
    default = spec_for(DEFAULT, 4, tmp_path, "fp")
    for damage in (b"\xff\xfe{garbage", b'{"k_bits": 3}', b"[]"):
        path.write_bytes(damage)
        assert spec_for("compact", 4, tmp_path, "fp") == default  # it used to raise at every store write
