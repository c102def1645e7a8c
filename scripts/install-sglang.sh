#!/usr/bin/env bash
# Install the SGLang release kvtier's SGLang integration is tested against, in two places:
#
# 1. kvtier's own environment ($PY): SGLang without its serving stack (CUDA kernels,
#    transformers, FlashInfer ...), plus the small modules that `import sglang` itself
#    needs, with a constraint that holds the torch scripts/install.sh put there. That is
#    what a user of the storage interface and the `dynamic` loader needs; checked at the
#    end in a fresh interpreter outside this checkout.
# 2. The SGLang test environment ($KVTIER_SGLANG_VENV, default .venv-sglang): the same
#    SGLang plus the torch it pins (torch==2.14.1, a CUDA build that runs on the CPU), the
#    torchvision built for that torch and the modules SGLang's KV classes import through
#    sglang.srt.configs (transformers, gguf, ...), so that SGLang's real host pools, device
#    pools, HiCacheController and StorageMetrics import and run on a machine without a GPU.
#    torchvision's PyPI wheels are CUDA builds that fail beside the CPU torch of (1)
#    ("operator torchvision::nms does not exist"); beside their own torch they load. Made
#    with --system-site-packages, like .venv-vllm: it sees (1)'s editable kvtier, liburing
#    and Mooncake, and its own torch shadows (1)'s. tests/test_sglang_env.py runs the SGLang
#    tests with its python; nothing else uses it.
#
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
VENV=$(realpath -m "${KVTIER_SGLANG_VENV:-.venv-sglang}")
# SGLang 0.5.23 pins torch==2.14.1; 0.29.1 is the torchvision release built for it.
SGLANG_TORCH=2.14.1
SGLANG_TORCHVISION=0.29.1
# What SGLang's KV modules (memory_pool, pool_host, cache_controller, the metrics
# collector) import at module level beyond `import sglang`, at the versions SGLang 0.5.23
# pins where it pins one. None of them is a CUDA kernel.
KV_DEPS=(
  "transformers==5.19.0"
  "tokenizers==0.23.2"
  "gguf==0.19.0"
  "apache-tvm-ffi==0.1.11"
  # SGLang pins 0.2.1, whose SWIG module can crash the interpreter as it exits (a capsule
  # destructor run after its type is gone: SIGSEGV after every test passed); 0.2.3 does not.
  # No KV code uses it: SGLang's config package imports it for tokenizers.
  "sentencepiece==0.2.3"
  "compressed-tensors==0.18.0"
  "prometheus-client>=0.20.0"
  "aiohttp>=3.9"
  "dill>=0.3.8"
)
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

# --- 2. the SGLang test environment ------------------------------------------------------
# torch 2.14.1 and torchvision 0.29.1 for CPython 3.11 on Linux x86_64 (SGLang's own wheel
# is x86_64 only).
if [ "$(uname -m)" != x86_64 ]; then
  echo "install-sglang.sh: SGLang's KV classes are tested on x86_64 only; $VENV skipped" \
       "(tests/test_sglang_env.py skips without it)" >&2
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
# git ignores the environment whatever the checkout's .gitignore says
echo '*' > "$VENV/.gitignore"
VPY="$VENV/bin/python"
# --system-site-packages reaches the base interpreter's packages only. When $PY is itself
# a virtual environment, a .pth line adds that environment's site directories (the
# editable kvtier, liburing, Mooncake, SGLang), after this environment's own.
parent_sites=$("$PY" -c 'import site, sys; print(repr([p for p in site.getsitepackages() if p.startswith(sys.prefix)]))')
"$VPY" - "$parent_sites" <<'PY'
import pathlib
import sys
import sysconfig

pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "_kvtier_parent_env.pth"
# one line, run by exec() in site.addpackage: a comprehension there cannot see ``site``
pth.write_text(f"import site; list(map(site.addsitedir, {sys.argv[1]}))\n")
PY

installed() {  # the version of a distribution installed in this environment itself
  "$VPY" - "$1" <<'PY'
import importlib.metadata as m
import sys

try:
    dist = m.distribution(sys.argv[1])
except m.PackageNotFoundError:
    raise SystemExit(0)
if str(dist.locate_file("")).startswith(sys.prefix):
    print(dist.version)
PY
}
if [ "$(installed torch)" != "$SGLANG_TORCH" ] || [ "$(installed torchvision)" != "$SGLANG_TORCHVISION" ]; then
  "$VPY" -m pip install -q "torch==$SGLANG_TORCH" "torchvision==$SGLANG_TORCHVISION"
fi
VCONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT" "$VCONSTRAINT"' EXIT
printf 'torch==%s\ntorchvision==%s\n' "$SGLANG_TORCH" "$SGLANG_TORCHVISION" > "$VCONSTRAINT"
"$VPY" -m pip install -q -c "$VCONSTRAINT" "${KV_DEPS[@]}"

# SGLang's real KV classes, imported as SGLang imports them, in a fresh interpreter.
(cd / && "$VPY" -W ignore - "$SGLANG_TORCH" <<'PY'
import sys

import torch
import torchvision.ops

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

import kvtier.integrations.sglang  # noqa: F401

assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
assert torchvision.ops.nms(boxes, torch.tensor([1.0, 0.5]), 0.5).tolist() == [0]
for cls in (HiCacheController, MHATokenToKVPool, MambaPoolHost, MHATokenToKVPoolHost,
            MLATokenToKVPoolHost, StorageMetrics):
    assert cls.__module__.startswith("sglang."), cls
print(f"install-sglang.sh: SGLang's KV classes import with torch {torch.__version__} in",
      end=" ")
PY
)
echo "$VENV"
