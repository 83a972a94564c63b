"""A BERT encoder's forward pass (all-MiniLM-L6-v2's shape: post-LayerNorm, absolute positions, GELU), read
straight from its safetensors file.

transformers' `AutoModel` does the same arithmetic, but importing its BERT module pulls in generation,
masking and torch's compiler stack: ~3 s of every process that retrieves (a CLI `search`, a server's start),
longer than the embedder's whole work there. This is the encoder alone, checked against transformers' output
in the tests.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class Bert:
    """`hidden(ids, mask)`: ids, mask (b, t) int64 → the last layer's states (b, t, dim) float32."""

    def __init__(self, path: Path, device: str = "cpu"):
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu" or \
                config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: not a BERT encoder this pass computes (model_type bert, gelu, absolute positions)")
        w = {k.removeprefix("bert."): v.to(device) for k, v in load_file(path / "model.safetensors").items()}
        self.w, self.heads, self.layers = w, config["num_attention_heads"], config["num_hidden_layers"]
        self.eps, self.dim = config["layer_norm_eps"], config["hidden_size"]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _dense(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w, (b, t) = self.w, ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:t]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")  # (b, t, hidden)
        keep = mask.bool()[:, None, None, :]  # (b, 1, 1, t): padding is never attended to
        for i in range(self.layers):
            at = f"encoder.layer.{i}."
            q, k, v = (self._dense(x, at + f"attention.self.{n}").view(b, t, self.heads, -1).transpose(1, 2)
                       for n in ("query", "key", "value"))  # (b, heads, t, head_dim) each
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, t, -1)
            x = self._norm(x + self._dense(a, at + "attention.output.dense"), at + "attention.output.LayerNorm")
            h = F.gelu(self._dense(x, at + "intermediate.dense"))
            x = self._norm(x + self._dense(h, at + "output.dense"), at + "output.LayerNorm")
        return x
