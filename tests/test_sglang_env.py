"""The SGLang tests, run with the SGLang test environment's python.

SGLang's KV classes (host and device pools, ``HiCacheController``, ``StorageMetrics``) import
``torchvision`` through ``sglang.srt.configs``; torchvision loads beside its own torch build,
not beside kvtier's CPU torch. ``scripts/install-sglang.sh`` makes the SGLang test
environment (``.venv-sglang``, or ``$KVTIER_SGLANG_VENV``: SGLang's pinned torch 2.14.1, a
CUDA build that runs on the CPU, with torchvision 0.29.1). In kvtier's own environment the
tests that need those classes skip (``sglang_host_pool.sglang_or_skip``) and this module
runs them there: every test of the ``test_sglang*`` modules and the SGLang tests of the
shared modules (``-k sglang``). Inside that environment it has nothing to do.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from sglang_host_pool import ROOT, VENV, in_sglang_env, sglang_storage_or_skip

from kvtier.testing import require

sglang_storage_or_skip()

#: The modules whose SGLang tests run in the SGLang environment.
MODULES = (
    "tests/test_sglang.py",
    "tests/test_sglang_v2.py",
    "tests/test_sglang_zero_copy.py",
    "tests/test_sglang_tiers.py",
    "tests/test_sglang_keys.py",
    "tests/test_sglang_late_calls.py",
    "tests/test_bounded_paths.py",
    "tests/test_metrics.py",
)


def test_the_sglang_tests_pass_in_the_sglang_environment() -> None:
    if in_sglang_env():
        pytest.skip("this is the SGLang environment: the SGLang tests run in this session")
    python = VENV / "bin" / "python"
    require(
        "sglang",
        None if python.exists() else f"no SGLang environment at {VENV} (scripts/install-sglang.sh)",
    )
    # the environment exists to run them: a test that skips for want of SGLang fails there
    env = {**os.environ, "KVTIER_REQUIRE_SGLANG": "1"}
    env.pop("PYTHONPATH", None)
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    result = subprocess.run(
        [*command, *MODULES, "-k", "sglang"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    output = result.stdout + result.stderr
    print(output[-4000:])
    assert result.returncode == 0, output[-12000:]
    # pytest's summary is its last line on stdout (SGLang's publisher may still log to
    # stderr at exit: its atexit shutdown runs after kvtier already shut it down)
    summary = re.search(r"(\d+) passed", result.stdout.strip().splitlines()[-1])
    assert summary and int(summary.group(1)) > 100, output[-2000:]
