"""What the kit's child processes share: the job a test hands one, and the harness it opens.

The tests that need a second process (:mod:`~kvtier.testing.kit.shared_processes`,
:mod:`~kvtier.testing.kit.kill_mid_write`) start ``python -c "from ... import _child_...;
_child_...()"`` with a JSON job on stdin: the backend, its options, the plugins (by module
name, since the child imports them itself), the geometry, layout and model, so the child
builds the same backend over the same namespace through kvtier's one construction path.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_name
from kvtier.core.layout import Layout
from kvtier.testing.kit.harness import (
    Harness,
    KitEnv,
    default_geometry,
    load_kit_registry,
)

__all__ = ["child_job", "open_child", "read_job"]


def _module_name(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    pytest.fail(
        f"plugin {plugin!r} is not a module; the kit's multi-process tests load plugins in "
        "a child process, so list them in BackendKit.plugins as (name, module) pairs"
    )


def child_job(kit: KitEnv, h: Harness, **more: Any) -> dict[str, Any]:
    """The job that makes a child open what ``h`` is (same backend, options, namespace)."""
    g = h.geometry
    return {
        "backend": kit.spec.name,
        "config": kit.config,
        "plugins": [[name, _module_name(p)] for name, p in kit.plugins],
        "geometry": {
            "attention": g.attention.value,
            "num_layers": g.num_layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "dtype": dtype_name(g.dtype),
            "page_size": g.page_size,
        },
        "layout": h.layout.value,
        "model": kit.model,
        **more,
    }


def read_job() -> dict[str, Any]:
    """The child's side: its job, from stdin."""
    job: dict[str, Any] = json.loads(sys.stdin.read())
    return job


def open_child(job: dict[str, Any], *, num_pages: int = 16) -> tuple[KitEnv, Harness]:
    """The child's side: the backend the job names, behind a harness like the parent's."""
    plugins = [(name, importlib.import_module(module)) for name, module in job["plugins"]]
    registry = load_kit_registry(plugins)
    env = KitEnv(
        registry.backend(job["backend"]), job["config"], plugins, Path("."), registry.io_backends
    )
    env.model = job["model"]
    g = job["geometry"]
    geometry = KVGeometry(
        AttentionKind(g["attention"]),
        g["num_layers"],
        g["num_kv_heads"],
        g["head_dim"],
        g["dtype"],
        g["page_size"],
    )
    assert geometry == default_geometry(geometry.attention)
    h = env.open(attention=geometry.attention, layout=Layout(job["layout"]), num_pages=num_pages)
    return env, h
