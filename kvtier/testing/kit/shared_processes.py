"""Sharing between processes (``Feature.SHARED_PROCESSES``): a child puts, we read.

:func:`_child_put` is the child's side; the test starts it with
``python -c "from kvtier.testing.kit.shared_processes import _child_put; _child_put()"``
and the job as JSON on stdin, so it must stay importable from this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_name
from kvtier.core.layout import Layout
from kvtier.core.specs import Feature
from kvtier.testing.kit.harness import KitEnv, default_geometry, load_kit_registry, require_feature

__all__ = ["SharedProcessesTests"]


def _module_name(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    pytest.fail(
        f"plugin {plugin!r} is not a module; the shared-processes test loads plugins in a "
        "child process, so list them in BackendKit.plugins as (name, module) pairs"
    )


class SharedProcessesTests:
    """``shared_processes``: pages one process puts, another process finds and reads."""

    def test_kit_pages_from_another_process(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.SHARED_PROCESSES)
        h = kit.open()  # opened first: the child's pages are not in its start-up state
        attention = h.geometry.attention
        keys = h.keys(3)
        job = {
            "backend": kit.spec.name,
            "config": kit.config,
            "plugins": [[name, _module_name(p)] for name, p in kit.plugins],
            "geometry": {
                "attention": attention.value,
                "num_layers": h.geometry.num_layers,
                "num_kv_heads": h.geometry.num_kv_heads,
                "head_dim": h.geometry.head_dim,
                "dtype": dtype_name(h.geometry.dtype),
                "page_size": h.geometry.page_size,
            },
            "layout": h.layout.value,
            "model": kit.model,
            "keys": keys,
            "seed": 15,
        }
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "from kvtier.testing.kit.shared_processes import _child_put; _child_put()",
            ],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        assert done.returncode == 0, f"child process failed:\n{done.stdout}\n{done.stderr}"
        pages = h.pool.allocate(3)
        h.fill(pages, seed=15)
        expected = h.payloads(pages)
        h.scribble(pages)
        assert h.store.exists(keys) == [True] * 3
        assert h.store.get(keys, pages) == [True] * 3
        assert h.payloads(pages) == expected


def _child_put() -> None:
    """Child side of :class:`SharedProcessesTests`: build the backend, put seeded pages."""
    import importlib

    job = json.loads(sys.stdin.read())
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
    h = env.open(attention=geometry.attention, layout=Layout(job["layout"]))
    pages = h.pool.allocate(len(job["keys"]))
    h.fill(pages, seed=job["seed"])
    results = h.store.put(job["keys"], pages)
    env.close_all()
    if results != [True] * len(pages):
        raise SystemExit(f"child put failed: {results}")
