"""Shared fixtures: the real SmolLM2 loaded once per session, tiny random models of each shape."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU in tests

from blend.model import Model, load_model  # noqa: E402
from blend.runner import Runner  # noqa: E402
from ragcache.config import Settings  # noqa: E402

TINY_SHAPES = {
    # covers q/k norms and head_dim != hidden / heads
    "qwen3": dict(model_type="qwen3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # projection biases
    "qwen2": dict(model_type="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    # llama-3 style RoPE scaling, no GQA
    "llama3": dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 256}),
    "mistral": dict(model_type="mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                    sliding_window=None),
}


def tiny_hf_model(shape: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_SHAPES[shape])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=512, intermediate_size=128, num_hidden_layers=3,
                                  max_position_embeddings=4096, initializer_range=0.2, eos_token_id=3,
                                  bos_token_id=1, pad_token_id=0, tie_word_embeddings=False, **spec)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def smollm(settings) -> Model:
    return load_model(None, settings.home, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smol_runner(smollm) -> Runner:
    return Runner(smollm)


@pytest.fixture(scope="session")
def smol_hf(smollm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm.path, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_models() -> dict:
    """shape → (hf_model, runner), built on first use."""
    return {}


@pytest.fixture(params=["smollm2", *sorted(TINY_SHAPES)])
def arch(request, tiny_models):
    """(hf_model, runner) for the real SmolLM2 and each tiny random architecture."""
    if request.param == "smollm2":
        return request.getfixturevalue("smol_hf"), request.getfixturevalue("smol_runner")
    if request.param not in tiny_models:
        hf = tiny_hf_model(request.param)
        tiny_models[request.param] = hf, Runner(Model.from_hf(hf, name=request.param))
    return tiny_models[request.param]
