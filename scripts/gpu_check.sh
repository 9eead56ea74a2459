#!/usr/bin/env bash
# The GPU check: everything a GPU run must prove, in one command, under 6 minutes (docs/gpu.md).
#
#   scripts/gpu_check.sh --prepare [--no-reference]   on the CPU machine (needs the package registry).
#       scripts/gpu_kit.py derives the package sets from pyproject.toml (runtime deps, the test extra) and
#       scripts/gpu_image_packages.txt (what the GPU image holds): what the image lacks, or holds at an
#       incompatible version, travels as wheels in .gpu_check/wheels (with their own dependencies, less what
#       the image has); what the image holds goes to .gpu_check/machine-wheels, for the dry run only. Fails
#       when a requirement is neither carried nor on the image, or when what travels passes 64 MiB with the
#       tree; prints what travels and its size. Then the seeded models' float32 CPU reference logits go to
#       .gpu_check/reference (a few minutes; --no-reference skips them). Carry .gpu_check/wheels and
#       .gpu_check/reference to the GPU machine (.gpu_check is ignored by git).
#   scripts/gpu_check.sh --dry-run [--no-reference]   on the CPU machine: plays the image as it is. A Python
#       3.12 *venv* holding the image's packages (.gpu_check/machine-wheels) stands for the image's python3
#       (/opt/torch/.venv/bin/python3, a venv), and the real run below runs with it, unchanged, until its GPU
#       preflight stops it with exit 2; its gpu_results.json must show the install, every requirement met,
#       every pagedserve module imported and the GPU tests collected. Then (unless --no-reference) the seeded
#       references are recomputed with the image's numpy and compared, and the CPU tests of the GPU path run.
#   scripts/gpu_check.sh             on the GPU machine: the real run.
#       1. installs every carried wheel (--no-index --no-deps --target) into a folder placed first on
#          PYTHONPATH, so a carried package (a newer grpcio, protobuf) shadows the image's; no venv;
#       2. checks every requirement against what this python imports, that the carried packages win,
#          imports every pagedserve module (the first missing module is named), collects every GPU test;
#       3. preflight with the machine's CuPy: a device, NVRTC, cuBLAS, cuRAND (exit 2 / 4);
#       4. runs every GPU test (tests/cupy_kernels -m gpu), 60 s per test (pytest-timeout), 260 s in all;
#          a GPU test that SKIPS fails the run; the full log and JUnit file go to $OUT;
#       5. scripts/gpu_gemm_probe.py (right after the preflight: which cuBLAS route a graph captures), then
#          bench/gpu_throughput.py (the whole engine, Llama-3.1-8B shape), bench/gpu_attention.py,
#          bench/gpu_decode.py, bench/gpu_sampler.py: their stdout must parse as JSON;
#       6. tensor parallelism over NCCL (tests/cupy_kernels/test_nccl.py): single rank on one GPU, TP=2 on two;
#       7. $OUT/gpu_results.json names every failed, errored, skipped or unfinished test with its message.
#       Files in $OUT: gpu_results.json, gpu_tests.log, gpu_tests.xml, gpu_bench.log, gpu_check.log.
#
# Exit status: 0 all good; 1 a test or benchmark failed, or GPU tests skipped; 2 no usable GPU;
# 3 a requirement unmet, a carried package shadowed, or a pagedserve module not importable; 4 NVRTC, cuBLAS
# or cuRAND failed; 5 --prepare / --dry-run failed.
# Environment: PYTHON (the real run's interpreter, default python3), PYTHON312 (--dry-run's), OUT (default
# .gpu_check/out), GPU_CHECK_DIR (default .gpu_check), GPU_CHECK_SITE (where the real run installs; default
# a temporary folder).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="$ROOT/scripts/gpu_kit.py"
CHECK_DIR="${GPU_CHECK_DIR:-$ROOT/.gpu_check}"
WHEELS="$CHECK_DIR/wheels"
MACHINE_WHEELS="$CHECK_DIR/machine-wheels"
REFERENCE="$CHECK_DIR/reference"
OUT_DIR="${OUT:-$CHECK_DIR/out}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
LOGFILE=""
log() {
  echo "gpu_check: $*" >&2
  if [ -n "$LOGFILE" ]; then echo "gpu_check: $*" >> "$LOGFILE"; fi
}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Time budget of the real run, from the first GPU run (2026-12-04, H200): 66 of 68 GPU tests took 140 s,
# the other two (the seeded 8B and 7B shapes) 30 + 16 s, so the suite needs ~190 s; its slowest test took
# 30 s. Each test gets 60 s, the suite 260 s (one hung test still leaves room for the rest), the
# benchmarks took ~20 s together. Every step is also cut to what is left of BUDGET_S, so the whole check
# stays under 6 minutes even when a step hangs.
BUDGET_S=350
TESTS_S=260
PER_TEST_S=60
ATTENTION_S=45
ATTENTION_PREFILL_S=60  # tensor-core prefill vs paged, 2k-8k x head dims 64/128/256 x bf16/fp16 (NVRTC cold: larger modules)
DECODE_S=75
SAMPLER_S=30
GEMM_PROBE_S=20    # one small capture per cuBLAS route, ~10 s with CuPy's start (not yet run on a device)
THROUGHPUT_S=75    # 32 layers: build, graphs, 256 x (128 + 128) and one 32 -> 128 stream; ~40 s expected
TP_S=40
RESULTS_RESERVE_S=10

host_python() {  # the CPU machine's python with pagedserve installed (the repository venv), else python3
  if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi
}

find_python312() {
  local c
  for c in "${PYTHON312:-}" "$(command -v python3.12 2>/dev/null)"; do
    if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then echo "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
      if [ -x "$(pyenv root)/versions/$c/bin/python3.12" ]; then echo "$(pyenv root)/versions/$c/bin/python3.12"; return 0; fi
    done
  fi
  if command -v uv >/dev/null 2>&1 && c="$(uv python find 3.12 2>/dev/null)" && [ -n "$c" ]; then echo "$c"; return 0; fi
  return 1
}

# THE install step of the real run (the dry run runs it too, unchanged): every carried wheel, offline and
# without dependency resolution, into a folder that goes first on PYTHONPATH. No venv: the image's python3
# is a venv itself, and a venv made from it would see the base interpreter's packages, not the image's.
install_carried() {  # $1: python, $2: target folder
  PIP_CONFIG_FILE=/dev/null "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$2" "$WHEELS"/*.whl
}

REFERENCE_TOO=1
MODE="${1:-}"
if [ -n "${2:-}" ]; then
  if [ "$2" = "--no-reference" ] && { [ "$MODE" = "--prepare" ] || [ "$MODE" = "--dry-run" ]; }; then REFERENCE_TOO=0
  else log "unknown argument $2 (only --prepare and --dry-run take --no-reference)"; exit 5; fi
fi

# ---------------------------------------------------------------------------------------------------
if [ "$MODE" = "--python312" ]; then  # which Python 3.12 the dry run would use (scripts/ci_gpu_kit.sh asks)
  find_python312 || exit 1
  exit 0
fi

if [ "$MODE" = "--prepare" ]; then
  HOST_PY="$(host_python)"
  mkdir -p "$CHECK_DIR"
  "$HOST_PY" "$KIT" prepare --check-dir "$CHECK_DIR" || { log "--prepare failed (above)"; exit 5; }
  if [ "$REFERENCE_TOO" = 1 ]; then
    log "computing the seeded models' float32 CPU reference into $REFERENCE (a few minutes on 2 cores)"
    mkdir -p "$REFERENCE"
    if ! "$HOST_PY" "$ROOT/tests/cupy_kernels/seeded_models.py" --write "$REFERENCE"; then
      log "reference computation failed"; exit 5
    fi
  else
    log "--no-reference: .gpu_check/reference left as it is"
  fi
  "$HOST_PY" "$KIT" size --check-dir "$CHECK_DIR" || exit 5
  log "prepared in $((SECONDS - START)) s; carry .gpu_check/wheels and .gpu_check/reference"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------
if [ "$MODE" = "--dry-run" ]; then
  for d in "$WHEELS" "$MACHINE_WHEELS"; do
    [ -d "$d" ] || { log "$d is missing: run scripts/gpu_check.sh --prepare first"; exit 5; }
  done
  if [ "$REFERENCE_TOO" = 1 ] && [ ! -d "$REFERENCE" ]; then
    log "$REFERENCE is missing: run scripts/gpu_check.sh --prepare first (or --dry-run --no-reference)"; exit 5
  fi
  if ! PY312="$(find_python312)"; then
    log "no Python 3.12 here (looked at \$PYTHON312, python3.12, pyenv, uv): the image runs 3.12 and the wheels" \
        "are cp312, so the dry run cannot play it; install one (pyenv install 3.12) or set PYTHON312"
    exit 5
  fi
  DRY="$WORK/dry"
  mkdir -p "$DRY"
  steps=()
  run_step() {  # name, command...
    local name="$1"; shift
    local t0=$SECONDS
    if "$@" > "$DRY/$name.log" 2>&1; then steps+=("$name:ok"); log "$name: ok ($((SECONDS - t0)) s)"
    else steps+=("$name:FAILED"); log "$name: FAILED ($((SECONDS - t0)) s)"; tail -n 25 "$DRY/$name.log" >&2; fi
  }
  # The image's python3: a venv (as /opt/torch/.venv is) holding exactly the image's packages.
  log "the image's python3 is played by a venv from $PY312 ($("$PY312" --version 2>&1); the image runs 3.12.3)"
  "$PY312" -m venv "$DRY/image" || { log "venv creation failed"; exit 5; }
  IMAGE_PY="$DRY/image/bin/python3"
  run_step image_packages env PIP_CONFIG_FILE=/dev/null "$IMAGE_PY" -m pip install -q --no-index --no-deps --no-compile \
      "$MACHINE_WHEELS"/*.whl
  # The real run, unchanged, with that python3: it must get to its GPU preflight and stop there (exit 2).
  N_CARRIED="$(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l)"
  t0=$SECONDS
  GPU_CHECK_SITE="$DRY/site" PYTHON="$IMAGE_PY" OUT="$DRY/real" bash "$ROOT/scripts/gpu_check.sh" > "$DRY/real_run.log" 2>&1
  REAL_RC=$?
  if "$IMAGE_PY" "$KIT" dry-verify --results "$DRY/real/gpu_results.json" --expect-carried "$N_CARRIED" 2> "$DRY/verify.log"; then
    steps+=("real_run_until_the_gpu:ok"); log "real run until the GPU: ok ($((SECONDS - t0)) s)"; cat "$DRY/verify.log" >&2
  else
    steps+=("real_run_until_the_gpu:FAILED")
    log "real run until the GPU: FAILED (exit $REAL_RC; expected 2 after install, imports and collection)"
    grep -v "is ignored" "$DRY/real_run.log" | tail -n 30 >&2; cat "$DRY/verify.log" >&2
  fi
  if [ "$REFERENCE_TOO" = 1 ]; then
    # The CPU half with the real run's environment: the image's packages, the carried ones first.
    export PYTHONPATH="$DRY/site/carried:$DRY/site/src"
    run_step seeded_reference "$IMAGE_PY" "$ROOT/tests/cupy_kernels/seeded_models.py" --check "$REFERENCE"
    run_step cpu_tests bash -c "cd '$ROOT' && '$IMAGE_PY' -m pytest -q -p no:cacheprovider -m 'not gpu' \
      tests/cupy_kernels/test_kernel_cache.py tests/cupy_kernels/test_seeded_models.py tests/runtime/test_sampling_device.py \
      tests/runtime/test_cuda_graphs.py tests/models/test_activation_check.py"
    unset PYTHONPATH
  fi
  mkdir -p "$OUT_DIR"
  cp "$DRY/real/gpu_results.json" "$OUT_DIR/gpu_dry_run_real.json" 2>/dev/null
  "$IMAGE_PY" - "$OUT_DIR/gpu_dry_run.json" "$PY312" "$((SECONDS - START))" "$DRY" "$REAL_RC" "${steps[@]}" <<'EOF'
import json, platform, sys
from pathlib import Path
out, py, seconds, work, real_rc, *steps = sys.argv[1:]
steps = dict(s.split(":", 1) for s in steps)
logs = {name: [line for line in (Path(work) / f"{name}.log").read_text(errors="replace").splitlines()
               if "is ignored" not in line][-8:]
        for name in steps if (Path(work) / f"{name}.log").exists()}
result = {"python": py, "python_version": platform.python_version(), "seconds": int(seconds),
          "real_run_exit_code": int(real_rc), "steps": steps, "log_tails": logs,
          "real_run_results": "gpu_dry_run_real.json"}
open(out, "w").write(json.dumps(result, indent=2) + "\n")
print(f"gpu_check: wrote {out}", file=sys.stderr)
EOF
  case " ${steps[*]} " in *FAILED*) log "dry run FAILED after $((SECONDS - START)) s"; exit 5;; esac
  log "dry run passed in $((SECONDS - START)) s"
  exit 0
fi

if [ -n "$MODE" ]; then
  log "unknown argument $MODE (use --prepare, --dry-run, or nothing on the GPU machine)"; exit 5
fi

# ===================================== the real run ==================================================
mkdir -p "$OUT_DIR"
LOGFILE="$OUT_DIR/gpu_check.log"
: > "$LOGFILE"
rm -f "$OUT_DIR/gpu_results.json" "$OUT_DIR/gpu_tests.log" "$OUT_DIR/gpu_tests.xml" "$OUT_DIR/gpu_bench.log"
record() {  # step name, exit status, start second[, note]
  echo "$1 $2 $((SECONDS - $3))${4:+ $4}" >> "$WORK/steps.txt"
}
left() {  # seconds this step may take: its own cap, cut to what is left of BUDGET_S
  local want=$1 reserve=${2:-$RESULTS_RESERVE_S}
  local rest=$((BUDGET_S - (SECONDS - START) - reserve))
  if [ "$rest" -lt "$want" ]; then want=$rest; fi
  echo "$want"
}
write_results() {
  local meta
  meta="$(printf '{"python": "%s", "seconds": %d, "budget_s": %d, "tests_budget_s": %s, "per_test_timeout_s": %s, "gpus": %s, "tp_status": "%s", "commit": "%s"}' \
    "$PY" "$((SECONDS - START))" "$BUDGET_S" "${TESTS_CAP:-null}" "${PER_TEST:-null}" "${NGPU:-null}" "${TP_STATUS:-}" \
    "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)")"
  "$PY" "$KIT" results --work "$WORK" --out-dir "$OUT_DIR" --meta "$meta" 2> "$WORK/results.log"
  local rc=$?
  sed 's/^gpu_kit: /gpu_check: /' "$WORK/results.log" | tee -a "$LOGFILE" >&2
  return $rc
}

PY="${PYTHON:-$(command -v python3 || true)}"
if [ -z "$PY" ]; then log "no python3 found"; exit 2; fi
log "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "not a venv")' 2>&1))"

# -- 1. the carried wheels, first on PYTHONPATH --------------------------------------------------------------
SITE="${GPU_CHECK_SITE:-$WORK/site}"
t0=$SECONDS
rm -rf "$SITE/carried" "$SITE/src"
mkdir -p "$SITE/carried" "$SITE/src"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  install_carried "$PY" "$SITE/carried" > "$WORK/install.log" 2>&1
  rc=$?
  (cd "$WHEELS" && ls -1 *.whl) > "$WORK/carried.txt"
  record install "$rc" "$t0"
  if [ "$rc" -eq 0 ]; then log "installed $(wc -l < "$WORK/carried.txt") carried wheels --no-deps into $SITE/carried ($((SECONDS - t0)) s)"
  else log "installing the carried wheels from $WHEELS FAILED: $(grep -v 'is ignored' "$WORK/install.log" | tail -n 3)"; fi
else
  record install 0 "$t0" "nothing carried"
  log "nothing carried ($WHEELS holds no wheel): the image's packages alone"
fi
"$PY" "$KIT" link-source --dest "$SITE/src" > "$WORK/link.log" 2>&1 || log "linking the checkout failed: $(cat "$WORK/link.log")"
export PYTHONPATH="$SITE/carried:$SITE/src${PYTHONPATH:+:$PYTHONPATH}"

# -- 2. requirements, carried packages first, every pagedserve module, every GPU test collected -----------------
t0=$SECONDS
(cd "$WORK" && "$PY" "$KIT" check-env --site "$SITE/carried" --out "$WORK/environment.json") > "$WORK/environment.log" 2>&1
rc=$?
record environment "$rc" "$t0"
grep "^gpu_kit:" "$WORK/environment.log" | sed 's/^gpu_kit: //' | while IFS= read -r line; do log "$line"; done
# pytest's options for the GPU tests, the same for this collection as for the run (step 4), so that the
# dry run proves them: the record plugin, and a per-test timeout where pytest-timeout is (it is on the image).
PYTEST_COMMON=(-p no:cacheprovider -p gpu_pytest_record)
PER_TEST=null
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PER_TEST=$PER_TEST_S
  PYTEST_COMMON+=("--timeout=$PER_TEST_S" --timeout-method=signal)  # no -p: its entry point loads it
else
  log "warning: pytest-timeout is not importable: no per-test timeout, only the suite's"
fi
t0=$SECONDS
(cd "$ROOT" && GPU_TEST_RECORD="$WORK/collect.jsonl" PYTHONPATH="$ROOT/scripts:$PYTHONPATH" \
  "$PY" -m pytest tests/cupy_kernels -m gpu "${PYTEST_COMMON[@]}" --collect-only -q) > "$WORK/collect.log" 2>&1
rc=$?
record collect "$rc" "$t0"
log "GPU tests collected: $(tail -n 1 "$WORK/collect.log") (exit $rc, $((SECONDS - t0)) s)"

# -- 3. interpreter with CuPy, a device, and CUDA's libraries ---------------------------------------------
t0=$SECONDS
"$PY" - "$WORK/preflight.json" > "$WORK/preflight.log" 2>&1 <<'EOF'
import json, sys
out = {}
def save():
    open(sys.argv[1], "w").write(json.dumps(out, indent=1))
try:
    import numpy, cupy
    out["cupy"], out["numpy"] = cupy.__version__, numpy.__version__
    n = cupy.cuda.runtime.getDeviceCount()
    if n < 1:
        raise RuntimeError("CuPy sees no CUDA device")
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    out["device"] = (f"{name} (cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
                     f"driver {cupy.cuda.runtime.driverGetVersion()}, sm_{cupy.cuda.Device().compute_capability})")
except Exception as e:
    out["no_gpu"] = f"{type(e).__name__}: {e}"
    save(); print(out["no_gpu"]); sys.exit(2)
failed = []
def check(lib, fn):
    try:
        out[lib] = fn()
    except Exception as e:
        out[lib] = f"FAILED: {type(e).__name__}: {e}"
        failed.append(lib)
def nvrtc():
    k = cupy.RawKernel(r'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }', "twice")
    x = cupy.arange(32, dtype=cupy.float32)
    k((1,), (32,), (x,))
    assert (x.get() == 2 * numpy.arange(32)).all(), "wrong result"
    from cupy_backends.cuda.libs import nvrtc as lib
    return "ok, NVRTC " + ".".join(map(str, lib.getVersion()))
def cublas():
    a = cupy.asarray(numpy.random.default_rng(0).standard_normal((256, 256)).astype(numpy.float16))
    ref = a.get().astype(numpy.float64) @ a.get().astype(numpy.float64)
    got = (a @ a).get().astype(numpy.float64)
    assert abs(got - ref).max() <= 0.02 * abs(ref).max(), "float16 GEMM far off"
    return "ok"
def curand():
    x = cupy.random.rand(1 << 16, dtype=cupy.float32)
    assert 0.45 < float(x.mean()) < 0.55, "not uniform"
    return "ok"
check("nvrtc", nvrtc)
check("cublas", cublas)
check("curand", curand)
save()
print(json.dumps(out))
sys.exit(4 if failed else 0)
EOF
PRE_RC=$?
record preflight "$PRE_RC" "$t0"
if [ "$PRE_RC" -eq 2 ]; then
  log "no usable GPU with $PY: $(tail -n 1 "$WORK/preflight.log")"
  write_results
  exit $?
fi
if [ "$PRE_RC" -ne 0 ]; then
  log "CUDA libraries did not all load: $(tail -n 1 "$WORK/preflight.log")"
  write_results
  exit $?
fi
log "device: $("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('device', '?'))" "$WORK/preflight.json" 2>/dev/null)"

# -- 3b. which cuBLAS route a stream capture records (the GEMMs of every decode graph): before the tests, so
# their graph results can be read against it. Like the benchmarks (step 5): stdout must be one JSON object.
run_bench() {  # name, cap seconds, script, args...
  local name=$1 cap t0=$SECONDS
  cap="$(left "$2")"; shift 2
  if [ "$cap" -lt 5 ]; then log "bench $name: not run, the time budget ran out"; return; fi
  (cd "$WORK" && timeout -k 5 "$cap" "$PY" "$@") > "$WORK/bench_$name.out" 2> "$WORK/bench_$name.err"
  local rc=$?
  echo "$rc" > "$WORK/bench_$name.rc"
  record "bench_$name" "$rc" "$t0"
  { echo "=== $* (exit $rc, $((SECONDS - t0)) s) ==="; cat "$WORK/bench_$name.err"; } >> "$OUT_DIR/gpu_bench.log"
  log "bench $name: exit $rc ($((SECONDS - t0)) s)"
}
run_bench gemm_probe "$GEMM_PROBE_S" "$ROOT/scripts/gpu_gemm_probe.py"

# -- 4. GPU tests ------------------------------------------------------------------------------------------
export PAGEDSERVE_GPU_ERRORS="$WORK/errors.jsonl" PAGEDSERVE_GPU_REFERENCE="$REFERENCE"
export PAGEDSERVE_CACHE_DIR="$WORK/cache"  # the kernel cache: compiled once, shared by tests and benchmarks
: > "$PAGEDSERVE_GPU_ERRORS"
TESTS_CAP="$(left "$TESTS_S" 40)"
if [ "$TESTS_CAP" -lt 5 ]; then TESTS_CAP=5; fi
log "GPU tests: ${TESTS_CAP} s for the suite, ${PER_TEST} s per test; log: $OUT_DIR/gpu_tests.log"
t0=$SECONDS
(cd "$ROOT" && GPU_TEST_RECORD="$WORK/tests.jsonl" PYTHONPATH="$ROOT/scripts:$PYTHONPATH" \
  timeout -k 15 "$TESTS_CAP" "$PY" -m pytest tests/cupy_kernels -m gpu "${PYTEST_COMMON[@]}" -v -rfEs --durations=30 \
    --ignore=tests/cupy_kernels/test_nccl.py --junitxml="$OUT_DIR/gpu_tests.xml") > "$OUT_DIR/gpu_tests.log" 2>&1
TESTS_RC=$?
record tests "$TESTS_RC" "$t0"
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$OUT_DIR/gpu_tests.log" | tail -n 25 >&2
log "tests: exit $TESTS_RC after $((SECONDS - t0)) s"

# -- 5. benchmarks: stdout must be one JSON object (logs go to stderr) -------------------------------------------
# the whole engine (Llama-3.1-8B's 32 layers, random weights drawn on the device): the issue's headline figures
run_bench throughput "$THROUGHPUT_S" "$ROOT/bench/gpu_throughput.py"
run_bench attention "$ATTENTION_S" "$ROOT/bench/gpu_attention.py" --cases decode --iters 20
# 16 layers of Llama-3.1-8B's shape: the per-layer figures of the full model in half the build time.
run_bench decode "$DECODE_S" "$ROOT/bench/gpu_decode.py" --layers 16 --steps 5
run_bench sampler "$SAMPLER_S" "$ROOT/bench/gpu_sampler.py" --iters 5
# last: whatever of the budget is left (PAGEDSERVE_TC_PREFILL's evidence; the kernel is off by default until it)
run_bench attention_prefill "$ATTENTION_PREFILL_S" "$ROOT/bench/gpu_attention.py" --cases prefill --iters 20

# -- 6. tensor parallelism (NCCL) -----------------------------------------------------------------------------
NGPU="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)"
if [ "$NGPU" -ge 2 ]; then
  TP_STATUS="ran TP=2 against TP=1 on $NGPU GPUs"
else
  TP_STATUS="TP=2 skipped: tensor parallelism needs >= 2 GPUs and this device has $NGPU (single-rank NCCL check only)"
fi
cap="$(left "$TP_S")"
if [ "$cap" -ge 5 ]; then
  t0=$SECONDS
  (cd "$ROOT" && GPU_TEST_RECORD="$WORK/tp.jsonl" PYTHONPATH="$ROOT/scripts:$PYTHONPATH" \
    timeout -k 5 "$cap" "$PY" -m pytest tests/cupy_kernels/test_nccl.py -m gpu "${PYTEST_COMMON[@]}" -q -rs) \
      > "$WORK/tp.log" 2>&1
  rc=$?
  record tensor_parallel "$rc" "$t0"
  log "tensor parallelism: $TP_STATUS; exit $rc"
else
  log "tensor parallelism: not run, the time budget ran out"
fi

# -- 7. gpu_results.json ------------------------------------------------------------------------------------------
write_results
RC=$?
log "done in $((SECONDS - START)) s, exit $RC"
exit "$RC"
