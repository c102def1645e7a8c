#!/usr/bin/env bash
# Install the SGLang release kvtier's SGLang integration is tested against, without its
# serving stack (CUDA kernels, triton, transformers, FlashInfer ...), then check that the
# two SGLang modules the tests use import on this machine.
#
# The tests import sglang.srt.mem_cache.hicache_storage and
# sglang.srt.mem_cache.storage.backend_factory; their only dependency is torch, which
# scripts/install.sh installs first. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23

# That release ships wheels for CPython 3.11 and 3.12 only (Linux x86_64, glibc >= 2.34).
if ! "$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))'; then
  echo "install-sglang.sh: sglang $SGLANG_VERSION needs CPython 3.11 or 3.12; skipped" \
       "(tests/test_sglang.py skips without it)" >&2
  exit 0
fi

if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != "$SGLANG_VERSION" ]; then
  "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
fi

"$PY" - <<'PY'
import sys

sys.path.insert(0, "tests")
import sglang_host_pool

sglang_host_pool.load_sglang()
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
PY
