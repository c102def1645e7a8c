#!/usr/bin/env bash
# Download, into .gpu-wheels/, the CPython 3.12 manylinux x86_64 wheels that the lent GPU
# machine lacks, so that scripts/gpu-check.sh installs kvtier there with no network.
#
# That machine has Python 3.12, torch (CUDA), pluggy, pytest, numpy and xxhash, but no
# pydantic and no build backend. Fetched here: kvtier's runtime dependencies it lacks
# (pydantic and its own dependencies; pluggy and xxhash too, so the set is complete even
# where those are missing) and what builds kvtier from the tree offline (hatchling and
# its dependencies). torch is never fetched: the machine's CUDA build is the one to test.
#
#     bash scripts/fetch-gpu-wheels.sh            # then carry .gpu-wheels to the machine
#
# Env: GPU_WHEELS_DIR (default .gpu-wheels), GPU_PYTHON_VERSION (default 3.12).
set -euo pipefail

cd "$(dirname "$0")/.."
dest="${GPU_WHEELS_DIR:-.gpu-wheels}"
pyver="${GPU_PYTHON_VERSION:-3.12}"
abi="cp${pyver/./}"
mkdir -p "$dest"

# kvtier's [project] dependencies, less torch (the machine's own) and tomli (< 3.11 only),
# plus the [build-system] requirement; pip resolves their dependencies for the target.
requirements=(
  "pydantic>=2.5,<3"
  "pluggy>=1.3"
  "xxhash>=3.4"
  "hatchling>=1.21"
)

python3 -m pip download \
  --dest "$dest" \
  --only-binary=:all: \
  --python-version "$pyver" \
  --implementation cp \
  --abi "$abi" --abi abi3 --abi none \
  --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  --platform any \
  "${requirements[@]}"

# Every name the install needs must be there as a wheel (pip resolved them; say so).
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions \
  hatchling packaging pathspec pluggy trove_classifiers xxhash; do
  if ! compgen -G "$dest/${name}-*.whl" >/dev/null; then
    echo "fetch-gpu-wheels: no wheel of ${name} in $dest after the download" >&2
    exit 1
  fi
done
size=$(du -sm "$dest" | cut -f1)
if [ "$size" -ge 64 ]; then
  echo "fetch-gpu-wheels: $dest takes ${size} MiB, over the 64 MiB that can be carried" >&2
  exit 1
fi
ls -1 "$dest"
echo "fetch-gpu-wheels: ${size} MiB in $dest for CPython ${pyver}" >&2
