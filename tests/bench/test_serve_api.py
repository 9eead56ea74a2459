"""bench/serve.py --api openai end to end on a tiny load: the same burst through gRPC and through the HTTP API
(the official openai client), every token counted on both sides, and the overhead computed from the two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "data" / "tiny-llama")


@pytest.mark.slow
def test_serve_through_grpc_and_the_openai_api(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "serve.py"), "--quick", "--model", TINY, "--api", "openai",
           "--concurrency", "2", "--output-len", "8", "--no-plot", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["server"]["exit_code"] == 0 and r["config"]["api"] == "openai"
    for results, api in ((r["results"], "grpc"), (r["results_openai"], "openai")):
        for case in ("unique", "shared_prefix"):
            (row,) = results[case]
            assert row["api"] == api and row["concurrency"] == 2 and row["rate_req_per_s"] is None
            assert row["requests_sent"] == row["requests_ok"] == 2 and row["errors"] == [], row
            assert row["output_tokens"] == 2 * 8, row  # every token of both streams, counted per chunk
            assert 0 < row["ttft_ms"]["p50"] and row["tpot_ms"]["p50"] > 0, row
    overhead = r["summary"]["http_overhead_pct"]
    assert set(overhead) == {"unique", "shared_prefix"}
    for case, (entry,) in overhead.items():
        grpc_row, http_row = r["results"][case][0], r["results_openai"][case][0]
        expected = round(100 * (http_row["tpot_ms"]["p50"] / grpc_row["tpot_ms"]["p50"] - 1), 1)
        assert entry["concurrency"] == 2 and entry["tpot_p50"] == expected, (entry, expected)
