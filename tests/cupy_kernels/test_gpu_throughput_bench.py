"""bench/gpu_throughput.py on a machine without a GPU: it imports, refuses cleanly, and its engine path (stand-in
weights behind the model's `_put`, the one-word tokenizer, requests stepped to the end) runs on a small config on
the CPU, so the device run spends no time on an API mistake."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "gpu_throughput.py"


def test_help_needs_no_cupy_and_no_gpu():
    proc = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr


def test_refuses_without_a_gpu_with_exit_2_and_nothing_on_stdout():
    from pagedserve.cupy_kernels.backend import cuda_available

    if cuda_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no usable GPU" in proc.stderr


def test_the_engine_path_on_a_small_config_on_the_cpu(monkeypatch):
    pytest.importorskip("tokenizers")
    pytest.importorskip("structlog")
    from pagedserve.models import llama
    from pagedserve.models.config import ModelConfig

    ns = runpy.run_path(str(BENCH), run_name="gpu_throughput_under_test")
    monkeypatch.setattr(llama.LlamaForCausalLM, "_put", llama.LlamaForCausalLM._put)  # restored after the test
    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, name="small")
    rng = np.random.default_rng(0)
    real_put = llama.LlamaForCausalLM._put

    def host_put(self, w):  # random host weights of the stand-in's shape
        return real_put(self, (rng.standard_normal(w.shape) * (0.5 if w.ndim > 1 else 0.0) + (w.ndim == 1))
                        .astype(np.float32))

    args = ns["parse_args"](["--requests", "6", "--max-model-len", "256", "--max-batched-tokens", "64"])
    engine = ns["build_engine"](args, cfg, device="cpu", put=host_put)
    prompts = [rng.integers(2, cfg.vocab_size, 20).tolist() for _ in range(6)]
    got = ns["run_requests"](engine, prompts, 9, 1.0)
    assert got["output_tokens"] == 6 * 9 and got["r0_tokens"] == 9
    assert got["steps"] >= 9 and 0 < got["first_token_s"] <= got["seconds"] and got["r0_decode_s"] >= 0
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_run_on_the_host_emulation_of_the_kernels(tmp_path, monkeypatch):
    """run() itself - engine on get_backend("cuda"), decode graphs (a fake capturer), the device sampler, the JSON -
    with every CUDA kernel on the host emulation and a tiny model of the same family in place of the 8B shape: what
    the device run would trip over first. Its figures mean nothing."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("structlog")
    import importlib.util
    import types
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.cupy_kernels import backend
    from pagedserve.cupy_kernels.cuda import launch as cuda_launch, modules as cuda_modules
    from pagedserve.models.config import ModelConfig
    from pagedserve.runtime import config as runtime_config
    from pagedserve.runtime.worker import cuda_graphs

    spec = importlib.util.spec_from_file_location("pagedserve_host_emulation_helpers_bench",
                                                  Path(__file__).with_name("test_kernels_on_host.py"))
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    if host.GXX is None:
        pytest.skip("g++ not found (needed to run the kernels on the CPU)")
    mods = list(cuda_modules.MODULES.values())
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda m: host._build(m, tmp_path), mods))
    cp = host.fake_cupy({m.name: host.load(p) for m, p in zip(mods, paths)})
    cp.__getattr__ = lambda name: getattr(np, name)
    cp.cuda.Device = lambda: types.SimpleNamespace(synchronize=lambda: None)
    rng = np.random.default_rng(0)
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype: rng.standard_normal(shape).astype(dtype).view(host.EmulatedArray))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "0")
    monkeypatch.setattr(cuda_modules, "_modules", {})
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_launch, "_dummies", {})
    monkeypatch.setattr(cuda_graphs, "CupyGraphCapturer", host.RecordingCapturer)
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    engine_config = runtime_config.EngineConfig  # no device memory to size the pool from: a fixed block count
    monkeypatch.setattr(runtime_config, "EngineConfig", lambda **kw: engine_config(
        **{**kw, "num_kv_blocks": 128, "cuda_graph_batch_sizes": (1, 2, 4, 8)}))
    from pagedserve.models import llama

    monkeypatch.setattr(llama.LlamaForCausalLM, "_put", llama.LlamaForCausalLM._put)  # restored after the test
    bench_spec = importlib.util.spec_from_file_location("gpu_throughput_under_test", BENCH)
    bench = importlib.util.module_from_spec(bench_spec)
    bench_spec.loader.exec_module(bench)
    bench.llama31_8b_config = lambda layers: ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, name="tiny-shape")
    args = bench.parse_args(["--layers", "2", "--requests", "8", "--input-len", "20", "--output-len", "6",
                             "--single-input", "8", "--single-output", "5", "--max-model-len", "256",
                             "--max-batched-tokens", "128"])
    out = bench.run(args)
    assert out["throughput"]["output_tokens"] == 8 * 6 and out["single_stream"]["output_tokens"] == 5
    assert out["cuda_graphs"]["enabled"] and out["cuda_graphs"]["replays"] > 0
    assert out["gemm_route"] == "cupy"  # no cuBLAS on the emulation: CuPy's matmul (numpy here)
    assert out["single_stream"]["ms_per_token"] > 0 and out["throughput"]["output_tok_per_s"] > 0
