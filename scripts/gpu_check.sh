#!/usr/bin/env bash
# GPU check, one command on a CUDA machine (about 3-5 minutes on an H200):
#   1. finds a Python with numpy + CuPy that sees a device (else exits 2 with the reason);
#   2. makes pagedserve importable from this checkout without installing it (a symlinked
#      namespace package on PYTHONPATH), unless it already is;
#   3. runs every GPU test (tests/cupy_kernels, marker `gpu`: kernels, whole models, and the runtime
#      above them - device metadata, CUDA graph replays, sampling, KV sizing, the engine): with
#      pytest if importable; else with pytest installed from ./wheels (offline, into a throw-away venv that sees the system CuPy) if
#      that folder exists; else with tests/cupy_kernels/_mini_runner.py (no pytest needed);
#   4. runs bench/gpu_attention.py and bench/gpu_decode.py;
#   5. writes gpu_results.json to $OUT if set, else to the repository root: test summary, kernel
#      errors against the numpy reference (plus graph-vs-eager logit gaps and KV sizing numbers),
#      attention bandwidth, decode step times vs roofline with CUDA graphs on and off.
# Exit status: 0 all good, 1 a test or benchmark failed, 2 no usable GPU, 3 pagedserve not importable.
#
#   scripts/gpu_check.sh                 # PYTHON=/path/to/python to choose the interpreter
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
log() { echo "gpu_check: $*" >&2; }

# -- 1. interpreter with CuPy and a device ----------------------------------------------------------
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
if ! DEVICE="$("$PY" - 2>&1 <<'EOF'
import numpy, cupy
n = cupy.cuda.runtime.getDeviceCount()
if n < 1:
    raise SystemExit("CuPy sees no CUDA device")
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
print(f"{name} (cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})")
EOF
)"; then
  log "no usable GPU with $PY: $(printf '%s\n' "$DEVICE" | tail -n 1)"
  exit 2
fi
log "device: $DEVICE; python: $PY"

# -- 2. pagedserve importable -------------------------------------------------------------------------
if ! (cd "$WORK" && "$PY" -c "import pagedserve.cupy_kernels.cuda_ops") 2>/dev/null; then
  mkdir -p "$WORK/site/pagedserve"
  for pkg in cupy_kernels models runtime sidecar; do ln -s "$ROOT/$pkg" "$WORK/site/pagedserve/$pkg"; done
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd "$WORK" && "$PY" -c "import pagedserve.models.llama, pagedserve.cupy_kernels.cuda_ops"); then
  log "pagedserve's GPU path does not import with $PY"; exit 3
fi

# -- 3. GPU tests --------------------------------------------------------------------------------------
export PAGEDSERVE_GPU_ERRORS="$WORK/errors.jsonl"
: > "$PAGEDSERVE_GPU_ERRORS"
TEST_PY="$PY"
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d "$ROOT/wheels" ]; then
  if "$PY" -m venv --system-site-packages "$WORK/venv" >/dev/null 2>&1 \
     && "$WORK/venv/bin/python" -m pip install -q --no-index --find-links "$ROOT/wheels" pytest >/dev/null 2>&1; then
    TEST_PY="$WORK/venv/bin/python"
  else
    log "could not install pytest from $ROOT/wheels; using the built-in runner"
  fi
fi
if "$TEST_PY" -c "import pytest" 2>/dev/null; then
  RUNNER=pytest
  (cd "$ROOT" && timeout 300 "$TEST_PY" -m pytest tests/cupy_kernels -m gpu -q -p no:cacheprovider \
      --junitxml="$WORK/junit.xml") > "$WORK/tests.log" 2>&1
  TESTS_RC=$?
else
  RUNNER=mini
  (cd "$ROOT" && timeout 300 "$TEST_PY" tests/cupy_kernels/_mini_runner.py tests/cupy_kernels/test_cuda_ops.py \
      tests/cupy_kernels/test_gpu_runtime.py --json "$WORK/tests.json") > "$WORK/tests.log" 2>&1
  TESTS_RC=$?
fi
tail -n 25 "$WORK/tests.log" >&2
log "tests ($RUNNER): exit $TESTS_RC"

# -- 4. benchmarks --------------------------------------------------------------------------------------
(cd "$WORK" && timeout 150 "$PY" "$ROOT/bench/gpu_attention.py") > "$WORK/attention.json" 2> "$WORK/attention.err"
ATTN_RC=$?
log "bench/gpu_attention.py: exit $ATTN_RC"
(cd "$WORK" && timeout 240 "$PY" "$ROOT/bench/gpu_decode.py") > "$WORK/decode.json" 2> "$WORK/decode.err"
DECODE_RC=$?
log "bench/gpu_decode.py: exit $DECODE_RC"

# -- 5. gpu_results.json -------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
"$PY" - "$WORK" "$OUT_DIR/gpu_results.json" "$RUNNER" "$TESTS_RC" "$ATTN_RC" "$DECODE_RC" "$DEVICE" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, runner, tests_rc, attn_rc, decode_rc, device = sys.argv[1:]
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
    tests["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})[:5]
elif (work / "tests.json").exists():
    summary = json.loads((work / "tests.json").read_text())
    tests.update({k: summary[k] for k in ("passed", "failed", "skipped", "seconds")})
    tests["failures"] = [f["test"] for f in summary["failures"]]
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

result = {"device": device, "tests": tests, "kernel_errors": errors,
          "attention": bench("attention", attn_rc), "decode": bench("decode", decode_rc)}
Path(out).write_text(json.dumps(result, indent=2) + "\n")
att = result["attention"].get("headline_pct_of_peak_bandwidth")
print(f"gpu_check: wrote {out}; attention headline {att}% of peak bandwidth", file=sys.stderr)
EOF

if [ "$TESTS_RC" -ne 0 ] || [ "$ATTN_RC" -ne 0 ] || [ "$DECODE_RC" -ne 0 ]; then
  exit 1
fi
exit 0
