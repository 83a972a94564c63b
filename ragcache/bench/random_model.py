"""Randomly initialised Llama-family models built straight on a device (no checkpoint, no HF module):
what `make gpu-check` measures on a machine that holds no weights and reaches no hub."""
from __future__ import annotations

import torch

from blend.model import Model

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 rms_norm_eps=1e-5)
SMALL_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192, rope_theta=10000.0,
                   rms_norm_eps=1e-5)


def random_llama(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> Model:
    """A Llama config of `shape` with N(0, std) weights and unit norms, generated on `device` in `dtype`."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    d, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*size):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    ones = lambda: torch.ones(d, device=device, dtype=dtype)  # noqa: E731
    state = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": ones(),
             "lm_head.weight": w(cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
                      p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
                      p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
                      p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
                      p + "mlp.down_proj.weight": w(d, inter)})
    return Model(f"random-llama-{cfg.num_hidden_layers}L-{d}", cfg, None, state, f"random-{seed}-{dtype}")


def params(model: Model) -> int:
    return sum(t.numel() for t in model.state.values())
