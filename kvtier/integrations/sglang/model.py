"""What SGLang computes a model's KV with, as the model's part of the key namespace.

SGLang hands a storage backend only its model's name (``HiCacheStorageConfig.model_name``),
so the adapter reads the rest from the model settings in effect in the server's process
(``sglang.srt.runtime_context.get_model()``, published before the cache is built): model
path and revision, dtype, quantization, KV cache dtype and its scales file, config
overrides (``json_model_override_args``), load format. Core's
:func:`~kvtier.core.model_identity.identify` keys them as it keys vLLM's, and refuses at
start-up what it cannot key.

A storage built outside an SGLang server (no settings published) knows the name only: it
keys that name (and a local model folder's files), and says so in a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from kvtier.core.errors import UnkeyableInputError, UnsupportedCombinationError
from kvtier.core.local_files import file_digest
from kvtier.core.model_identity import ModelInputs, identify, weights_identity

__all__ = ["MODEL_SETTINGS", "model_inputs", "model_name", "published_model"]

log = logging.getLogger("kvtier.sglang")

#: SGLang's model settings (``ServerArgs``, namespace ``model``) that change a page's bytes
#: beyond dtype, quantization, KV cache dtype and load format; keyed as given.
MODEL_SETTINGS = ("json_model_override_args", "modelopt_quant", "model_impl")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_warned: set[str] = set()


def published_model() -> Any:
    """The model settings SGLang published in this process, or None where it published
    none (a storage built outside an SGLang server) or is not installed."""
    context = sys.modules.get("sglang.srt.runtime_context")
    if context is None:  # a server has imported it before building its cache
        return None
    try:
        return context.get_model()
    except ValueError:  # "config namespace 'model' not published"
        return None


def _overrides(value: Any) -> Any:
    """``json_model_override_args`` as data (SGLang takes a JSON string), so that key order
    and spacing do not change the key."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value


def _hub_cache(download_dir: str | None) -> Path:
    """The Hugging Face hub cache SGLang downloads into: ``--download-dir``, else
    ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if download_dir:
        return Path(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def _hub_snapshot(repo: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The hub cache's snapshot of ``repo`` at ``revision`` (default ``main``; a branch or
    tag read from ``refs/``, as the hub cache resolves it), the files SGLang loaded, or
    None where the cache has none."""
    if repo.count("/") != 1 or ".." in repo:
        return None
    folder = _hub_cache(download_dir) / f"models--{repo.replace('/', '--')}"
    name = str(revision or "main")
    commit = name if _COMMIT.fullmatch(name) else None
    if commit is None:
        try:
            commit = (folder / "refs" / name).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    snapshot = folder / "snapshots" / commit
    return snapshot if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


def _scales(value: Any) -> Any:
    """A KV scales file (``quantization_param_path``) by its contents where it is local."""
    if isinstance(value, str) and value and Path(value).is_file():
        return {"file": Path(value).name, "data": file_digest(Path(value))}
    return value


def model_inputs(model: Any, name: str, declared: str | None) -> ModelInputs:
    """What SGLang computes the KV with, from its published model settings ``model``
    (read by attribute), for the storage's model ``name`` and the operator's ``declared``
    identity. A hub model id is found in the local hub cache (where SGLang downloaded
    it): its files and commit identify the weights."""
    path = str(getattr(model, "model_path", "") or name)
    revision = getattr(model, "revision", None)
    local: str | None = path if Path(path).exists() else None
    commit = str(revision) if revision and _COMMIT.fullmatch(str(revision)) else None
    if local is None and declared is None:
        snapshot = _hub_snapshot(path, revision, getattr(model, "download_dir", None))
        if snapshot is not None:
            local, commit = str(snapshot), snapshot.name
    settings: dict[str, Any] = {
        key: getattr(model, key) for key in MODEL_SETTINGS if hasattr(model, key)
    }
    if "json_model_override_args" in settings:
        settings["json_model_override_args"] = _overrides(settings["json_model_override_args"])
    settings["quantization_param_path"] = _scales(getattr(model, "quantization_param_path", None))
    if declared is None:  # a declared identity is shared by engines whose paths differ
        settings["model_path"] = path
    return ModelInputs(
        name=name,
        declared=declared,
        local_path=local,
        revision=commit,
        dtype=getattr(model, "dtype", None),
        kv_cache_dtype=getattr(model, "kv_cache_dtype", None),
        quantization=getattr(model, "quantization", None),
        load_format=getattr(model, "load_format", None),
        settings=settings,
    )


def model_name(name: str, declared: str | None, model: Any = None) -> str:
    """The model's part of the namespace: :func:`identify` of SGLang's published model
    settings ``model`` (default: this process's, :func:`published_model`); without any,
    ``declared`` or ``name``, with a digest of a local model folder's files."""
    if model is None:
        model = published_model()
    if model is not None:
        return identify(model_inputs(model, name, declared))
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "kvtier: SGLang published no model settings in this process (a storage built "
            "outside an SGLang server), so pages of model %r are keyed by its name (and a "
            "local model folder's files) only, not by quantization, dtype, kv_cache_dtype "
            "or config overrides: give each configuration its own kvtier.model",
            declared or name,
        )
    if declared is not None:
        return declared
    if not Path(name).exists():
        return name
    try:
        return f"{name}#{weights_identity(name, what=f'model {name!r}')}"
    except (UnkeyableInputError, OSError) as exc:  # refused at start-up, with the fix
        raise UnsupportedCombinationError(
            f"kvtier cannot key the pages of model {name!r}: {exc}",
            value=name,
            supported=['"kvtier": {"model": "NAME"}, a name that changes with the weights'],
        ) from exc
