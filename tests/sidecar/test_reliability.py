"""The reliability suite's quick variants: bench/reliability.py's runs on the tiny model, small sizes,
each against its own real server process (the full-size figures are in docs/reliability.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "data" / "tiny-llama")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rel():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_reliability", ROOT / "bench" / "reliability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(rel, name, tmp_path):
    return rel.run_one(name, tmp_path, TINY, rel.QUICK, quick=True)


def test_concurrent_streams_all_complete_and_the_json_record(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "reliability.py"), "--quick", "--model", TINY,
                           "--only", "streams", "--out-dir", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record == json.loads((out / "reliability.json").read_text())
    r = record["results"]["streams"]
    assert r["requests"] == 100 and r["completed"] == 100 and r["lost"] == 0, r
    assert r["kv_blocks_used_after"] == 0 and r["exit_code"] == 0
    assert record["summary"]["claim_streams_reproduced"] is True


def test_fuzzed_requests_each_get_an_expected_answer(rel, tmp_path):
    partial = tmp_path / "partial.json"
    r = rel.run_one("fuzz", tmp_path, TINY, rel.QUICK, quick=True, partial=str(partial))
    assert r["requests"] == 300 and r["unexpected"] == 0, r["unexpected_examples"]
    written = json.loads(partial.read_text())  # what a cut-off run would have left, here at the end
    assert written["final"] and written == {k: v for k, v in r.items() if k in written}
    # Every accepted Generate was answered by its headers (on admission), then ended within its bound.
    assert 0 < r["generate_admitted"] == r["by_rpc"].get("Generate:OK", 0)
    assert r["running_after"] == r["waiting_after"] == 0
    assert set(r["outcomes"]) <= {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    # Both paths ran, each for at least a tenth of the requests (the draw's split is ~1:5 and moves with the
    # request fields and their checks).
    assert r["outcomes"].get("OK", 0) > 30 and r["outcomes"].get("INVALID_ARGUMENT", 0) > 30
    assert r["always_serving"] and r["rss_within_budget"] and r["kv_blocks_used_after"] == 0 and r["exit_code"] == 0
    assert r["server_errors_logged"] == 0, r["server_error_examples"]  # cancels racing writes are not errors


def test_cancels_and_aborts_racing_completion_leak_no_block(rel, tmp_path):
    r = run(rel, "cancels", tmp_path)
    assert r["kv_blocks_used_after"] == 0 and r["running_after"] == 0 and r["waiting_after"] == 0, r
    assert r["health_after"] == "SERVING" and r["exit_code"] == 0
    assert r["outcomes"]["cancelled"] > 0 and r["aborts_found_in_flight"] > 0
    assert r["server_errors_logged"] == 0, r["server_error_examples"]


def test_sigterm_under_load_finishes_or_refuses_each_stream_and_exits_zero(rel, tmp_path):
    r = run(rel, "sigterm", tmp_path)
    assert r["each_finished_or_unavailable"] and r["exit_code"] == 0, r
    assert r["server_errors_logged"] == 0, r["server_error_examples"]  # shutting down is not a worker death
    assert sum(r["outcomes"].values()) == r["streams"] == 40  # which of the two each gets depends on the machine


def test_a_pool_ten_times_too_small_changes_no_greedy_token(rel, tmp_path):
    r = run(rel, "small_pool", tmp_path)
    assert r["blocks_the_load_needs"] >= 10 * r["num_kv_blocks"]
    assert r["preemptions"] > 0 and r["mismatched"] == 0 and r["kv_blocks_used_after"] == 0, r
