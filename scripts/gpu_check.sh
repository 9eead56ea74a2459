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
# a temporary folder), GPU_CHECK_SLOW_HOST (set: every cap x4, the budget not enforced - for the dry run and
# tests on a shared CPU machine, never on the device).
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

# The real run's plan (issue 59): what has never run on a device first, each step with its own cap (seconds),
# in this order. The caps add up to BUDGET_S, which fits 8 minutes of device time on an H200 with cold caches;
# `--plan` prints them and `total N s` (scripts/ci_gpu_kit.sh checks total <= 480). Every step is also cut to
# what is left of BUDGET_S; the two "rest" steps (the regression suite, the throughput bench) take their cap plus
# whatever the steps before them left unused. Each step writes its record under $OUT/steps as it ends and
# gpu_results.json is rewritten after every step, so a run killed at any point keeps every finished step.
BUDGET_S=480
PER_TEST_S=45      # pytest-timeout per test (signal): a hung test fails alone
RESULTS_RESERVE_S=10
PLAN=(  # name cap what
  "install 15 the carried wheels, --no-deps --target, first on PYTHONPATH"
  "environment 30 requirements, carried modules first, every pagedserve module imported"
  "collect 40 every GPU test collected, split into the steps below"
  "preflight 20 CuPy, a device, NVRTC, cuBLAS, cuRAND"
  "gemm_probe 25 scripts/gpu_gemm_probe.py (which cuBLAS route a capture records); meanwhile scripts/gpu_precompile.py compiles one model's kernels, and the rest on other cores"
  "tests_runtime 60 GPU tests: CUDA graphs, the graph arena, the device sampler"
  "tests_kernels 50 GPU tests: tensor-core prefill, bf16, head dim 256, sliding window"
  "bench_decode 40 bench/gpu_decode.py --layers 16 (graphs on)"
  "bench_prefill 35 bench/gpu_attention.py --cases prefill --prefill-lengths 2048,8192"
  "bench_sampler 15 bench/gpu_sampler.py"
  "bench_attention 15 bench/gpu_attention.py --cases decode"
  "sanitizer 30 scripts/gpu_sanitize.py: one prefill and one paged decode under racecheck and memcheck"
  "tests_regression 55 the rest of the GPU tests (+ what the steps above left)"
  "bench_throughput 40 bench/gpu_throughput.py (+ what is left)"
  "results 10 gpu_results.json"
)
plan_cap() {  # the cap of step $1
  local line name cap rest
  for line in "${PLAN[@]}"; do
    read -r name cap rest <<< "$line"
    if [ "$name" = "$1" ]; then echo "$cap"; return; fi
  done
  echo 0
}
after_cap() {  # the caps of the steps after $1, results included: what a "rest" step leaves for them
  local line seen=0 sum=0 name cap
  for line in "${PLAN[@]}"; do
    read -r name cap _ <<< "$line"
    if [ "$seen" = 1 ]; then sum=$((sum + cap)); fi
    if [ "$name" = "$1" ]; then seen=1; fi
  done
  echo "$sum"
}

host_python() {  # the CPU machine's python with pagedserve installed: $GPU_CHECK_HOST_PYTHON, the repository venv, python3
  if [ -n "${GPU_CHECK_HOST_PYTHON:-}" ]; then echo "$GPU_CHECK_HOST_PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi
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
install_carried() {  # $1: python, $2: target folder[, $3: cap in seconds]
  PIP_CONFIG_FILE=/dev/null timeout -k 5 "${3:-600}" "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$2" "$WHEELS"/*.whl
}

REFERENCE_TOO=1
MODE="${1:-}"
if [ -n "${2:-}" ]; then
  if [ "$2" = "--no-reference" ] && { [ "$MODE" = "--prepare" ] || [ "$MODE" = "--dry-run" ]; }; then REFERENCE_TOO=0
  else log "unknown argument $2 (only --prepare and --dry-run take --no-reference)"; exit 5; fi
fi

# ---------------------------------------------------------------------------------------------------
if [ "$MODE" = "--plan" ]; then  # the real run's steps in order, each with its cap, and the total
  total=0
  for line in "${PLAN[@]}"; do
    read -r name cap what <<< "$line"
    printf '%-17s %4d s  %s\n' "$name" "$cap" "$what"
    total=$((total + cap))
  done
  echo "total $total s"
  [ "$total" -le "$BUDGET_S" ] || { echo "the caps pass BUDGET_S ($BUDGET_S s)" >&2; exit 1; }
  exit 0
fi

if [ "$MODE" = "--python312" ]; then  # which Python 3.12 the dry run would use (scripts/ci_gpu_kit.sh asks)
  find_python312 || exit 1
  exit 0
fi

if [ "$MODE" = "--prepare" ]; then
  HOST_PY="$(host_python)"
  # the reference needs pagedserve and numpy in this python: say which is missing and how to get it, before any
  # download
  if [ "$REFERENCE_TOO" = 1 ] && ! why="$("$HOST_PY" -c 'import numpy, pagedserve.models.config' 2>&1)"; then
    log "--prepare: the seeded reference needs pagedserve and numpy, and $HOST_PY cannot import them:" \
        "$(echo "$why" | tail -n 1). Make the checkout's venv ($ROOT/.venv, which --prepare uses first):" \
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' - or pass --no-reference"
    exit 5
  fi
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
  # GPU_CHECK_SLOW_HOST: the setup steps' caps x4 here (a shared 2-core machine imports and collects far slower
  # than the GPU machine's 16 cores); the steps, their order and their commands are the real run's.
  GPU_CHECK_SLOW_HOST=1 GPU_CHECK_SITE="$DRY/site" PYTHON="$IMAGE_PY" OUT="$DRY/real" bash "$ROOT/scripts/gpu_check.sh" \
    > "$DRY/real_run.log" 2>&1
  REAL_RC=$?
  if "$IMAGE_PY" "$KIT" dry-verify --results "$DRY/real/gpu_results.json" --expect-carried "$N_CARRIED" 2> "$DRY/verify.log"; then
    steps+=("real_run_until_the_gpu:ok"); log "real run until the GPU: ok ($((SECONDS - t0)) s)"; cat "$DRY/verify.log" >&2
  else
    steps+=("real_run_until_the_gpu:FAILED")
    log "real run until the GPU: FAILED (exit $REAL_RC; expected 2 after install, imports and collection)"
    grep -v "is ignored" "$DRY/real_run.log" | tail -n 30 >&2; cat "$DRY/verify.log" >&2
  fi
  # The sanitizer step's wiring with the real run's environment: its cases collect, its commands as it would run them
  run_step sanitizer_wiring env PYTHONPATH="$DRY/site/carried:$DRY/site/src" "$IMAGE_PY" "$ROOT/scripts/gpu_sanitize.py" \
    --dry-run
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
REC="$OUT_DIR/steps"  # every step's record, written as it ends: a kill loses only the step it cuts
rm -rf "$REC"
mkdir -p "$REC"
LOGFILE="$OUT_DIR/gpu_check.log"
: > "$LOGFILE"
rm -f "$OUT_DIR/gpu_results.json" "$OUT_DIR"/gpu_tests*.log "$OUT_DIR"/gpu_tests*.xml "$OUT_DIR/gpu_bench.log"
record() {  # step name, exit status, start second[, note]
  echo "$1 $2 $((SECONDS - $3))${4:+ $4}" >> "$REC/steps.txt"
}
left() {  # seconds step $1 may take: its cap, cut to what is left of BUDGET_S less the results' reserve
  local want rest
  want="$(plan_cap "$1")"
  if [ -n "${GPU_CHECK_SLOW_HOST:-}" ]; then echo $((want * 4)); return; fi  # the dry run on a shared CPU machine
  rest=$((BUDGET_S - (SECONDS - START) - RESULTS_RESERVE_S))
  if [ "$rest" -lt "$want" ]; then want=$rest; fi
  echo "$want"
}
rest_of_budget() {  # a "rest" step: everything left less the caps of the steps after it
  if [ -n "${GPU_CHECK_SLOW_HOST:-}" ]; then echo $(($(plan_cap "$1") * 4)); return; fi
  echo $((BUDGET_S - (SECONDS - START) - $(after_cap "$1")))
}
write_results() {  # $1: final (1) or after a step (0): gpu_results.json from every record so far
  local meta
  meta="$(printf '{"python": "%s", "seconds": %d, "budget_s": %d, "per_test_timeout_s": %s, "gpus": %s, "tp_status": "%s", "commit": "%s", "final": %s}' \
    "$PY" "$((SECONDS - START))" "$BUDGET_S" "${PER_TEST:-null}" "${NGPU:-null}" "${TP_STATUS:-}" \
    "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$([ "${1:-1}" = 1 ] && echo true || echo false)")"
  "$PY" "$KIT" results --work "$REC" --out-dir "$OUT_DIR" --meta "$meta" 2> "$REC/results.log"
  local rc=$?
  if [ "${1:-1}" = 1 ]; then sed 's/^gpu_kit: /gpu_check: /' "$REC/results.log" | tee -a "$LOGFILE" >&2; fi
  return $rc
}

PY="${PYTHON:-$(command -v python3 || true)}"
if [ -z "$PY" ]; then log "no python3 found"; exit 2; fi
log "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "not a venv")' 2>&1))"
log "plan: $(for line in "${PLAN[@]}"; do read -r n c _ <<< "$line"; printf '%s %s s, ' "$n" "$c"; done)budget $BUDGET_S s"

# -- install: the carried wheels, first on PYTHONPATH --------------------------------------------------------
SITE="${GPU_CHECK_SITE:-$WORK/site}"
t0=$SECONDS
rm -rf "$SITE/carried" "$SITE/src"
mkdir -p "$SITE/carried" "$SITE/src"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  install_carried "$PY" "$SITE/carried" "$(left install)" > "$REC/install.log" 2>&1
  rc=$?
  (cd "$WHEELS" && ls -1 *.whl) > "$REC/carried.txt"
  record install "$rc" "$t0"
  if [ "$rc" -eq 0 ]; then log "installed $(wc -l < "$REC/carried.txt") carried wheels --no-deps into $SITE/carried ($((SECONDS - t0)) s)"
  else log "installing the carried wheels from $WHEELS FAILED: $(grep -v 'is ignored' "$REC/install.log" | tail -n 3)"; fi
else
  record install 0 "$t0" "nothing carried"
  log "nothing carried ($WHEELS holds no wheel): the image's packages alone"
fi
"$PY" "$KIT" link-source --dest "$SITE/src" > "$REC/link.log" 2>&1 || log "linking the checkout failed: $(cat "$REC/link.log")"
export PYTHONPATH="$SITE/carried:$SITE/src${PYTHONPATH:+:$PYTHONPATH}"

# -- environment: requirements, carried packages first, every pagedserve module ----------------------------------
t0=$SECONDS
(cd "$REC" && timeout -k 5 "$(left environment)" "$PY" "$KIT" check-env --site "$SITE/carried" --out "$REC/environment.json") \
  > "$REC/environment.log" 2>&1
rc=$?
record environment "$rc" "$t0"
grep "^gpu_kit:" "$REC/environment.log" | sed 's/^gpu_kit: //' | while IFS= read -r line; do log "$line"; done
# pytest's options for the GPU tests, the same for this collection as for the runs below, so that the dry run
# proves them: the record plugin, and a per-test timeout where pytest-timeout is (it is on the image).
PYTEST_COMMON=(-p no:cacheprovider -p gpu_pytest_record)
PER_TEST=null
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PER_TEST=$PER_TEST_S
  PYTEST_COMMON+=("--timeout=$PER_TEST_S" --timeout-method=signal)  # no -p: its entry point loads it
else
  log "warning: pytest-timeout is not importable: no per-test timeout, only each step's"
fi

# -- collect: every GPU test, split into the steps' lists ---------------------------------------------------------
t0=$SECONDS
(cd "$ROOT" && GPU_TEST_RECORD="$REC/collect.jsonl" PYTHONPATH="$ROOT/scripts:$PYTHONPATH" \
  timeout -k 5 "$(left collect)" "$PY" -m pytest tests/cupy_kernels -m gpu "${PYTEST_COMMON[@]}" --collect-only -q) \
  > "$REC/collect.log" 2>&1
rc=$?
if ! "$PY" "$KIT" select --collected "$REC/collect.jsonl" --out-dir "$REC" >> "$REC/collect.log" 2>&1; then
  [ "$rc" -ne 0 ] || rc=3
fi
record collect "$rc" "$t0"
log "GPU tests collected: $(grep -E 'tests? (collected|selected)' "$REC/collect.log" | tail -n 1) (exit $rc, $((SECONDS - t0)) s);" \
    "$(grep '^gpu_kit: split' "$REC/collect.log" | sed 's/^gpu_kit: //')"
write_results 0

# -- preflight: CuPy, a device, and CUDA's libraries ----------------------------------------------------------------
t0=$SECONDS
timeout -k 5 "$(left preflight)" "$PY" - "$REC/preflight.json" > "$REC/preflight.log" 2>&1 <<'EOF'
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
  log "no usable GPU with $PY: $(tail -n 1 "$REC/preflight.log")"
  write_results
  exit $?
fi
if [ "$PRE_RC" -ne 0 ]; then
  log "CUDA libraries did not all load (exit $PRE_RC): $(tail -n 1 "$REC/preflight.log")"
  write_results
  exit $?
fi
log "device: $("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('device', '?'))" "$REC/preflight.json" 2>/dev/null)"

export PAGEDSERVE_GPU_ERRORS="$REC/errors.jsonl" PAGEDSERVE_GPU_REFERENCE="$REFERENCE"
export PAGEDSERVE_CACHE_DIR="$WORK/cache"  # the kernel cache: compiled once, shared by every step below
: > "$PAGEDSERVE_GPU_ERRORS"

run_bench() {  # name, cap seconds, script, args...: stdout must be one JSON object (logs go to stderr)
  local name=$1 cap=$2 t0=$SECONDS
  shift 2
  if [ "$cap" -lt 5 ]; then log "$name: not run, the time budget ran out"; return; fi
  (cd "$REC" && GPU_STEP_PARTIAL="$REC/$name.partial.json" timeout -k 5 "$cap" "$PY" "$@") \
    > "$REC/$name.out" 2> "$REC/$name.err"
  local rc=$?
  echo "$rc" > "$REC/$name.rc"
  record "$name" "$rc" "$t0"
  { echo "=== $* (exit $rc, $((SECONDS - t0)) s of $cap) ==="; cat "$REC/$name.err"; } >> "$OUT_DIR/gpu_bench.log"
  log "$name: exit $rc ($((SECONDS - t0)) s of $cap)"
  write_results 0
}
run_tests() {  # step name, cap seconds: the GPU tests of $REC/<step>.txt (written by `gpu_kit.py select`)
  local name=$1 cap=$2 t0=$SECONDS ids=()
  if [ "$cap" -lt 5 ]; then log "$name: not run, the time budget ran out"; return; fi
  mapfile -t ids < "$REC/$name.txt" 2>/dev/null
  if [ "${#ids[@]}" -eq 0 ]; then record "$name" 0 "$t0" "no tests"; log "$name: no tests"; return; fi
  (cd "$ROOT" && GPU_TEST_RECORD="$REC/$name.jsonl" PYTHONPATH="$ROOT/scripts:$PYTHONPATH" \
    timeout -k 10 "$cap" "$PY" -m pytest "${ids[@]}" -m gpu "${PYTEST_COMMON[@]}" -v -rfEs --durations=15 \
      --junitxml="$OUT_DIR/gpu_$name.xml") > "$OUT_DIR/gpu_$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$t0"
  grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$OUT_DIR/gpu_$name.log" | tail -n 12 >&2
  log "$name: ${#ids[@]} tests, exit $rc ($((SECONDS - t0)) s of $cap)"
  write_results 0
}

# -- the GEMM capture probe; meanwhile one model's kernels compiled into the cache, in parallel processes: float16
# head dim 128 (Llama-3.1-8B's shape: the decode, sanitizer and throughput benchmarks) and the head dim 64 attention
# of the tiny models the graph tests run -------------------------------------------------------------------------
(cd "$REC" && timeout -k 5 120 "$PY" "$ROOT/scripts/gpu_precompile.py" --dtype f16 --head-dim 128 64 --jobs 8 \
  > "$REC/precompile.out" 2> "$REC/precompile.err"; echo $? > "$REC/precompile.rc") &
PRECOMPILE_PID=$!
# and, on the other cores, every other module the kernel tests and the prefill sweep load (bf16, head dim 256)
(cd "$REC" && timeout -k 5 180 "$PY" "$ROOT/scripts/gpu_precompile.py" --dtype f16 bf16 --head-dim 64 128 256 \
  --skip-dtype-head-dim f16:128 f16:64 --jobs 8 > "$REC/precompile_rest.out" 2> "$REC/precompile_rest.err"; \
  echo $? > "$REC/precompile_rest.rc") &
PRECOMPILE_REST_PID=$!
run_bench gemm_probe "$(left gemm_probe)" "$ROOT/scripts/gpu_gemm_probe.py"

# -- what has never run on a device -------------------------------------------------------------------------------
run_tests tests_runtime "$(left tests_runtime)"
run_tests tests_kernels "$(left tests_kernels)"
# 16 layers of Llama-3.1-8B's shape, graphs on: the per-layer figures of the full model in half the build time
run_bench bench_decode "$(left bench_decode)" "$ROOT/bench/gpu_decode.py" --layers 16 --steps 5
run_bench bench_prefill "$(left bench_prefill)" "$ROOT/bench/gpu_attention.py" --cases prefill --prefill-lengths 2048,8192 --iters 20
run_bench bench_sampler "$(left bench_sampler)" "$ROOT/bench/gpu_sampler.py" --iters 5
run_bench bench_attention "$(left bench_attention)" "$ROOT/bench/gpu_attention.py" --cases decode --iters 20
run_bench sanitizer "$(left sanitizer)" "$ROOT/scripts/gpu_sanitize.py" --budget "$(($(left sanitizer) - 5))"
wait "$PRECOMPILE_PID" "$PRECOMPILE_REST_PID" 2>/dev/null
log "precompile: exit $(cat "$REC/precompile.rc" 2>/dev/null || echo '?') (the model's set), $(cat "$REC/precompile_rest.rc" \
  2>/dev/null || echo '?') (the rest); $(cat "$REC"/precompile*.err 2>/dev/null | grep -c 'gpu_precompile: .* s') modules timed"

# -- then the regression suite and the whole engine, with what is left ----------------------------------------------
NGPU="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)"
if [ "$NGPU" -ge 2 ]; then
  TP_STATUS="ran TP=2 against TP=1 on $NGPU GPUs"
else
  TP_STATUS="TP=2 left out: tensor parallelism needs >= 2 GPUs and this device has $NGPU (single-rank NCCL check only)"
  sed -i '/test_tp2_on_two_gpus/d' "$REC/tests_regression.txt" 2>/dev/null
fi
run_tests tests_regression "$(rest_of_budget tests_regression)"
run_bench bench_throughput "$(rest_of_budget bench_throughput)" "$ROOT/bench/gpu_throughput.py"

# -- gpu_results.json -------------------------------------------------------------------------------------------------
write_results 1
RC=$?
log "done in $((SECONDS - START)) s, exit $RC"
exit "$RC"
