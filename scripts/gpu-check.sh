#!/usr/bin/env bash
# Prove kvtier's accelerator path on a lent GPU machine, offline, in about 6 minutes.
#
# Runs in the repository root of a copied tree that carries .gpu-wheels/ (made here by
# scripts/fetch-gpu-wheels.sh), and writes its results under $OUT:
#
#   1. install   kvtier from the tree, offline (wheels from .gpu-wheels, no build isolation;
#                the C extensions compile where a compiler exists, else pure Python);
#   2. env.txt   nvidia-smi, Python, torch, CUDA;
#   3. tests     pytest over the test files whose cases skip on a CPU for want of CUDA
#                (cuda-tests.xml, JUnit), counts in summary.json;
#   4. gpu-bench.jsonl    benchmarks/gpu.py: GB/s per IO backend and layout vs copy_;
#   5. engine-loop.jsonl  benchmarks/engine_loop.py: how much of the loading hides under
#                         compute, per IO backend;
#
# each bounded by `timeout`, so one hang does not lose the others. The script goes on past
# a failed step and exits non-zero at the end if any failed; summary.json lists each
# step's exit status and seconds, the test counts and the benchmarks' summary lines.
#
#   bash scripts/gpu-check.sh                                  # on the GPU machine
#   KVTIER_GPU_CHECK_DEVICE=cpu KVTIER_GPU_CHECK_SKIP_INSTALL=1 bash scripts/gpu-check.sh
#                                                              # a dry run on a CPU
#
# Env: OUT (default: a new temporary folder), KVTIER_GPU_CHECK_DEVICE (cuda; cpu runs
# small sizes), KVTIER_GPU_CHECK_SKIP_INSTALL=1 (use the environment as it is, the tree's
# kvtier first on the path), KVTIER_GPU_CHECK_BUDGET_S (seconds for all steps, 330),
# KVTIER_GPU_CHECK_WHEELS (.gpu-wheels), PYTHON (python3).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="${OUT:-$(mktemp -d -t kvtier-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
DEVICE="${KVTIER_GPU_CHECK_DEVICE:-cuda}"
BUDGET="${KVTIER_GPU_CHECK_BUDGET_S:-330}"
WHEELS="${KVTIER_GPU_CHECK_WHEELS:-.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
export KVTIER_DISABLE_PLUGIN_AUTOLOAD=1 # built-ins only: nothing else installed is tested
export PYTHONDONTWRITEBYTECODE=1
# the fallback's dependencies: outside $OUT, whose every file is sent back
SITE="$(mktemp -d -t kvtier-gpu-site.XXXXXX)"
STEPS="$OUT/steps.tsv"
: >"$STEPS"
FAILED=0
START=$SECONDS

log() { echo "gpu-check: $*" >&2; }

# Seconds left for a step: its share, never more than what the budget still holds
# (less a reserve for the steps after it), never less than 10.
allot() {
  local want=$1 reserve=${2:-0} left
  left=$((BUDGET - (SECONDS - START) - reserve))
  ((left < want)) && want=$left
  ((want < 10)) && want=10
  echo "$want"
}

# step NAME SECONDS CMD...: run CMD bounded by SECONDS; record its status; go on.
step() {
  local name=$1 limit=$2 rc t0=$SECONDS
  shift 2
  log "step $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$STEPS"
  if ((rc != 0)); then
    FAILED=1
    ((rc == 124 || rc == 137)) && log "step $name ran past ${limit}s" || log "step $name failed ($rc)"
  fi
  return 0
}

# --- 1. install -------------------------------------------------------------------------
IMPORT_FROM=tree
install_kvtier() {
  local bsp=() site="$SITE"
  if "$PYTHON" -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    bsp=(--break-system-packages) # a distribution's Python may refuse pip without it
  fi
  local pip=("$PYTHON" -m pip install --no-index --find-links "$WHEELS" --disable-pip-version-check)
  if [ ! -d "$WHEELS" ]; then
    echo "install: no $WHEELS here; run scripts/fetch-gpu-wheels.sh and carry it" >&2
    return 2
  fi
  # kvtier itself with --no-deps: its dependencies come from the first call, and torch
  # is the machine's own (resolving torch's dependencies offline would fail on any one of
  # them, setuptools included). The import check then proves the set complete.
  if "${pip[@]}" "${bsp[@]}" "pydantic>=2.5,<3" "hatchling>=1.21" "pluggy>=1.3" "xxhash>=3.4" &&
    "${pip[@]}" "${bsp[@]}" --no-build-isolation --no-deps "$ROOT" &&
    (cd / && "$PYTHON" -c "import kvtier, pydantic, pluggy, torch, xxhash; print(kvtier.__file__)"); then
    return 0
  fi
  # Fallback: dependencies into a folder of our own, kvtier (pure Python) from the tree.
  echo "install: pip could not install kvtier; using the tree with deps in $site" >&2
  if "${pip[@]}" --target "$site" "pydantic>=2.5,<3" "pluggy>=1.3" "xxhash>=3.4"; then
    return 1
  fi
  # No usable pip at all: a wheel is a zip of importable files; unpack them (last resort).
  echo "install: pip --target failed too; unpacking the wheels into $site" >&2
  "$PYTHON" - "$WHEELS" "$site" <<'UNPACK' || return 3
import sys, zipfile
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
    print("unpacked", wheel.name)
UNPACK
  return 1
}

if [ "${KVTIER_GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  log "install skipped (KVTIER_GPU_CHECK_SKIP_INSTALL=1): the tree's kvtier, this environment"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  t0=$SECONDS
  lim=$(allot 120 200)
  export -f install_kvtier
  export PYTHON WHEELS ROOT OUT SITE
  timeout --kill-after=10 "$lim" bash -c install_kvtier >"$OUT/install.log" 2>&1
  rc=$?
  printf 'install\t%s\t%s\t%s\n' "$rc" "$((SECONDS - t0))" "$lim" >>"$STEPS"
  if ((rc == 0)); then
    IMPORT_FROM=installed
  else
    FAILED=1
    log "install failed ($rc; see install.log): running the tree's kvtier"
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
# Tests import the installed kvtier (-P: the working directory is not put on the path).
PYFLAGS=""
[ "$IMPORT_FROM" = installed ] && PYFLAGS="-P"
PYTEST=("$PYTHON" $PYFLAGS -m pytest)

# --- 2. environment ---------------------------------------------------------------------
env_report() {
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "device asked: $DEVICE; kvtier imported from: $IMPORT_FROM"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PYTHON" $PYFLAGS - <<'EOF'
import platform, sys
import torch
print("python", sys.version.replace("\n", " "), platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", "cc", p.major, p.minor)
import kvtier, pydantic
print("kvtier", kvtier.__version__, kvtier.__file__)
print("pydantic", pydantic.VERSION)
from kvtier.core import compiled_envelope
print("compiled envelope available:", compiled_envelope.available())
EOF
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt" >&2
  if [ "$DEVICE" = cuda ]; then
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
      { echo "env: CUDA is not available to torch" >&2; return 1; }
  fi
}
export -f env_report
export DEVICE PYTHON OUT IMPORT_FROM PYFLAGS
step env "$(allot 60 180)" bash -c env_report

# --- 3. the tests that need CUDA (and their files' other tests) --------------------------
# The files named here, and any other whose tests check for CUDA (new ones included).
TESTS=()
for f in tests/test_io.py tests/test_host_pool.py tests/test_vllm_device_path.py \
  tests/test_vllm_connector.py tests/test_bounded_paths.py tests/test_bench_errors.py \
  tests/test_gpu_*.py $(grep -l "cuda.is_available" tests/test_*.py 2>/dev/null); do
  [ -f "$f" ] && [[ " ${TESTS[*]} " != *" $f "* ]] && TESTS+=("$f")
done
log "test files: ${TESTS[*]}"
step tests "$(allot 150 150)" "${PYTEST[@]}" -q -rs -p no:cacheprovider \
  --junitxml="$OUT/cuda-tests.xml" "${TESTS[@]}"

summarize() {
  "$PYTHON" - "$OUT" "$DEVICE" "$IMPORT_FROM" "$FAILED" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, device, imported, failed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
summary = {"device": device, "kvtier_from": imported, "steps": {}, "tests": None}
for row in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, limit = row.split("\t")
    summary["steps"][name] = {"rc": int(rc), "seconds": int(secs), "limit_s": int(limit)}
junit = out / "cuda-tests.xml"
if junit.exists():
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed_names, skipped = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed_names.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed_names.append(name)
        elif (s := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skipped.append(f"{name}: {s.get('message', '')}")
        else:
            counts["passed"] += 1
    summary["tests"] = {**counts, "not_passed": failed_names, "skipped_reasons": skipped}
for name in ("gpu-bench.jsonl", "engine-loop.jsonl"):
    path = out / name
    if path.exists():
        lines = []
        for text in path.read_text().splitlines():
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if record.get("case") == "summary":
                lines.append(record)
        summary[name] = lines
summary["ok"] = failed == "0"
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
t = summary["tests"] or {}
print(json.dumps({"summary": "tests", **{k: t.get(k) for k in ("passed", "failed", "errors", "skipped")}}))
EOF
}
summarize >&2 || FAILED=1

# --- 4. host <-> device transfer speed ----------------------------------------------------
BENCH=(--device "$DEVICE")
if [ "$DEVICE" = cpu ]; then BENCH+=(--quick); else BENCH+=(--pages 256 --reps 7); fi
step gpu-bench "$(allot 120 70)" "$PYTHON" benchmarks/gpu.py "${BENCH[@]}" \
  >"$OUT/gpu-bench.jsonl" 2>"$OUT/gpu-bench.log"

# --- 5. the engine-like loop: loads hidden under compute ----------------------------------
LOOP=(--device "$DEVICE")
[ "$DEVICE" = cpu ] && LOOP+=(--quick)
: >"$OUT/engine-loop.jsonl"
for io in kernel direct; do
  step "engine-loop-$io" "$(allot 60 0)" "$PYTHON" benchmarks/engine_loop.py "${LOOP[@]}" \
    --io-backend "$io" >>"$OUT/engine-loop.jsonl" 2>>"$OUT/engine-loop.log"
done

summarize >&2 || FAILED=1
log "results in $OUT ($((SECONDS - START))s): $(ls "$OUT" | tr '\n' ' ')"
for f in gpu-bench.jsonl engine-loop.jsonl; do
  grep '"case": "summary"' "$OUT/$f" >&2 || log "$f: no summary line"
done
if ((FAILED)); then
  log "FAILED: $(awk -F'\t' '$2 != 0 {print $1 "=" $2}' "$STEPS" | tr '\n' ' ')"
  exit 1
fi
log "all steps passed"
exit 0
