"""The SGLang adapter imports as a user imports it: a fresh interpreter, outside this checkout.

``scripts/install-sglang.sh`` (run by ``scripts/install.sh``) installs SGLang without its
serving stack plus what ``import sglang`` needs; these tests prove that leaves the adapter
importable and SGLang's ``dynamic`` loader able to build it, with nothing from ``tests/``
on the path (the other SGLang tests import SGLang through the test directory's helpers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_host_pool import CLASS_NAME, MODULE_PATH, sglang_or_skip

sglang_or_skip()

# What a user runs after installing: SGLang's own loader builds kvtier's class by name.
_DYNAMIC = """
import json, sys
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
extra = json.loads(sys.argv[1])
config = HiCacheStorageConfig(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
    model_name="m", extra_config=extra,
)
storage = StorageBackendFactory.create_backend("dynamic", config, None)
print(type(storage).__module__, type(storage).__name__)
storage.close()
"""


def _fresh(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-I", "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_adapter_imports_in_a_fresh_interpreter(tmp_path: Path) -> None:
    result = _fresh(
        "import kvtier.integrations.sglang as m; print(m.KvtierHiCacheStorage)", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "KvtierHiCacheStorage" in result.stdout


def test_sglangs_dynamic_loader_builds_it_in_a_fresh_interpreter(tmp_path: Path) -> None:
    extra = {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "kvtier": {"backend": "memory"},
    }
    result = _fresh(_DYNAMIC, json.dumps(extra), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [f"{MODULE_PATH}.storage", CLASS_NAME]


@pytest.mark.parametrize("name", ["sglang", "sglang.srt.utils"])
def test_sglangs_own_packages_import(tmp_path: Path, name: str) -> None:
    # The adapter's import runs these __init__ files; a missing import-time module of
    # SGLang's (orjson, psutil, triton, ...) fails here with its name.
    result = _fresh(f"import {name}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
