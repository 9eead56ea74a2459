#!/usr/bin/env bash
# Run the benchmarks at full size, one after the other, then rebuild docs/benchmarks.md's figures
# table and docs/img/*.png from bench/results. Run it on a quiet machine (nothing else using the CPUs):
#
#   bash bench/run_all.sh                      # label: "quiet machine"
#   LABEL="GPU, H100" bash bench/run_all.sh    # any label for the table
#   BENCHES="memory jitter" bash bench/run_all.sh
#
# Needs the bench extra for the plots: .venv/bin/pip install -e '.[bench]'
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-bench/results}"
LABEL="${LABEL:-quiet machine}"
BENCHES="${BENCHES:-memory batching jitter parallel serve disagg structured speculative}"
mkdir -p "$OUT"
for name in $BENCHES; do
    echo "== $name ==" >&2
    start=$(date +%s)
    # The JSON is saved as $OUT/$name.json (stdout repeats it); progress lines go to stderr.
    "$PY" "bench/$name.py" --out-dir "$OUT" > /dev/null
    echo "== $name took $(( $(date +%s) - start )) s ==" >&2
done
"$PY" bench/plots.py --results "$OUT" --doc docs/benchmarks.md --img-dir docs/img --label "$LABEL"
echo "updated docs/benchmarks.md and docs/img/ from $OUT" >&2
