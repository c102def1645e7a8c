#!/usr/bin/env bash
# Install the SGLang release kvtier's SGLang integration is tested against, without its
# serving stack (CUDA kernels, transformers, FlashInfer ...), plus the small modules that
# `import sglang` itself needs, then check, in a fresh interpreter outside this checkout,
# that `import kvtier.integrations.sglang` and SGLang's `dynamic` loader work.
#
# SGLang's own requirements pin a CUDA torch; this installs nothing that replaces the torch
# scripts/install.sh put here (a constraint holds it). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
# What `import sglang` (sglang/__init__.py -> sglang.srt.utils) and SGLang's storage
# modules import at module level, at the versions tested. None of them requires torch.
IMPORT_DEPS=(
  "orjson>=3.8"
  "msgspec==0.23.0"
  "psutil==7.2.2"
  "pybase64==1.5.1"
  "pyzmq==27.3.0"
  "starlette==1.10.0"
  "anyio==4.16.0"
  "tqdm==4.70.1"
  "triton==3.7.0"
  "ipython>=8.12"  # sglang/utils.py imports IPython.display
)

# That release ships wheels for CPython 3.11 and 3.12 only (Linux x86_64, glibc >= 2.34).
if ! "$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))'; then
  echo "install-sglang.sh: sglang $SGLANG_VERSION needs CPython 3.11 or 3.12; skipped" \
       "(tests/test_sglang.py skips without it)" >&2
  exit 0
fi

if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != "$SGLANG_VERSION" ]; then
  "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
fi

TORCH_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH_VERSION" > "$CONSTRAINT"
"$PY" -m pip install -q -c "$CONSTRAINT" "${IMPORT_DEPS[@]}"

# The import a user makes, in a fresh interpreter, away from this checkout's cwd.
(cd / && "$PY" - <<'PY'
import kvtier.integrations.sglang  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
PY
)
