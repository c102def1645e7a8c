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
from sglang_host_pool import CLASS_NAME, KV_MODULES, MODULE_PATH, VENV, sglang_storage_or_skip

from kvtier.testing import require

sglang_storage_or_skip()

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


def _fresh(
    code: str, *args: str, cwd: Path, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [python, "-I", "-c", code, *args],
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


# SGLang's KV classes, as the SGLang test environment imports them, and where from.
_KV_CLASSES = """
import inspect, json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import importlib, sglang, torch, torchvision.ops
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    found[name] = str(Path(inspect.getfile(module)).resolve())
found["sglang"] = str(Path(sglang.__file__).resolve().parent)
found["torch"] = torch.__version__
print(json.dumps(found))
"""


def test_sglangs_kv_classes_import_in_the_sglang_environment(tmp_path: Path) -> None:
    # scripts/install-sglang.sh made it: SGLang's pinned torch, the torchvision built for
    # it, and the modules its KV classes import; every module is the installed SGLang's
    python = VENV / "bin" / "python"
    require("sglang", None if python.exists() else f"no SGLang environment at {VENV}")
    result = _fresh(_KV_CLASSES, *KV_MODULES, cwd=tmp_path, python=str(python))
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found.pop("torch").split("+")[0] == "2.14.1"
    installed = Path(found.pop("sglang"))
    for name, path in found.items():
        assert Path(path).is_relative_to(installed), (name, path)
