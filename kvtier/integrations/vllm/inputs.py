"""What changes a vLLM request's KV besides its token ids, as page-key material.

vLLM's own prefix cache folds a request's LoRA adapter, its multimodal inputs, its cache
salt and its prompt embeddings into each block's hash. kvtier's pages outlive the
engine and are shared between engines, so it keys them with the same inputs, and with
what identifies the model's weights, never by token ids alone: a page computed under one
adapter, image or weight set is never a hit for another.

- :func:`model_identity`: the model's name, revision, a digest of its config, dtype and
  quantization, and (for a local model directory) of its weight files; once per engine.
- :class:`AdapterIdentities`: a LoRA adapter's name and a digest of its files' contents
  (not vLLM's integer id, which another deployment may give another adapter).
- :func:`page_extras`: per page, the multimodal items whose placeholders it holds (their
  content hash and position) and a digest of its prompt embeddings.

An input that cannot be keyed raises :class:`~kvtier.core.errors.UnkeyableInputError`;
the scheduler then keeps that request away from kvtier (no load, no store). Nothing here
imports vLLM: requests are read through their attributes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvtier.core.errors import UnkeyableInputError
from kvtier.integrations.identity import canonical, digest, weights_digest

__all__ = ["AdapterIdentities", "model_identity", "page_extras"]

log = logging.getLogger("kvtier.vllm")

#: Keys of a Hugging Face config that say where it was read, not what the model is.
_CONFIG_NOISE = ("_name_or_path", "_commit_hash", "transformers_version")
_DIGEST_BYTES = 16
_READ_BYTES = 1 << 20


def _config_fields(hf_config: Any) -> Any:
    """The model's Hugging Face config as plain data, without where it was read from."""
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dict(vars(hf_config))
    return {k: v for k, v in data.items() if k not in _CONFIG_NOISE}


def model_identity(model_config: Any, declared: str | None = None) -> str:
    """The model's part of the key namespace: ``NAME#DIGEST``.

    The digest covers the config (architecture, sizes, RoPE scaling, overrides), dtype
    and quantization, and, unless the operator ``declared`` the model's identity
    (``kvtier.model``), its revision and weight files. A declared name is trusted to
    change whenever the weights do; it lets engines whose model paths differ share pages.
    """
    name = declared or str(getattr(model_config, "model", ""))
    parts: dict[str, Any] = {
        "config": _config_fields(getattr(model_config, "hf_config", None)),
        "dtype": getattr(model_config, "dtype", None),
        "quantization": getattr(model_config, "quantization", None),
    }
    if declared is None:
        revision = getattr(model_config, "revision", None)
        weights = weights_digest(name) if name else None
        parts["revision"] = revision
        parts["weights"] = weights
        if weights is None and revision is None:
            log.warning(
                "kvtier: model %r is keyed by its name and config only (no local weight "
                "files, no revision): weights that change under this name would hit old "
                "pages; pin --revision or set kvtier.model to a name that changes with "
                "the weights",
                name,
            )
    return f"{name}#{digest(parts)}"


def _adapter_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


class AdapterIdentities:
    """LoRA adapter -> ``NAME@DIGEST``, the digest over every file of the adapter.

    Hashing reads the adapter once per process (an adapter of 100 MiB takes a fraction
    of a second); the result is kept while the files' sizes and times stay the same, so
    an adapter rewritten in place is hashed again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[tuple[Any, ...], str]] = {}

    def __call__(self, lora_request: Any) -> str | None:
        """The identity of ``lora_request``'s adapter, or None for no adapter."""
        if not lora_request:
            return None
        name = str(getattr(lora_request, "lora_name", "") or "")
        path = str(getattr(lora_request, "lora_path", "") or "")
        root = Path(path)
        if not path or not root.exists():
            raise UnkeyableInputError(
                f"LoRA adapter {name!r} has no local files at {path!r}; kvtier keys an "
                "adapter by its files' contents: give vLLM a local adapter path",
                value=path,
            )
        try:
            files = _adapter_files(root)
            stamp = tuple((str(p), *self._stamp(p)) for p in files)
            with self._lock:
                known = self._known.get(path)
            if known is not None and known[0] == stamp:
                return f"{name}@{known[1]}"
            digest = self._hash(root, files)
        except OSError as exc:
            raise UnkeyableInputError(
                f"LoRA adapter {name!r} at {path!r} cannot be read to key its pages: "
                f"{exc}; make its files readable by the engine",
                value=path,
            ) from exc
        with self._lock:
            self._known[path] = (stamp, digest)
        return f"{name}@{digest}"

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int]:
        info = path.stat()
        return info.st_size, info.st_mtime_ns

    @staticmethod
    def _hash(root: Path, files: Iterable[Path]) -> str:
        h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        for file in files:
            relative = file.name if root.is_file() else file.relative_to(root).as_posix()
            h.update(canonical([relative, file.stat().st_size]))
            with open(file, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    continue
                while chunk := handle.read(_READ_BYTES):
                    h.update(chunk)
        return h.hexdigest()


def _mm_items(request: Any, start: int, end: int) -> list[list[Any]]:
    """The multimodal items whose placeholders overlap tokens ``[start, end)``."""
    items: list[list[Any]] = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        offset, length = int(position.offset), int(position.length)
        if offset >= end or offset + length <= start:
            continue
        identifier = getattr(feature, "identifier", None)
        if not identifier:
            raise UnkeyableInputError(
                f"a {getattr(feature, 'modality', 'multimodal')} input of request "
                f"{request.request_id!r} has no content hash to key its pages",
                value=request.request_id,
            )
        items.append(["mm", str(identifier), offset - start, length])
    return items


def _embeds_item(request: Any, start: int, end: int) -> list[Any] | None:
    """A digest of the prompt embeddings of tokens ``[start, end)`` (None: none there)."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None or start >= int(embeds.shape[0]):
        return None
    rows = embeds[start:end].detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(canonical([str(rows.dtype), list(rows.shape)]))
    h.update(rows.reshape(-1).view(torch.uint8).numpy().data)
    mask = getattr(request, "prompt_is_token_ids", None)
    tokens = None if mask is None else "".join("1" if m else "0" for m in mask[start:end])
    return ["embeds", h.hexdigest(), tokens]


def page_extras(
    request: Any, first_page: int, pages: int, page_size: int
) -> list[bytes | None] | None:
    """Per page ``first_page .. pages - 1`` of ``request``, what besides its tokens changes
    its KV (for :meth:`~kvtier.core.keys.PageKeyer.keys`); None when nothing does."""
    has_mm = bool(getattr(request, "mm_features", None))
    if not has_mm and getattr(request, "prompt_embeds", None) is None:
        return None
    out: list[bytes | None] = []
    for page in range(first_page, pages):
        start, end = page * page_size, (page + 1) * page_size
        items = _mm_items(request, start, end) if has_mm else []
        embeds = _embeds_item(request, start, end)
        if embeds is not None:
            items.append(embeds)
        out.append(canonical(items) if items else None)
    return out
