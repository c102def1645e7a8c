"""kvtier's vLLM connector against the KV-connector API of the vLLM it runs with.

``scripts/check_vllm_api.py`` imports every module of the integration under the vLLM
environment's release and compares ``KvtierConnector`` with its ``KVConnectorBase_V1``;
this runs it (``scripts/check-vllm-release.sh`` runs it against a release that cannot be
installed here, in CI against the newest one).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from test_vllm import ROOT, _vllm_python

CHECK = ROOT / "scripts" / "check_vllm_api.py"


def test_the_connector_matches_the_installed_vllm() -> None:
    python = _vllm_python()
    proc = subprocess.run(
        [str(python), str(CHECK)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    report = json.loads(proc.stdout)
    assert report["problems"] == [], report["problems"]
    assert proc.returncode == 0
    # what it checks is what vLLM calls: the methods the scheduler and worker use
    assert {"get_num_new_matched_tokens", "start_load_kv", "save_kv_layer"} <= set(
        report["methods_checked"]
    )
    assert report["modules"] >= 10


def test_the_check_finds_a_connector_that_disagrees(tmp_path: Path) -> None:
    python = _vllm_python()
    # a connector whose load takes a parameter vLLM never passes, and one it renamed
    shim = tmp_path / "sitecustomize.py"
    shim.write_text(
        "import kvtier.integrations.vllm.connector as c\n"
        "def start_load_kv(self, forward_context, *, required, **kwargs): pass\n"
        "def wait_for_layer_load(self, name): pass\n"
        "c.KvtierConnector.start_load_kv = start_load_kv\n"
        "c.KvtierConnector.wait_for_layer_load = wait_for_layer_load\n"
    )
    proc = subprocess.run(
        [
            str(python),
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "import sitecustomize, runpy; "
            f"runpy.run_path({str(CHECK)!r}, run_name='__main__')",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    problems = json.loads(proc.stdout)["problems"]
    assert any(p.startswith("start_load_kv: kvtier requires") for p in problems), problems
    assert any(p.startswith("wait_for_layer_load: vLLM passes") for p in problems), problems


def test_the_connector_refuses_sleep_mode() -> None:
    python = _vllm_python()
    code = (
        "from kvtier.integrations.vllm.connector import KvtierConnector as C; "
        "print(C.supports_sleep_mode(None))"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-2000:]
