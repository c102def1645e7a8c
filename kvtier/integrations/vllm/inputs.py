"""What changes a vLLM request's KV besides its token ids, as page-key material.

vLLM's own prefix cache folds a request's LoRA adapter, its multimodal inputs, its cache
salt and its prompt embeddings into each block's hash. kvtier's pages outlive the
engine and are shared between engines, so it keys them with the same inputs, and with
what identifies the model's weights, never by token ids alone: a page computed under one
adapter, image or weight set is never a hit for another.

- :func:`model_identity`: the model's name and a digest of what vLLM computes its KV
  with (:func:`model_inputs`: config, dtype, quantization, KV cache dtype and scales, load
  format), keyed by core's :func:`~kvtier.core.model_identity.identify` as every engine's
  model is; with what identifies its weights: every file of a local model directory, or
  the commit its hub revision resolved to; once per engine. A model with neither, or with
  dummy weights, is refused at start-up.
- :func:`check_engine_inputs`: refuses at start-up an engine whose multimodal items vLLM
  names by request instead of by content (both of its caches off).
- :class:`AdapterIdentities`: a LoRA adapter's name and a digest of its files' contents
  (not vLLM's integer id, which another deployment may give another adapter), symbolic
  links followed (a hub snapshot's files are links into ``blobs/``).
- :func:`page_extras`: per page, the multimodal items whose placeholders it holds (their
  content hash and position) and a digest of its prompt embeddings.

A request input that cannot be keyed raises
:class:`~kvtier.core.errors.UnkeyableInputError`, naming the input, why and what would
work; the scheduler then keeps that request away from kvtier (no load, no store). Nothing
here imports vLLM: requests and configs are read through their attributes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvtier.core.errors import UnkeyableInputError, UnsupportedCombinationError
from kvtier.core.local_files import LocalFile, local_files
from kvtier.core.model_identity import ModelInputs, canonical, identify, settings_of

__all__ = [
    "AdapterIdentities",
    "check_engine_inputs",
    "model_identity",
    "model_inputs",
    "page_extras",
]

#: Keys of a Hugging Face config that say where it was read, not what the model is.
_CONFIG_NOISE = ("_name_or_path", "_commit_hash", "transformers_version")
_DIGEST_BYTES = 16
_READ_BYTES = 1 << 20
#: vLLM's KV cache settings that change a page's bytes beyond its dtype (``CacheConfig``).
CACHE_SETTINGS = (
    "calculate_kv_scales",
    "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)
#: vLLM's model settings that change a page's bytes beyond config, dtype and quantization.
MODEL_SETTINGS = ("quantization_config", "model_impl")


def _config_fields(hf_config: Any) -> Any:
    """The model's Hugging Face config as plain data, without where it was read from."""
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dict(vars(hf_config))
    return {k: v for k, v in data.items() if k not in _CONFIG_NOISE}


def _revision(model_config: Any) -> str | None:
    """The commit the model's hub revision resolved to, else the revision as given.

    vLLM resolves a hub model's revision once at start-up (``--revision`` or, without it,
    the default branch) to huggingface_hub's ``ResolvedRevision``: a ``str`` whose value is
    the name asked for (``"main"``) and whose ``resolved`` is the commit the weights are
    loaded from. A branch name says nothing about the weights; the commit does.
    """
    revision = getattr(model_config, "revision", None)
    if revision is None:
        return None
    resolved = getattr(revision, "resolved", None)
    return str(resolved) if resolved else str(revision)


def model_inputs(
    model_config: Any,
    declared: str | None = None,
    *,
    cache_config: Any = None,
    load_config: Any = None,
) -> ModelInputs:
    """What vLLM computes the model's KV with, read from its ``ModelConfig``,
    ``CacheConfig`` and ``LoadConfig`` (by attribute; a missing one reads as vLLM's
    default), for :func:`~kvtier.core.model_identity.identify`."""
    name = str(getattr(model_config, "model", "") or "")
    local = name if name and Path(name).exists() else None
    return ModelInputs(
        name=name,
        declared=declared,
        local_path=local,
        revision=_revision(model_config),
        config=_config_fields(getattr(model_config, "hf_config", None)),
        dtype=getattr(model_config, "dtype", None),
        kv_cache_dtype=getattr(cache_config, "cache_dtype", None) or "auto",
        quantization=getattr(model_config, "quantization", None),
        load_format=getattr(load_config, "load_format", None),
        settings={
            **settings_of(model_config, MODEL_SETTINGS),
            **settings_of(cache_config, CACHE_SETTINGS),
        },
    )


def model_identity(
    model_config: Any,
    declared: str | None = None,
    *,
    cache_config: Any = None,
    load_config: Any = None,
) -> str:
    """The model's part of the key namespace: ``NAME#DIGEST``.

    The digest covers the config (architecture, sizes, RoPE scaling and theta, overrides),
    dtype, quantization, the KV cache dtype and how its scales are found, the load format,
    and, unless the operator ``declared`` the model's identity (``kvtier.model``), what
    identifies its weights: every file of a local model directory (sub-folders and hub
    snapshot links included), and the commit of a hub model's revision. A declared name is
    trusted to change whenever the weights do; it lets engines whose model paths differ
    share pages.

    Raises :class:`UnsupportedCombinationError` (at start-up) for a model that is neither
    a local directory nor pinned to a revision (weights pushed under its name later would
    hit the pages of the old ones), dummy weights, and what else
    :func:`~kvtier.core.model_identity.identify` refuses.
    """
    return identify(
        model_inputs(model_config, declared, cache_config=cache_config, load_config=load_config)
    )


def check_engine_inputs(vllm_config: Any) -> None:
    """Refuse an engine whose request inputs could not be keyed by their content.

    vLLM names each multimodal item by a hash of its content, unless both its prefix
    cache and its multimodal processor cache are off: then it skips the hashing and
    names items by request (``renderer0-mm-7-image-0``, a counter that starts again in
    every engine), so two images in two engines would share pages. Raises
    :class:`UnsupportedCombinationError` for a multimodal model served that way.
    """
    model_config = getattr(vllm_config, "model_config", None)
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is None:
        return
    processor_cache = getattr(multimodal, "mm_processor_cache_gb", None)
    prefix_caching = getattr(
        getattr(vllm_config, "cache_config", None), "enable_prefix_caching", None
    )
    if processor_cache == 0 and prefix_caching is False:
        raise UnsupportedCombinationError(
            "kvtier cannot key the multimodal inputs of this engine: with vLLM's prefix "
            "cache off and mm_processor_cache_gb 0, vLLM does not hash an image's (or "
            "audio's, or video's) content and names it by request instead, and kvtier "
            "keys the pages holding it by that name, so another image in another engine "
            "would get this one's pages",
            value={"enable_prefix_caching": prefix_caching, "mm_processor_cache_gb": 0},
            supported=[
                "vLLM's prefix cache on (its default; drop --no-enable-prefix-caching)",
                "--mm-processor-cache-gb above 0 (vLLM's default is 4)",
            ],
        )


class AdapterIdentities:
    """LoRA adapter -> ``NAME@DIGEST``, the digest over every file of the adapter.

    Files are found by :func:`~kvtier.core.local_files.local_files`: symbolic links are
    followed (a hub snapshot is all links into ``blobs/``) and one that leaves the adapter's
    folder (its hub repository's, for a snapshot), dangles or loops is refused. Hashing
    reads the adapter once per process (an adapter of 100 MiB takes a fraction of a
    second); the result is kept while the files' sizes and times stay the same, so an
    adapter rewritten in place is hashed again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[tuple[Any, ...], str]] = {}

    def __call__(self, lora_request: Any) -> str | None:
        """The identity of ``lora_request``'s adapter, or None for no adapter.

        Raises :class:`UnkeyableInputError` for an adapter without local files, one that
        cannot be read, or one with a symbolic link that cannot be keyed.
        """
        if not lora_request:
            return None
        name = str(getattr(lora_request, "lora_name", "") or "")
        path = str(getattr(lora_request, "lora_path", "") or "")
        root = Path(path)
        if not path or not root.exists():
            raise UnkeyableInputError(
                f"LoRA adapter {name!r} has no local files at {path!r}, and kvtier keys "
                "an adapter's pages by its files' contents (another adapter may reuse its "
                "name and id): give vLLM the adapter as a local directory (lora_path)",
                value=path,
            )
        try:
            files = local_files(root, what=f"LoRA adapter {name!r} at {path!r}")
            stamp = tuple((f.name, str(f.path), *self._stamp(f.path)) for f in files)
            with self._lock:
                known = self._known.get(path)
            if known is not None and known[0] == stamp:
                return f"{name}@{known[1]}"
            digest = self._hash(files)
        except OSError as exc:
            raise UnkeyableInputError(
                f"LoRA adapter {name!r} at {path!r} cannot be read ({exc}), and kvtier "
                "keys an adapter's pages by its files' contents: make every file under "
                "lora_path readable by the engine's scheduler process",
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
    def _hash(files: Iterable[LocalFile]) -> str:
        h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        for file in files:
            h.update(canonical([file.name, file.size]))
            with open(file.path, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise OSError(f"{file.path} is not a regular file")
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
            modality = getattr(feature, "modality", None) or "multimodal"
            raise UnkeyableInputError(
                f"the {modality} input at tokens {offset}..{offset + length - 1} of request "
                f"{request.request_id!r} has no content hash (its MultiModalFeatureSpec "
                "identifier is empty), and kvtier keys the pages holding it by that hash: "
                f"pass multi_modal_uuids naming each {modality} item's content, or use a "
                "multimodal processor that returns a hash per item (vLLM's own do)",
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
