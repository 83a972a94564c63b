"""Model loading: the bundled default, local directories, clear errors, the fingerprint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from blend.model import Model, ModelError, _gguf_read_once, load_model
from tests.conftest import tiny_hf_model


def test_default_model_is_dequantized_once_and_reloads(smollm, settings):
    assert smollm.config.model_type == "llama" and smollm.dtype == torch.float32
    assert (smollm.path / "model.safetensors").is_file() and smollm.path.parent == settings.home / "models"
    again = load_model(None, settings.home, device="cpu", dtype="float32")
    assert again.fingerprint == smollm.fingerprint
    assert smollm.tokenizer.decode(smollm.tokenizer("Paris is nice")["input_ids"]) == "Paris is nice"


def test_a_conversion_reads_the_gguf_once_and_leaves_gguf_as_it_was(tmp_path):
    """transformers reads the file for the tokenizer, the config and the weights: one parse serves the three."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    before = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(KeyError):
        with _gguf_read_once():
            first = gguf.GGUFReader(str(path))
            assert gguf.GGUFReader(str(path)) is first and first.fields["general.architecture"]
            assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
            raise KeyError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))


def test_fingerprint_changes_with_weights_and_dtype(smollm):
    hf = tiny_hf_model("qwen3")
    base = Model.from_hf(hf)
    assert Model.from_hf(hf).fingerprint == base.fingerprint
    with torch.no_grad():
        hf.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert Model.from_hf(hf).fingerprint != base.fingerprint
    assert Model.from_hf(hf.to(torch.bfloat16)).fingerprint != base.fingerprint
    assert base.fingerprint != smollm.fingerprint


def test_local_directory_loads_and_runs(tmp_path, smollm):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ModelError, match="tokenizer"):
        load_model(str(tmp_path / "ckpt"), tmp_path, device="cpu")
    smollm.tokenizer.save_pretrained(tmp_path / "ckpt")
    m = load_model(str(tmp_path / "ckpt"), tmp_path, device="cpu")
    assert m.config.model_type == "qwen2" and m.dtype == torch.float32
    ids = torch.arange(5, 60)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0, -1]
    from blend.runner import Runner

    assert (Runner(m).prefill(ids).logits - ref).abs().max() <= 1e-4


def test_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="config.json missing"):
        load_model(str(tmp_path / "nope"), tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(ModelError, match="not supported"):
        load_model(str(tmp_path), tmp_path)


@pytest.mark.parametrize("shape, flag", [("llama3", "mlp_bias"), ("llama3", "attention_bias"), ("mistral", "mlp_bias")])
def test_bias_weights_the_runner_would_ignore_are_refused(shape, flag):
    hf = tiny_hf_model(shape)
    setattr(hf.config, flag, True)  # the weights would be there; the runner has no place for them
    with pytest.raises(ModelError, match="attention_bias / mlp_bias"):
        Model.from_hf(hf, name=shape)


def _cut(path, at=None) -> None:
    """Replace `path` by its first `at` bytes (half by default): a new file, never the original's inode."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2 if at is None else at])


@pytest.mark.parametrize("damaged", ["model.safetensors", "chat_template.jinja"])  # unreadable; still parses
def test_a_damaged_conversion_of_the_default_model_is_converted_again(tmp_path, smollm, damaged):
    models = tmp_path / "models"
    shutil.copytree(smollm.path, models / smollm.path.name)  # a home of its own: the shared cache stays whole
    conversion = models / smollm.path.name
    load_model(None, tmp_path, device="cpu", dtype="float32")  # its record (of what a conversion wrote), if none
    original = (conversion / damaged).read_bytes()
    _cut(conversion / damaged)
    again = load_model(None, tmp_path, device="cpu", dtype="float32")
    assert again.fingerprint == smollm.fingerprint and (conversion / damaged).read_bytes() == original
    assert sorted(p.name for p in models.iterdir()) == [smollm.path.name]  # nothing set aside is left


def test_a_damaged_file_of_a_local_directory_is_one_error_naming_it(tmp_path, smollm):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "ckpt")
    smollm.tokenizer.save_pretrained(tmp_path / "ckpt")
    for name, damage in (("tokenizer_config.json", b"\x00\xff garbage"), ("config.json", b'{"model_type": "qw'),
                         ("model.safetensors", None)):
        path = tmp_path / "ckpt" / name
        original = path.read_bytes()
        if damage is None:
            _cut(path)
        else:
            path.write_bytes(damage)
        with pytest.raises(ModelError) as err:
            load_model(str(tmp_path / "ckpt"), tmp_path, device="cpu")
        assert str(err.value).startswith(f"{path}: cannot be read") and "\n" not in str(err.value), err.value
        path.write_bytes(original)  # yours to mend: a local directory is never rewritten
    assert load_model(str(tmp_path / "ckpt"), tmp_path, device="cpu").config.model_type == "qwen2"
