#!/usr/bin/env bash
# Check kvtier's vLLM connector against a vLLM release that cannot be installed here (a
# CUDA build on a CPU machine): download its wheel, unpack its Python sources (no
# compiled code: only what kvtier imports is needed), and run scripts/check_vllm_api.py
# with the vLLM environment's python (scripts/install-vllm.sh) and that release first on
# the path. Exits non-zero when a kvtier module fails to import under the release or the
# connector disagrees with its KVConnectorBase_V1.
#   bash scripts/check-vllm-release.sh 0.33.0
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: check-vllm-release.sh VERSION}
VENV=${KVTIER_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  echo "check-vllm-release.sh: no vLLM environment at $VENV (run scripts/install-vllm.sh)" >&2
  exit 1
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "vllm==$VERSION" -d "$WORK/wheel"
"$VENV/bin/python" - "$WORK" <<'PY'
import pathlib
import sys
import zipfile

work = pathlib.Path(sys.argv[1])
(wheel,) = (work / "wheel").glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as archive:
    archive.extractall(work / "site", [n for n in archive.namelist() if n.endswith(".py")])
PY
PYTHONPATH="$WORK/site" "$VENV/bin/python" scripts/check_vllm_api.py
