"""Sharing between processes (``Feature.SHARED_PROCESSES``): a child puts, we read.

:func:`_child_put` is the child's side; the test starts it with
``python -c "from kvtier.testing.kit.shared_processes import _child_put; _child_put()"``
and the job (:func:`~kvtier.testing.kit.children.child_job`) as JSON on stdin, so it must
stay importable from this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvtier.core.specs import Feature
from kvtier.testing.kit.children import child_job, open_child, read_job
from kvtier.testing.kit.harness import KitEnv, require_feature

__all__ = ["SharedProcessesTests"]


class SharedProcessesTests:
    """``shared_processes``: pages one process puts, another process finds and reads."""

    def test_kit_pages_from_another_process(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.SHARED_PROCESSES)
        h = kit.open()  # opened first: the child's pages are not in its start-up state
        keys = h.keys(3)
        job = child_job(kit, h, keys=keys, seed=15)
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
    job = read_job()
    env, h = open_child(job)
    pages = h.pool.allocate(len(job["keys"]))
    h.fill(pages, seed=job["seed"])
    results = h.store.put(job["keys"], pages)
    env.close_all()
    if results != [True] * len(pages):
        raise SystemExit(f"child put failed: {results}")
