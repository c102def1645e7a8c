#!/usr/bin/env bash
# Install kvtier and everything its tests and benchmarks need, from nothing.
# Safe to run again: each step is skipped or a no-op when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Mooncake's CPU wheel links libibverbs (needed even for TCP).
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "install.sh: libibverbs1 is missing; install it (apt-get install libibverbs1)" >&2
  fi
fi

# torch first: a bare 'torch' requirement would pull a multi-GB CUDA build. GPU users
# who already have their own torch keep it.
if ! "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi

"$PY" -m pip install -q -e ".[dev,uring,mooncake-cpu]"
"$PY" -m pip install -q -e examples/kvtier-example-backend
# SGLang's storage classes, without its serving stack, for the integration tests.
bash scripts/install-sglang.sh
# A real vLLM (CPU build) in its own virtual environment, for the vLLM connector's tests.
bash scripts/install-vllm.sh
