#!/usr/bin/env bash
# The GPU check: everything a first GPU run must prove, in one command, under 5 minutes.
#
#   scripts/gpu_check.sh --prepare   on the CPU machine (needs the package registry): downloads the
#       wheels the lent GPU machine lacks (gguf, structlog, grpcio-health-checking, grpcio-reflection
#       and their dependencies, CPython 3.12 manylinux x86_64) into .gpu_check/wheels, the wheels the
#       GPU machine already has into .gpu_check/machine-wheels (for --dry-run only), and writes the
#       float32 CPU reference logits of the seeded models into .gpu_check/reference.
#       Carry .gpu_check/wheels and .gpu_check/reference to the GPU machine (.gpu_check is ignored by git).
#   scripts/gpu_check.sh --dry-run   on the CPU machine: a fresh Python 3.12 venv gets the machine's
#       packages and then ours, both with --no-index from those folders, and runs the CPU half of the
#       check (imports of every layer, the seeded references recomputed and compared, the GPU tests
#       collected, the preflight seeing no GPU). Proves the install path before a device minute is spent.
#   scripts/gpu_check.sh             on the GPU machine: the real run.
#       1. preflight with the machine's own CuPy: a device, NVRTC (a kernel compiled and launched),
#          cuBLAS (a float16 GEMM), cuRAND (random numbers);
#       2. installs the missing wheels from .gpu_check/wheels (offline, a venv that sees the system
#          packages) when gguf/structlog/grpc health/reflection are not importable;
#       3. runs every GPU test (tests/cupy_kernels -m gpu: kernels, tiny and seeded real-shape models,
#          device metadata, CUDA graphs, sampling, KV sizing, the engine); a GPU test that SKIPS fails;
#       4. runs bench/gpu_attention.py, bench/gpu_decode.py and bench/gpu_sampler.py;
#       4b. tensor parallelism over NCCL (tests/cupy_kernels/test_nccl.py, kept out of step 3): a
#          single-rank NCCL check on any device, TP=2 against TP=1 where there are >= 2 GPUs (with one
#          GPU that test's skip is expected and recorded in gpu_results.json with its reason);
#       5. writes gpu_results.json to $OUT if set, else to the repository root.
#
# Exit status: 0 all good; 1 a test or benchmark failed, or GPU tests skipped; 2 no usable GPU;
# 3 pagedserve or its dependencies not importable; 4 NVRTC, cuBLAS or cuRAND failed; 5 --prepare /
# --dry-run failed (download, install, or a CPU-half check).
# Environment: PYTHON (the interpreter of the real run), PYTHON312 (--dry-run's), OUT.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK_DIR="$ROOT/.gpu_check"
WHEELS="$CHECK_DIR/wheels"
MACHINE_WHEELS="$CHECK_DIR/machine-wheels"
REFERENCE="$CHECK_DIR/reference"
OUT_DIR="${OUT:-$ROOT}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
log() { echo "gpu_check: $*" >&2; }

# What the lent machine lacks (pyproject runtime deps it does not have); what it has (for --dry-run).
TRAVEL_REQS=("gguf>=0.10" "structlog>=24.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1")
MACHINE_REQS=("numpy==2.5.2" "grpcio>=1.85.1" "protobuf>=7.35.1" "tokenizers>=0.19" "safetensors>=0.4" "anyio>=4.0"
              "jinja2>=3.1" "pytest>=8" "hypothesis>=6.100")
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Offline installs must not see this machine's pip configuration (extra indexes, find-links).
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

install_travel_wheels() {  # $1: python of a venv
  "$1" -m pip install -q --no-index --find-links "$WHEELS" "${TRAVEL_REQS[@]}"
}

deps_importable() {  # $1: python
  "$1" -c "import numpy, gguf, structlog, grpc, grpc_health.v1.health, grpc_reflection.v1alpha.reflection" 2>/dev/null
}

host_python() {  # the CPU machine's python with pagedserve installed (the repository venv), else python3
  if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi
}

# ---------------------------------------------------------------------------------------------------
if [ "${1:-}" = "--prepare" ]; then
  HOST_PY="$(host_python)"
  mkdir -p "$WHEELS" "$MACHINE_WHEELS" "$REFERENCE"
  log "downloading ${TRAVEL_REQS[*]} (+ dependencies) for CPython 3.12 manylinux x86_64 into $WHEELS"
  if ! env -u PIP_CONFIG_FILE "$HOST_PY" -m pip download -q "${PLATFORM_ARGS[@]}" -d "$WHEELS" "${TRAVEL_REQS[@]}"; then
    log "download failed"; exit 5
  fi
  # numpy is on the GPU machine (2.5.2) and is 15 MB of the 64 MiB that travel: not carried.
  rm -f "$WHEELS"/numpy-*.whl
  log "downloading what the GPU machine already has (${MACHINE_REQS[*]}) into $MACHINE_WHEELS, for --dry-run"
  if ! env -u PIP_CONFIG_FILE "$HOST_PY" -m pip download -q "${PLATFORM_ARGS[@]}" -d "$MACHINE_WHEELS" \
       "${MACHINE_REQS[@]}" "${TRAVEL_REQS[@]}"; then
    log "download failed"; exit 5
  fi
  log "computing the seeded models' float32 CPU reference into $REFERENCE (a few minutes on 2 cores)"
  if ! "$HOST_PY" "$ROOT/tests/cupy_kernels/seeded_models.py" --write "$REFERENCE"; then
    log "reference computation failed"; exit 5
  fi
  log "to carry: .gpu_check/wheels $(du -sh "$WHEELS" | cut -f1), .gpu_check/reference $(du -sh "$REFERENCE" | cut -f1)" \
      "(the tree's tracked files: $(cd "$ROOT" && git ls-files -z | du -ch --files0-from=- 2>/dev/null | tail -n 1 | cut -f1))"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------
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

if [ "${1:-}" = "--dry-run" ]; then
  for d in "$WHEELS" "$MACHINE_WHEELS" "$REFERENCE"; do
    [ -d "$d" ] || { log "$d is missing: run scripts/gpu_check.sh --prepare first"; exit 5; }
  done
  if ! PY312="$(find_python312)"; then
    log "no Python 3.12 here (looked at \$PYTHON312, python3.12, pyenv, uv): the wheels are cp312, so the dry run" \
        "cannot install them; install one (pyenv install 3.12) or set PYTHON312"
    exit 5
  fi
  log "fresh venv from $PY312 ($("$PY312" --version 2>&1); the GPU machine runs 3.12.3)"
  "$PY312" -m venv "$WORK/venv" || { log "venv creation failed"; exit 5; }
  VPY="$WORK/venv/bin/python"
  steps=()
  run_step() {  # name, command...
    local name="$1"; shift
    if "$@" > "$WORK/$name.log" 2>&1; then steps+=("$name:ok"); log "$name: ok"
    else steps+=("$name:FAILED"); log "$name: FAILED"; tail -n 15 "$WORK/$name.log" >&2; fi
  }
  # The GPU machine's own packages, then ours exactly as the real run installs them.
  run_step machine_packages "$VPY" -m pip install -q --no-index --find-links "$MACHINE_WHEELS" "${MACHINE_REQS[@]}"
  run_step travel_wheels install_travel_wheels "$VPY"
  mkdir -p "$WORK/site/pagedserve"
  for pkg in cupy_kernels models runtime sidecar; do ln -s "$ROOT/$pkg" "$WORK/site/pagedserve/$pkg"; done
  export PYTHONPATH="$WORK/site"
  run_step imports "$VPY" -c "import pagedserve.sidecar.server, pagedserve.runtime.engine, pagedserve.models.gguf_loader, \
pagedserve.cupy_kernels.cuda_ops, pagedserve.cupy_kernels.kernel_cache, structlog, gguf; print('imports ok')"
  run_step seeded_reference "$VPY" "$ROOT/tests/cupy_kernels/seeded_models.py" --check "$REFERENCE"
  run_step collect_gpu_tests bash -c "cd '$ROOT' && '$VPY' -m pytest tests/cupy_kernels -m gpu --collect-only -q -p no:cacheprovider \
    | tail -n 3 | grep -E '^[0-9]+(/[0-9]+)? tests? (collected|selected)'"
  run_step cpu_tests bash -c "cd '$ROOT' && '$VPY' -m pytest -q -p no:cacheprovider -m 'not gpu' \
    tests/cupy_kernels/test_kernel_cache.py tests/cupy_kernels/test_seeded_models.py tests/runtime/test_sampling_device.py \
    tests/runtime/test_cuda_graphs.py tests/models/test_activation_check.py"
  # The real run's preflight, with this venv (no CuPy): it must stop with exit 2 and say why.
  PYTHON="$VPY" OUT="$WORK/preflight" bash "$ROOT/scripts/gpu_check.sh" > "$WORK/preflight.log" 2>&1
  PRE_RC=$?
  if [ "$PRE_RC" -eq 2 ]; then steps+=("preflight_without_gpu:ok"); log "preflight without a GPU: exit 2 as expected"
  else steps+=("preflight_without_gpu:FAILED"); log "preflight without a GPU: exit $PRE_RC, expected 2"; tail -n 5 "$WORK/preflight.log" >&2; fi
  mkdir -p "$OUT_DIR"
  "$VPY" - "$OUT_DIR/gpu_dry_run.json" "$PY312" "$((SECONDS - START))" "$WORK" "${steps[@]}" <<'EOF'
import json, platform, sys
from pathlib import Path
out, py, seconds, work, *steps = sys.argv[1:]
import numpy
steps = dict(s.split(":", 1) for s in steps)
logs = {name: [line for line in (Path(work) / f"{name}.log").read_text(errors="replace").splitlines()
               if "is ignored" not in line][-6:]
        for name in steps if (Path(work) / f"{name}.log").exists()}
result = {"python": py, "python_version": platform.python_version(), "numpy": numpy.__version__,
          "seconds": int(seconds), "steps": steps, "log_tails": logs}
open(out, "w").write(json.dumps(result, indent=2) + "\n")
print(f"gpu_check: wrote {out}", file=sys.stderr)
EOF
  case " ${steps[*]} " in *FAILED*) exit 5;; esac
  log "dry run passed in $((SECONDS - START)) s"
  exit 0
fi

if [ -n "${1:-}" ]; then
  log "unknown argument $1 (use --prepare, --dry-run, or nothing on the GPU machine)"; exit 5
fi

# -- 1. interpreter with CuPy, a device, and CUDA's libraries ---------------------------------------
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c "import cupy" 2>/dev/null; then
  PY="$ROOT/.venv/bin/python"
else
  PY="$(command -v python3 || true)"
fi
if [ -z "$PY" ]; then
  log "no python3 found"; exit 2
fi
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
if [ "$PRE_RC" -eq 2 ]; then
  log "no usable GPU with $PY: $(tail -n 1 "$WORK/preflight.log")"; exit 2
fi
DEVICE="$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('device', '?'))" "$WORK/preflight.json" 2>/dev/null)"
log "device: $DEVICE; python: $PY"
if [ "$PRE_RC" -ne 0 ]; then
  log "CUDA libraries did not all load: $(tail -n 1 "$WORK/preflight.log")"
  mkdir -p "$OUT_DIR" && cp "$WORK/preflight.json" "$OUT_DIR/gpu_results.json"
  exit 4
fi

# -- 2. dependencies and pagedserve importable ------------------------------------------------------------
if ! deps_importable "$PY"; then
  if [ -d "$WHEELS" ] && "$PY" -m venv --system-site-packages "$WORK/venv" >/dev/null 2>&1 \
     && install_travel_wheels "$WORK/venv/bin/python" > "$WORK/install.log" 2>&1; then
    PY="$WORK/venv/bin/python"  # sees the system's CuPy, numpy, grpc, pytest; adds ours
    log "installed the missing wheels from $WHEELS into a venv over the system packages"
  else
    log "gguf/structlog/grpc health/reflection missing and not installable from $WHEELS" \
        "(run --prepare on the CPU machine and carry .gpu_check/wheels): $(tail -n 3 "$WORK/install.log" 2>/dev/null)"
    exit 3
  fi
fi
if ! (cd "$WORK" && "$PY" -c "import pagedserve.cupy_kernels.cuda_ops") 2>/dev/null; then
  mkdir -p "$WORK/site/pagedserve"
  for pkg in cupy_kernels models runtime sidecar; do ln -s "$ROOT/$pkg" "$WORK/site/pagedserve/$pkg"; done
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd "$WORK" && "$PY" -c "import pagedserve.models.llama, pagedserve.cupy_kernels.cuda_ops, pagedserve.sidecar.server"); then
  log "pagedserve does not import with $PY"; exit 3
fi

# -- 3. GPU tests ------------------------------------------------------------------------------------------
export PAGEDSERVE_GPU_ERRORS="$WORK/errors.jsonl" PAGEDSERVE_GPU_REFERENCE="$REFERENCE"
export PAGEDSERVE_CACHE_DIR="$WORK/cache"  # the kernel cache: compiled once, shared by tests and benchmarks
: > "$PAGEDSERVE_GPU_ERRORS"
if "$PY" -c "import pytest" 2>/dev/null; then
  RUNNER=pytest
  (cd "$ROOT" && timeout 140 "$PY" -m pytest tests/cupy_kernels -m gpu -q -p no:cacheprovider -rs \
      --ignore=tests/cupy_kernels/test_nccl.py --junitxml="$WORK/junit.xml") > "$WORK/tests.log" 2>&1
  TESTS_RC=$?
else
  RUNNER=mini
  (cd "$ROOT" && timeout 140 "$PY" tests/cupy_kernels/_mini_runner.py tests/cupy_kernels/test_cuda_ops.py \
      tests/cupy_kernels/test_gpu_runtime.py --json "$WORK/tests.json") > "$WORK/tests.log" 2>&1
  TESTS_RC=$?
fi
tail -n 25 "$WORK/tests.log" >&2
log "tests ($RUNNER): exit $TESTS_RC after $((SECONDS - START)) s"

# -- 4. benchmarks ---------------------------------------------------------------------------------------
(cd "$WORK" && timeout 40 "$PY" "$ROOT/bench/gpu_attention.py" --iters 20) > "$WORK/attention.json" 2> "$WORK/attention.err"
ATTN_RC=$?
log "bench/gpu_attention.py: exit $ATTN_RC"
# 16 layers of Llama-3.1-8B's shape: the per-layer figures of the full model in half the build time.
(cd "$WORK" && timeout 75 "$PY" "$ROOT/bench/gpu_decode.py" --layers 16 --steps 5) > "$WORK/decode.json" 2> "$WORK/decode.err"
DECODE_RC=$?
log "bench/gpu_decode.py: exit $DECODE_RC"
(cd "$WORK" && timeout 20 "$PY" "$ROOT/bench/gpu_sampler.py" --iters 5) > "$WORK/sampler.json" 2> "$WORK/sampler.err"
SAMPLER_RC=$?
log "bench/gpu_sampler.py: exit $SAMPLER_RC"

# -- 4b. tensor parallelism (NCCL) ----------------------------------------------------------------------
NGPU="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)"
if [ "$RUNNER" = pytest ]; then
  (cd "$ROOT" && timeout 90 "$PY" -m pytest tests/cupy_kernels/test_nccl.py -m gpu -q -rs -p no:cacheprovider) \
      > "$WORK/tp.log" 2>&1
else
  (cd "$ROOT" && timeout 90 "$PY" tests/cupy_kernels/_mini_runner.py tests/cupy_kernels/test_nccl.py) \
      > "$WORK/tp.log" 2>&1
fi
TP_RC=$?
if [ "$NGPU" -ge 2 ]; then
  TP_STATUS="ran TP=2 against TP=1 on $NGPU GPUs"
else
  TP_STATUS="TP=2 skipped: tensor parallelism needs >= 2 GPUs and this device has $NGPU (single-rank NCCL check only)"
fi
tail -n 8 "$WORK/tp.log" >&2
log "tensor parallelism: $TP_STATUS; exit $TP_RC"

# -- 5. gpu_results.json -------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
"$PY" - "$WORK" "$OUT_DIR/gpu_results.json" "$RUNNER" "$TESTS_RC" "$ATTN_RC" "$DECODE_RC" "$SAMPLER_RC" \
    "$((SECONDS - START))" "$TP_RC" "$TP_STATUS" "$NGPU" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, runner, tests_rc, attn_rc, decode_rc, sampler_rc, seconds, tp_rc, tp_status, ngpu = sys.argv[1:]
work = Path(work)

def tail(path, n=40):
    p = work / path
    return p.read_text(errors="replace").splitlines()[-n:] if p.exists() else []

tests = {"runner": runner, "exit_code": int(tests_rc)}
if runner == "pytest" and (work / "junit.xml").exists():
    suite = ET.parse(work / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        tests[key] = int(suite.get(key, 0))
    tests["seconds"] = float(suite.get("time", 0))
    tests["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
    tests["skipped_tests"] = [f"{c.get('classname')}::{c.get('name')}: {c.find('skipped').get('message', '')}"
                              for c in suite.iter("testcase") if c.find("skipped") is not None][:20]
elif (work / "tests.json").exists():
    summary = json.loads((work / "tests.json").read_text())
    tests.update({k: summary[k] for k in ("passed", "failed", "skipped", "seconds")})
    tests["failures"] = [f["test"] for f in summary["failures"]]
else:
    tests["skipped"] = -1  # no summary at all (killed by the timeout?)
if int(tests_rc) != 0:
    tests["log_tail"] = tail("tests.log")

errors = {}
for line in (work / "errors.jsonl").read_text().splitlines():
    rec = json.loads(line)
    name = rec.pop("name")
    family = name.split("/")[0]
    agg = errors.setdefault(family, {})
    for key, value in rec.items():
        better_low = key not in ("top1_agreement", "decided_rows", "max_abs_logit")
        old = agg.get(key)
        agg[key] = value if old is None else (max(old, value) if better_low else min(old, value))
    errors.setdefault("_all", []).append({"name": name, **rec})

def bench(name, rc):
    path = work / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except Exception:
        return {"exit_code": int(rc), "error": tail(f"{name}.err")}

preflight = json.loads((work / "preflight.json").read_text())
result = {"device": preflight.get("device"), "preflight": preflight, "seconds": int(seconds), "tests": tests,
          "kernel_errors": errors, "attention": bench("attention", attn_rc), "decode": bench("decode", decode_rc),
          "sampler": bench("sampler", sampler_rc),
          "tensor_parallel": {"gpus": int(ngpu), "status": tp_status, "exit_code": int(tp_rc),
                              "log_tail": tail("tp.log", 12)}}
Path(out).write_text(json.dumps(result, indent=2) + "\n")
att = result["attention"].get("headline_pct_of_peak_bandwidth")
print(f"gpu_check: wrote {out}; attention headline {att}% of peak bandwidth", file=sys.stderr)
# A GPU test that skipped on the GPU machine did not check anything: that is a failure of the run.
sys.exit(10 if tests.get("skipped", 0) != 0 else 0)
EOF
SKIP_RC=$?
if [ "$SKIP_RC" -eq 10 ]; then
  log "GPU tests SKIPPED on the GPU machine (see skipped_tests in gpu_results.json): failing the run"
fi
log "done in $((SECONDS - START)) s"
if [ "$TESTS_RC" -ne 0 ] || [ "$ATTN_RC" -ne 0 ] || [ "$DECODE_RC" -ne 0 ] || [ "$SAMPLER_RC" -ne 0 ] \
   || [ "$SKIP_RC" -ne 0 ] || [ "$TP_RC" -ne 0 ]; then
  exit 1
fi
exit 0
