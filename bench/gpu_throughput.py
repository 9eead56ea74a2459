"""The whole engine on the GPU (scheduler, decode graphs, sampler) with a Llama-3.1-8B-shaped model: output tok/s
of many requests, and ms per token of one stream.

The model is Llama-3.1-8B's shape (32 layers by default), float16, with random weights drawn on the device (the
model's `_put` hook, as bench/gpu_decode.py does: nothing downloaded, 16 GB never in host memory), behind a
one-word tokenizer (prompts are token ids; output ids decode to nothing). Every request ignores EOS, so each
makes exactly its --output-len tokens.

  1. throughput: --requests requests of --input-len random prompt tokens and --output-len output tokens, all
     added at once, stepped until done: output tok/s (and prompt + output tok/s) over the wall time;
  2. one stream: --single-input -> --single-output tokens: time to the first token, then ms per output token
     beside its floor, (weights + the stream's KV at its mean context) / --peak-tbps.
Also: whether decode graphs were captured (and replayed), and which GEMM route `linear` took
(cupy_kernels/cuda/cublas_route.py). Goals (#44): > 15,000 output tok/s at 256 x (128 in, 128 out); one
stream within 1.3x of its floor. One JSON object on stdout (logs go to stderr); exit 2 without a usable GPU.

    python bench/gpu_throughput.py [--layers 32] [--requests 256] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json  # noqa: E402

try:
    from gpu_decode import RandomDeviceLlama, llama31_8b_config  # noqa: E402
except ImportError as e:
    sys.exit(f"bench/gpu_throughput.py: pagedserve is not importable ({e}); pip install -e . or see "
             "scripts/gpu_check.sh")

MAX_STEPS = 100_000  # every loop here is bounded


def one_word_tokenizer():
    """A tokenizer of one word: the engine detokenizes every output, and ids past its vocabulary decode to ''."""
    import tokenizers

    from pagedserve.models.tokenizer.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>"))
    return Tokenizer(backend, unk_token="<unk>", add_bos_token=False, add_eos_token=False)


def build_engine(args: argparse.Namespace, cfg, device: str = "cuda", put=RandomDeviceLlama._put):
    """An LLMEngine serving `cfg` with weights made by `put` (default: random, drawn on the device). The CPU
    test of this benchmark passes a small config, device "cpu" and a host `put`."""
    from pagedserve.models import llama
    from pagedserve.models.llama import expected_shapes
    from pagedserve.models.loading.loader import LoadedModel
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    # Zero-stride stand-ins (the constructor reads only their shapes); `put` makes the weights.
    stand_ins = {name: np.broadcast_to(np.float16(0), shape) for name, shape in expected_shapes(cfg).items()}
    llama.LlamaForCausalLM._put = put
    loaded = LoadedModel(cfg, stand_ins, one_word_tokenizer(), Path("random-weights"), cfg.name, 0.0, False)
    config = EngineConfig(device=device, max_num_seqs=args.requests, max_num_batched_tokens=args.max_batched_tokens,
                          max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                          block_size=args.block_size, seed=0)
    return LLMEngine(config, loaded=loaded)


def run_requests(engine, prompts: list[list[int]], output_len: int, temperature: float) -> dict:
    """Add every prompt, step until all finish: wall seconds, output tokens, steps, and the first and last token
    times of the first request (for one stream)."""
    from pagedserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out_tokens, steps, first, last, seen = 0, 0, None, None, 0
    while engine.has_unfinished_requests():
        if steps >= MAX_STEPS:
            raise RuntimeError(f"requests unfinished after {MAX_STEPS} steps")
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outputs:
            if o.request_id == "r0" and len(o.outputs[0].token_ids) > seen:
                seen = len(o.outputs[0].token_ids)
                first = now if first is None else first
                last = now
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
    return {"seconds": time.perf_counter() - t0, "output_tokens": out_tokens, "steps": steps,
            "first_token_s": None if first is None else first - t0, "r0_tokens": seen,
            "r0_decode_s": None if first is None else last - first}


def run(args: argparse.Namespace) -> dict:
    import cupy as cp

    from pagedserve.cupy_kernels.cuda import cublas_route
    from pagedserve.models.kv_cache import kv_bytes_per_block
    from pagedserve.models.llama import expected_shapes

    t0 = time.perf_counter()
    cfg = llama31_8b_config(args.layers)
    engine = build_engine(args, cfg)
    cp.cuda.Device().synchronize()
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    warm = run_requests(engine, [rng.integers(2, cfg.vocab_size, 16).tolist() for _ in range(2)], 4, args.temperature)
    graphs = engine.runner.graphs
    replays_before = graphs.num_replays if graphs is not None else 0

    prompts = [rng.integers(2, cfg.vocab_size, args.input_len).tolist() for _ in range(args.requests)]
    many = run_requests(engine, prompts, args.output_len, args.temperature)
    one = run_requests(engine, [rng.integers(2, cfg.vocab_size, args.single_input).tolist()], args.single_output,
                       args.temperature)

    weight_bytes = sum(int(np.prod(s)) for s in expected_shapes(cfg).values()) * 2
    read_weight_bytes = weight_bytes - cfg.vocab_size * cfg.hidden_size * 2  # one embedding row per token
    kv_per_token = kv_bytes_per_block(cfg, args.block_size, 2) // args.block_size
    mean_ctx = args.single_input + args.single_output / 2
    floor_ms = (read_weight_bytes + mean_ctx * kv_per_token) / (args.peak_tbps * 1e12) * 1e3
    ms_per_token = one["r0_decode_s"] / max(1, one["r0_tokens"] - 1) * 1e3 if one["r0_decode_s"] else None
    out_tps = many["output_tokens"] / many["seconds"]
    return {
        "benchmark": "engine_throughput", "model": cfg.name, "layers": cfg.num_hidden_layers, "dtype": "float16",
        "weights": "random, drawn on the device", "temperature": args.temperature,
        "engine_build_s": round(build_s, 1), "warm_up_s": round(warm["seconds"], 2),
        "gemm_route": cublas_route.chosen_route(),
        "cuda_graphs": {"enabled": graphs is not None and bool(getattr(graphs, "enabled", True)),
                        "replays": (graphs.num_replays - replays_before) if graphs is not None else 0},
        "throughput": {
            "requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
            "seconds": round(many["seconds"], 3), "steps": many["steps"], "output_tokens": many["output_tokens"],
            "output_tok_per_s": round(out_tps, 1),
            "total_tok_per_s": round((many["output_tokens"] + args.requests * args.input_len) / many["seconds"], 1),
            "goal_output_tok_per_s": 15000, "meets_goal": out_tps > 15000,
        },
        "single_stream": {
            "input_len": args.single_input, "output_len": args.single_output, "output_tokens": one["r0_tokens"],
            "ttft_ms": None if one["first_token_s"] is None else round(one["first_token_s"] * 1e3, 2),
            "ms_per_token": None if ms_per_token is None else round(ms_per_token, 3),
            "floor_ms_per_token": round(floor_ms, 3), "peak_tbps": args.peak_tbps,
            "x_floor": None if ms_per_token is None else round(ms_per_token / floor_ms, 2),
            "goal_x_floor": 1.3,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--single-input", type=int, default=32)
    parser.add_argument("--single-output", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--peak-tbps", type=float, default=4.8)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    from pagedserve.cupy_kernels.backend import cuda_available

    if not cuda_available():
        print("bench/gpu_throughput.py: no usable GPU (CuPy is not importable or sees no CUDA device); this "
              "benchmark runs only on a GPU", file=sys.stderr)
        sys.exit(2)
    emit_json(lambda: run(args))


if __name__ == "__main__":
    main()
