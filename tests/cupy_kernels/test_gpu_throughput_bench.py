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
