"""What a model computes its KV with, as the model's part of every engine's key namespace.

A page's bytes depend on more than its tokens: the weights, the model's config (RoPE
scaling and theta, overrides), the dtype, the quantization, the KV cache's dtype and how
its scales are found, and how the weights were loaded. Each engine adapter reads those
from its engine's config into a :class:`ModelInputs` of plain values, and
:func:`identify` turns them into ``NAME#DIGEST``, the same way for every engine, or refuses
at start-up what it cannot key, naming the setting and the fix.

The digest is canonical JSON hashed with BLAKE2b: the same inputs give the same digest in
every process and run (no dict order, no object ids, no hash seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.core.errors import UnkeyableInputError, UnsupportedCombinationError
from kvtier.core.local_files import file_identity, local_files

__all__ = [
    "LOCAL_LOAD_FORMATS",
    "ModelInputs",
    "canonical",
    "digest",
    "identify",
    "plain",
    "settings_of",
    "weights_identity",
]

_DIGEST_BYTES = 16
#: Load formats that read the weights from the model's local files (vLLM's and SGLang's
#: names): those files identify the weights. Another format (weights streamed from object
#: storage, another instance or a plugin) is keyed only under a declared model identity.
LOCAL_LOAD_FORMATS = frozenset(
    {
        "auto",
        "pt",
        "safetensors",
        "npcache",
        "gguf",
        "bitsandbytes",
        "sharded_state",
        "mistral",
        "fastsafetensors",
        "instanttensor",
        "layered",
    }
)
#: Load formats whose weights no name identifies: refused, whatever is declared.
_RANDOM_LOAD_FORMATS = frozenset({"dummy"})
_DECLARE = (
    '"kvtier": {"model": "NAME"}, a name the operator changes whenever the weights do '
    "(llama-3-8b@COMMIT)"
)


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (sorted keys, no spaces; other objects as str)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(value: Any) -> str:
    """32 hex digits of BLAKE2b over :func:`canonical` ``value``."""
    return hashlib.blake2b(canonical(value), digest_size=_DIGEST_BYTES).hexdigest()


def _unkeyable(where: str, value: Any) -> UnsupportedCombinationError:
    return UnsupportedCombinationError(
        f"kvtier cannot key the engine setting {where} (a {type(value).__name__}, which has "
        "no value that stays the same from one process to the next), and it may change "
        "the KV a page holds",
        value=where,
        supported=[
            f"{where} as plain data (strings, numbers, lists, objects), or left unset",
            _DECLARE + " keeps every other setting keyed but trusts the name for the weights",
        ],
    )


def plain(value: Any, where: str) -> Any:
    """``value`` as plain JSON data, the same in every process: mappings, sequences,
    enums, dataclasses, pydantic models and configs with ``to_dict`` are converted; a
    ``torch.dtype`` is its name. Raises :class:`UnsupportedCombinationError` naming
    ``where`` for anything else (a callable, an object known only by its id)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Enum):
        return plain(value.value, where)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)):
                raise _unkeyable(f"{where}[{key!r}]", key)
            out[str(key)] = plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(item, where) for item in value), key=canonical)
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value), where)
    for method in ("model_dump", "to_dict"):
        convert = getattr(value, method, None)
        if callable(convert) and not isinstance(value, type):
            return plain(convert(), where)
    raise _unkeyable(where, value)


def _dtype(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def weights_identity(path: str | os.PathLike[str], *, what: str) -> str:
    """A digest of what identifies the weights under the local folder (or file) ``path``:
    every file in every sub-folder, links followed (:mod:`kvtier.core.local_files`), each
    by :func:`~kvtier.core.local_files.file_identity` (safetensors headers and sizes, hub
    blob hashes, small files' contents), not by reading the weights."""
    return digest([file_identity(f) for f in local_files(path, what=what)])


@dataclass(frozen=True)
class ModelInputs:
    """What an engine computes a model's KV with, as plain values its adapter read.

    ``settings`` holds the other engine settings that change a page's bytes, under the
    engine's own names (vLLM's ``calculate_kv_scales``, SGLang's
    ``json_model_override_args``): they are keyed as given, and one that is not plain data
    is refused.
    """

    #: The model as the engine names it (a path or a hub id).
    name: str
    #: The operator's name for the weights (``kvtier.model``): replaces ``name`` and the
    #: weights' identity; everything else is still keyed.
    declared: str | None = None
    #: The local folder (or file) the weights are loaded from; None: none (a hub id).
    local_path: str | None = None
    #: The commit the weights were resolved to (a hub model's), or None.
    revision: str | None = None
    #: The model's effective Hugging Face config (overrides applied), as a mapping.
    config: Mapping[str, Any] | None = None
    dtype: Any = None
    kv_cache_dtype: Any = None
    quantization: Any = None
    #: How the weights were loaded (``--load-format``); None: the engine's ``auto``.
    load_format: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)


def _check_load_format(inputs: ModelInputs, load_format: str) -> None:
    if load_format in _RANDOM_LOAD_FORMATS:
        raise UnsupportedCombinationError(
            f"kvtier cannot key the pages of model {inputs.name!r} loaded with --load-format "
            f"{load_format}: the weights are random values, not the model's, so their pages "
            "would be served to (or from) runs with other weights",
            value=load_format,
            supported=[
                "--load-format auto (the real weights)",
                "no kvtier connector for profiling runs with dummy weights",
            ],
        )
    if load_format not in LOCAL_LOAD_FORMATS and inputs.declared is None:
        raise UnsupportedCombinationError(
            f"kvtier cannot key the pages of model {inputs.name!r} loaded with --load-format "
            f"{load_format}: the weights do not come from local files kvtier can identify",
            value=load_format,
            supported=[
                f"--load-format one of {', '.join(sorted(LOCAL_LOAD_FORMATS))}",
                _DECLARE,
            ],
        )


def identify(inputs: ModelInputs) -> str:
    """The model's part of the key namespace: ``NAME#DIGEST``.

    The digest covers the config, dtype, KV cache dtype, quantization, load format and
    ``settings``; unless the operator declared the model's identity, also the revision and
    the identity of the local weights (:func:`weights_identity`). Raises
    :class:`UnsupportedCombinationError` (at start-up) for what cannot be keyed: weights
    neither local nor pinned to a revision, a dummy or non-local load format, a symbolic
    link under the model's folder that leaves it, a setting that is not plain data.
    """
    load_format = str(inputs.load_format or "auto")
    _check_load_format(inputs, load_format)
    parts: dict[str, Any] = {
        "config": plain(inputs.config, "the model's config"),
        "dtype": _dtype(inputs.dtype),
        "kv_cache_dtype": _dtype(inputs.kv_cache_dtype),
        "quantization": plain(inputs.quantization, "quantization"),
        "load_format": load_format,
        "settings": {name: plain(value, name) for name, value in inputs.settings.items()},
    }
    if inputs.declared is not None:
        return f"{inputs.declared}#{digest(parts)}"
    weights = None
    if inputs.local_path is not None and Path(inputs.local_path).exists():
        try:
            weights = weights_identity(inputs.local_path, what=f"model {inputs.name!r}")
        except UnkeyableInputError as exc:
            raise UnsupportedCombinationError(
                str(exc), value=exc.value, supported=[_DECLARE]
            ) from None
        except OSError as exc:
            raise UnsupportedCombinationError(
                f"kvtier cannot read the files of model {inputs.name!r} ({exc}) to identify "
                "its weights",
                value=inputs.local_path,
                supported=["every file under the model's folder readable by the engine", _DECLARE],
            ) from exc
    if weights is None and inputs.revision is None:
        raise UnsupportedCombinationError(
            f"kvtier cannot key the pages of model {inputs.name!r}: it is not a local model "
            "directory (whose weight files kvtier would identify) and the engine resolved no "
            "revision for it (no commit from the Hub or its local cache), so weights "
            "published under this name later would be served the old weights' pages",
            value=inputs.name,
            supported=[
                "--revision COMMIT (a commit hash; the engine resolves a branch or tag to "
                "its commit when the Hub or the local hub cache answers)",
                "a local model directory as --model",
                _DECLARE,
            ],
        )
    parts["revision"] = inputs.revision
    parts["weights"] = weights
    return f"{inputs.name}#{digest(parts)}"


def settings_of(source: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{name: source.name}`` for each of ``names`` that ``source`` has (a config object
    of the engine's, read by attribute); what an adapter puts in ``ModelInputs.settings``."""
    missing = object()
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(source, name, missing)
        if value is not missing:
            out[name] = value
    return out
