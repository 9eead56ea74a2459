"""Tensor parallelism on CPU: TP=2 (two rank processes, 1 BLAS thread each) against TP=1 (1 and 2 threads).

Prints JSON lines: for each setting, offline throughput (N requests x prompt/output tokens) and
single-stream latency (time to first token, mean time per output token); then the shared-memory
all-reduce's microseconds per call at the model's hidden size, for 1 and 64 rows (what one decode step
of batch 1 and 64 pays, twice per layer).

The embedded SmolLM2-135M has 9 attention heads, which 2 ranks cannot split, so by default the bench
writes a model of SmolLM2-135M's shape with 8 heads of 72 (hidden 576 = 8 x 72, 2 KV heads, 30 layers,
intermediate 1536, vocabulary 49152, tied embeddings; random weights, the embedded tokenizer) to a
temporary directory. Its matmuls and KV sizes are SmolLM2's to within 1 %; its tokens are noise
(ignore_eos keeps every run at full length). Usage:

    .venv/bin/python bench/tensor_parallel.py [--model DIR] [--requests 32] [--prompt-len 64] [--output-len 32]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, sgemm_gflops  # noqa: E402

from pagedserve.cupy_kernels.collectives import ShmCommunicator  # noqa: E402
from pagedserve.models.loading.loader import load_model  # noqa: E402
from pagedserve.runtime.config import EngineConfig  # noqa: E402
from pagedserve.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.runtime.sampling_params import SamplingParams  # noqa: E402
from pagedserve.sidecar.logging_setup import configure_logging  # noqa: E402

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=2, head_dim=72, vocab_size=49152)


def write_smollm2_shaped_model(root: Path) -> Path:
    """A random-weight Llama of SmolLM2-135M's shape that 2 ranks can split (see the module docstring)."""
    from safetensors.numpy import save_file

    tok = load_model(None).tokenizer
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2, **SHAPE}
    h, i, v, L = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"], SHAPE["num_hidden_layers"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32)}
    for n in range(L):
        p = f"model.layers.{n}."
        weights.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                        p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                        p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                        p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                        p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                        p + "mlp.down_proj.weight": w(h, i)})
    root.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text(tok.backend.to_str())
    return root


def run_engine(model: str, tp: int, threads: int, requests: int, prompt_len: int, output_len: int) -> dict:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", tensor_parallel_size=tp, cpu_threads=threads,
                                    max_num_batched_tokens=2048, max_num_seqs=256, seed=0,
                                    kv_cache_memory_bytes=1 << 30))
    rng = np.random.default_rng(0)
    try:
        def generate(n: int, out_len: int) -> tuple[float, list[float]]:
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            for k in range(n):
                prompt = rng.integers(3, min(engine.model_config.vocab_size, 20000), prompt_len).tolist()
                engine.add_request(f"r{time.monotonic_ns()}-{k}", prompt, params)
            t0, stamps = time.perf_counter(), []
            while engine.has_unfinished_requests():
                if engine.step():
                    stamps.append(time.perf_counter())
            return time.perf_counter() - t0, [s - t0 for s in stamps]

        generate(2, 4)  # warm-up (first-touch of weights and KV pages)
        seconds, _ = generate(requests, output_len)
        _, stamps = generate(1, output_len)  # single stream
        per_token = np.diff(stamps)
        return {"bench": "tensor_parallel", "tensor_parallel_size": tp, "blas_threads_per_rank": threads,
                "requests": requests, "prompt_len": prompt_len, "output_len": output_len,
                "output_tokens_per_s": round(requests * output_len / seconds, 1),
                "total_tokens_per_s": round(requests * (prompt_len + output_len) / seconds, 1),
                "single_stream_ttft_ms": round(stamps[0] * 1e3, 1),
                "single_stream_ms_per_output_token": round(float(per_token.mean()) * 1e3, 2)}
    finally:
        engine.shutdown()


def _allreduce_peer(name: str, rows_list: list[int], hidden: int, iters: int, wake) -> None:
    comm = ShmCommunicator(name, 1, 2, timeout_s=60.0, wake=wake)
    for rows in rows_list:
        x = np.ones((rows, hidden), np.float32)
        for _ in range(10 + 20 * max(1, iters // 20)):
            comm.all_reduce(x)
    comm.close()


def allreduce_us(hidden: int, rows_list: list[int], iters: int = 2000) -> dict:
    """Median microseconds per all-reduce between 2 processes, timed on rank 0 over batches of calls."""
    ctx = mp.get_context("spawn")
    wake = [ctx.Semaphore(0) for _ in range(2)]  # as the executor sets it up
    root = ShmCommunicator(None, 0, 2, create=True, timeout_s=60.0, wake=wake)
    peer = ctx.Process(target=_allreduce_peer, args=(root.name, rows_list, hidden, iters, wake))
    peer.start()
    out = {}
    try:
        for rows in rows_list:
            x = np.ones((rows, hidden), np.float32)
            for _ in range(10):
                root.all_reduce(x)
            batches = []
            per = max(1, iters // 20)
            for _ in range(20):
                t0 = time.perf_counter()
                for _ in range(per):
                    root.all_reduce(x)
                batches.append((time.perf_counter() - t0) / per)
            out[f"rows_{rows}"] = round(float(np.median(batches)) * 1e6, 1)
    finally:
        peer.join(60)
        root.close()
    return {"bench": "allreduce_shm", "world_size": 2, "hidden": hidden, "us_per_call": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF directory or .gguf that 2 ranks can split")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--allreduce-iters", type=int, default=2000)
    args = ap.parse_args()
    configure_logging(level="warning", stream=sys.stderr)
    print(json.dumps({"bench": "machine", **machine(), "sgemm_gflops": round(sgemm_gflops(), 1)}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_smollm2_shaped_model(Path(tmp) / "smollm2-shaped-8x72"))
        hidden = load_model(model).config.hidden_size if args.model else SHAPE["hidden_size"]
        for tp, threads in [(1, 1), (1, 2), (2, 1)]:
            print(json.dumps(run_engine(model, tp, threads, args.requests, args.prompt_len, args.output_len)),
                  flush=True)
    print(json.dumps(allreduce_us(hidden, [1, 64], args.allreduce_iters)), flush=True)


if __name__ == "__main__":
    main()
