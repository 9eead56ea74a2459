#!/usr/bin/env bash
# CI's check of the GPU kit (issue #43), called by .ci/run: a dependency added to pyproject.toml, a module
# that stops importing with the GPU image's packages, or a GPU test that stops collecting fails CI the day
# it happens, not on the next (rare, 15-minute) GPU lease.
#
# It runs, in a scratch folder (the checkout's .gpu_check is left alone):
#   scripts/gpu_check.sh --prepare --no-reference   the package sets derived from pyproject.toml and
#       scripts/gpu_image_packages.txt, the wheels downloaded, the 64 MiB limit checked;
#   scripts/gpu_check.sh --dry-run --no-reference   a Python 3.12 venv holding the image's packages plays
#       the image's python3, and the real run's own install step, requirement check, import of every
#       pagedserve module and collection of every GPU test run with it until the GPU preflight stops them.
#   scripts/gpu_check.sh --plan   the real run's steps in order with their caps: the total must fit 480 s (the
#       8 minutes of device time a lent H200 gives the check, cold caches included); checked first, no Python 3.12
#       needed;
#   (inside --dry-run) scripts/gpu_sanitize.py --dry-run with the image's python and the real run's PYTHONPATH: the
#       sanitizer step's cases collect, and its commands are those the device step would run.
# Left out (the full --dry-run has them): the seeded models' CPU reference (minutes of CPU) and the CPU tests
# of the GPU path, which CI's pytest runs anyway.
# Without Python 3.12 it says so and exits 0: the kit is then NOT checked, and the output says that.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$SECONDS
say() { echo "ci_gpu_kit: $*"; }

# The plan first (bash only: this runs before anything else is known to exist).
if ! PLAN="$(bash "$ROOT/scripts/gpu_check.sh" --plan)"; then
  echo "$PLAN"
  say "FAILED: scripts/gpu_check.sh --plan (above): the caps pass the budget"
  exit 1
fi
TOTAL="" SUMMARY=""
while read -r name cap _; do
  if [ "$name" = "total" ]; then TOTAL="$cap"; else SUMMARY+="$name $cap s, "; fi
done <<< "$PLAN"
if [ -z "$TOTAL" ] || [ "$TOTAL" -gt 480 ]; then
  echo "$PLAN"
  say "FAILED: the real run's plan totals ${TOTAL:-?} s: it must fit 480 s (8 minutes of a lent H200, cold caches)"
  exit 1
fi
say "plan: ${SUMMARY}total $TOTAL s (<= 480)"

if ! PY312="$(bash "$ROOT/scripts/gpu_check.sh" --python312 2>/dev/null)"; then
  say "SKIPPED, the GPU kit was NOT checked: no Python 3.12 on this machine (looked at \$PYTHON312, python3.12," \
      "pyenv, uv); the GPU image runs 3.12 and its wheels are cp312. Install one (pyenv install 3.12) to check it."
  exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export GPU_CHECK_DIR="$WORK/kit" OUT="$WORK/out" PYTHON312="$PY312"

say "--prepare --no-reference (package sets from pyproject.toml and scripts/gpu_image_packages.txt)"
if ! bash "$ROOT/scripts/gpu_check.sh" --prepare --no-reference > "$WORK/prepare.log" 2>&1; then
  grep -v "is ignored: it is neither" "$WORK/prepare.log" | tail -n 40
  say "FAILED: scripts/gpu_check.sh --prepare could not derive or download what travels (above)"
  exit 1
fi
grep -E "^gpu_kit: (travels|assumed|MISSING|dry run)" "$WORK/prepare.log"

say "--dry-run --no-reference with $PY312"
if ! bash "$ROOT/scripts/gpu_check.sh" --dry-run --no-reference > "$WORK/dry.log" 2>&1; then
  grep -v "is ignored: it is neither" "$WORK/dry.log" | tail -n 60
  say "FAILED: the GPU kit's dry run (above): the real run would fail the same way on the GPU image"
  exit 1
fi
grep -E "^gpu_(check|kit):" "$WORK/dry.log" | grep -v "wrote "

"$PY312" - "$OUT/gpu_dry_run_real.json" "$GPU_CHECK_DIR/kit.json" "$((SECONDS - START))" <<'PY'
import json, sys
r, kit, seconds = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
env, imports = r["environment"], r["imports"]
print(f"ci_gpu_kit: PASSED in {seconds} s: a Python {env['python_version']} venv holding the image's "
      f"{len(kit['machine_wheels'])} packages played its python3; the real run's own install step put "
      f"{len(r['install']['carried'])} carried wheels ({kit['travel_bytes'] / 2**20:.1f} MiB) first on PYTHONPATH; "
      f"{sum(v['ok'] for v in env['requirements'].values())}/{len(env['requirements'])} requirements met; "
      f"{imports['imported']} pagedserve modules imported; {r['collected']['gpu_tests']} GPU tests collected; "
      f"it stopped at the GPU preflight (exit {r['exit_code']}, no GPU here)")
PY
