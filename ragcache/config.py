"""One settings object, read from RAGCACHE_* environment variables and validated once."""
from __future__ import annotations

from pathlib import Path

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SYSTEM_PROMPT = (
    "You will be asked a question after reading several passages. "
    "Answer it directly from the passages, in a few words. Do not repeat the question."
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGCACHE_", protected_namespaces=())

    home: Path = Path("~/.cache/ragcache")
    model: str = "smollm2"  # "smollm2" (bundled) or a local HF checkpoint directory
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_new_tokens: int = 32

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        allowed = ("auto", "float32", "bfloat16", "float16")
        if v not in allowed:
            raise ValueError(f"dtype must be one of {', '.join(allowed)}")
        return v
