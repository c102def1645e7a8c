"""What identifies a model's weights, for the key namespace of every engine adapter.

A served model's name says little about its weights: a local directory can be retrained
in place, and a hub name can move to new weights. Pages computed with other weights are
other KV, so each adapter keys its pages with :func:`weights_digest` of the model's files
as well as its name (vLLM adds its config, dtype, quantization and revision).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["canonical", "digest", "weights_digest"]

#: Files that hold a model's weights (and the index that names the shards).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_DIGEST_BYTES = 16


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (sorted keys, no spaces; other objects as str)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(value: Any) -> str:
    """32 hex digits of BLAKE2b over :func:`canonical` ``value``."""
    return hashlib.blake2b(canonical(value), digest_size=_DIGEST_BYTES).hexdigest()


def _file_identity(path: Path) -> list[Any]:
    """A weight file's identity: its Hugging Face blob hash where it links to one, else
    its name, size and modification time (a file replaced in place changes these)."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and len(real.name) >= 40:  # the hub cache: content hash
        return [path.name, "blob", real.name]
    info = real.stat()
    return [path.name, info.st_size, info.st_mtime_ns]


def weights_digest(model: str) -> str | None:
    """A digest of the weight files of a local model directory (or file); None for a name
    that is not a local path (a hub id, which only its revision identifies)."""
    path = Path(model)
    if path.is_file():
        return digest([_file_identity(path)])
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    return digest([_file_identity(p) for p in files])
