"""The bundled model's converted directory (the GGUF dequantized into HF form): its record of itself.

The directory is ours to rebuild, so it is checked at every load. The first load that reads it whole
leaves `RECORD` beside its files: a hash of each file but the weights, and the digest of the weights
as loaded (which every load computes anyway). A later load compares against it, so a file cut short,
garbage or changed since is found even when it still parses (a chat template cut mid-way, a flipped
weight); the loader then sets the directory aside and converts the GGUF again.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import xxhash

RECORD = "ragcache-record.json"


def mismatch(path: Path, weights_digest: str | None = None) -> str | None:
    """"FILE: why" for the first file that differs from the record: any file but the weights, or (given
    their digest, once loaded) the weights; None when none does, or when there is no record yet."""
    record_path = path / RECORD
    try:
        record = json.loads(record_path.read_text())
        files, weights = dict(record["files"]), str(record["weights"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{record_path}: cannot be read ({type(e).__name__})"
    if weights_digest is not None:
        return None if weights_digest == weights else \
            f"{path}: the weights in its *.safetensors differ from what its conversion wrote"
    for name, digest in sorted(files.items()):
        try:
            if _hash(path / name) != digest:
                return f"{path / name}: differs from what its conversion wrote"
        except OSError as e:
            return f"{path / name}: {e.strerror or type(e).__name__}"
    return None


def keep(path: Path, weights_digest: str) -> None:
    """Write the record of a directory that has none, from what was just loaded whole (a directory
    converted before records were kept is trusted once). A read-only home keeps none."""
    if (path / RECORD).exists():
        return
    files = {f.name: _hash(f) for f in sorted(path.iterdir())
             if f.is_file() and f.suffix != ".safetensors" and f.name != RECORD}
    tmp = path / f".{RECORD}.{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps({"files": files, "weights": weights_digest}, indent=1))
        os.replace(tmp, path / RECORD)  # processes loading together write the same record
    except OSError:
        tmp.unlink(missing_ok=True)


def set_aside(path: Path) -> None:
    """Move a damaged conversion out of the way, then remove it: a process that has its files open keeps
    them, and the next look for the directory finds none and converts again."""
    aside = path.with_name(f".damaged-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(aside)
    except FileNotFoundError:  # another process set it aside first
        return
    shutil.rmtree(aside, ignore_errors=True)


def _hash(file: Path) -> str:
    return xxhash.xxh3_128(file.read_bytes()).hexdigest()
