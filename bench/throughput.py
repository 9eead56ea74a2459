"""Offline throughput on the embedded model (or --model): N requests x (128 prompt tokens, 128 output tokens).

Prints one JSON line per run: output and total tokens/s, model-FLOPs utilisation against the sgemm rate
measured in the same run, and mean KV token-slot utilisation. With --breakdown it also says where the
seconds went (matmuls, paged attention, the rest of the forward pass, the engine around it) and what
the output rate would be if the matmuls were the only cost. Usage:

    .venv/bin/python bench/throughput.py [--requests 64 256] [--prompt-len 128] [--output-len 128] [--breakdown]
        [--model gemma3-270m | PATH] [--kv-cache-dtype float32 bfloat16 float16] [--repeats 3]

With several settings (kernel sets, thread counts, KV dtypes) and --repeats R, each N runs them in turn R times
over (A B C A B C ...), so a neighbour's load on a shared host falls on all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import loadavg, machine, model_flops_per_token, read_gbps, sgemm_gflops  # noqa: E402

from pagedserve.cupy_kernels.host.blas_threads import blas_threads, reset_cpu_threads  # noqa: E402
from pagedserve.models.loading.loader import load_model  # noqa: E402
from pagedserve.sidecar.logging_setup import configure_logging  # noqa: E402
from pagedserve.runtime.config import EngineConfig  # noqa: E402
from pagedserve.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.runtime.sampling_params import SamplingParams  # noqa: E402


@contextmanager
def timed_parts(model, seconds: dict[str, float]):
    """Time every call of the forward pass and of its matmul and attention ops (the bench's own wrappers,
    put into a copy of the model's op table)."""
    def timer(fn, key):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - t0
        return wrapped

    backend, forward = model.backend, model.forward
    ops = backend.ops
    # The fused GEMMs count as matmuls: the gated MLP's up projection (linear_silu_and_mul: on the numba set the
    # SiLU runs in the GEMM's tiles), o_proj and down with the residual add (linear_add), qkv with the rotation
    # and the K/V slot writes (linear_rotary_cache).
    fused = {name: timer(getattr(ops, name), "linear") for name in ("linear_add", "linear_rotary_cache")
             if getattr(ops, name) is not None}
    model.backend = dataclasses.replace(backend, ops=dataclasses.replace(
        ops, linear=timer(ops.linear, "linear"), linear_silu_and_mul=timer(ops.linear_silu_and_mul, "linear"),
        paged_attention=timer(ops.paged_attention, "attention"), **fused))
    model.forward = timer(forward, "forward")
    try:
        yield
    finally:
        model.backend, model.forward = backend, forward


def run(loaded, num_requests: int, prompt_len: int, output_len: int, max_num_batched_tokens: int,
        breakdown: bool = False, cpu_kernels: str = "auto", cpu_threads: int | str | None = None,
        kv_cache_gib: float | None = None, kv_cache_dtype: str = "auto") -> dict:
    kv_bytes = int(kv_cache_gib * (1 << 30)) if kv_cache_gib else None
    engine = LLMEngine(EngineConfig(device="cpu", max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=256, seed=0, cpu_kernels=cpu_kernels, cpu_threads=cpu_threads,
                                    kv_cache_memory_bytes=kv_bytes, kv_cache_dtype=kv_cache_dtype),
                       loaded=loaded)
    # Touch every page of the KV pool before the clock starts, as a long-running server's pages are (and as
    # vLLM's zero-filled pool is at start): first-touch page faults cost ~2.5 s per GiB on the test VM and
    # would otherwise be charged to whichever steps first write each block.
    for k, v in engine.runner.kv_caches:
        k.fill(0)
        v.fill(0)
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), rng.integers(100, vocab, size=prompt_len).tolist(), params)
    utilisation, steps = [], 0
    seconds: dict[str, float] = defaultdict(float)
    with timed_parts(engine.model, seconds) if breakdown else nullcontext():
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            utilisation.append(engine.get_stats().kv_token_slot_utilization)
        elapsed = time.perf_counter() - t0
    out_tokens = num_requests * output_len
    cfg = loaded.config
    mean_ctx = prompt_len + output_len / 2
    flops = num_requests * (prompt_len * model_flops_per_token(cfg, prompt_len / 2, False)
                            + output_len * model_flops_per_token(cfg, mean_ctx, True))
    tuner = engine.threads_tuner
    return {"requests": num_requests, "cpu_kernels": engine.backend.ops.name,
            "kv_cache_dtype": engine.kv_layout.dtype, "kv_cache_dtype_requested": kv_cache_dtype,
            "cpu_threads": cpu_threads, "threads_switches": tuner.switches if tuner else None,
            "prompt_len": prompt_len, "output_len": output_len,
            "max_num_batched_tokens": max_num_batched_tokens, "steps": steps, "seconds": round(elapsed, 2),
            "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "total_tokens_per_s": round(num_requests * (prompt_len + output_len) / elapsed, 1),
            "model_gflops_per_s": round(flops / elapsed / 1e9, 1),
            "mean_kv_token_slot_utilization": round(float(np.mean(utilisation)), 4),
            "preemptions": engine.num_preemptions,
            **({"breakdown": _breakdown(seconds, elapsed, out_tokens)} if breakdown else {})}


def _breakdown(seconds: dict[str, float], elapsed: float, out_tokens: int) -> dict:
    linear, attention, forward = seconds["linear"], seconds["attention"], seconds["forward"]
    # To the microsecond: a short run's attention can total under half a millisecond (the tiny test model's
    # did, and rounded to 0.0).
    return {"seconds_matmuls": round(linear, 6), "seconds_attention": round(attention, 6),
            "seconds_rest_of_forward": round(forward - linear - attention, 6),
            "seconds_outside_forward": round(elapsed - forward, 6),
            "output_tokens_per_s_if_matmuls_were_all": round(out_tokens / linear, 1)}


def decode_weight_bytes(loaded, kernels: str) -> int:
    """Bytes of weights a one-row decode step reads (the tied lm_head counted once): float32 with the
    numpy set; with numba, the GGUF blocks of the matmul weights that have them (numba_quant.py) and
    float32 for the rest."""
    from pagedserve.cupy_kernels.kernel_set import cpu_kernels
    from pagedserve.models.loading.gguf_loader import is_quant_name

    blocks = cpu_kernels(kernels).name == "numba"
    quantized = {n.rsplit(".", 2)[0] for n in loaded.weights if is_quant_name(n)}
    return int(sum(w.nbytes for n, w in loaded.weights.items()
                   if (is_quant_name(n) and blocks) or (not is_quant_name(n) and not (blocks and n in quantized))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="what `pagedserve serve --model` takes: a packaged alias (gemma3-270m), a GGUF file or an HF "
                         "directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="CPU KV pool size (default: the engine's, 4 GiB; 256 requests x 256 tokens need 2.9)")
    ap.add_argument("--breakdown", action="store_true", help="time matmuls, attention and the rest separately")
    ap.add_argument("--cpu-kernels", nargs="+", default=["auto"], choices=["auto", "numba", "numpy"],
                    help="kernel sets to run, one after the other for each N (A/B in one run)")
    ap.add_argument("--cpu-threads", nargs="+", default=[None], type=lambda v: v if v == "auto" else int(v),
                    help="thread counts (or auto) to run, one after the other for each N and kernel set")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                    help="KV cache dtypes to run, one after the other for each N, kernel set and thread count")
    ap.add_argument("--repeats", type=int, default=1, help="run every setting this many times, interleaved")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be positive, got {args.repeats}")
    configure_logging(level="warning", stream=sys.stderr)
    loaded = load_model(args.model)
    gflops = sgemm_gflops()
    bandwidth = read_gbps()
    started_threads = blas_threads()
    for n in args.requests:
        settings = [(k, t, d) for k in args.cpu_kernels for t in args.cpu_threads for d in args.kv_cache_dtype]
        for repeat, (kernels, threads, kv_dtype) in [(r, s) for r in range(args.repeats) for s in settings]:
            result = run(loaded, n, args.prompt_len, args.output_len, args.max_num_batched_tokens, args.breakdown,
                         kernels, threads, args.kv_cache_gib, kv_dtype)
            result["repeat"] = repeat
            result["model"] = loaded.name
            result["kv_cache_gib"] = args.kv_cache_gib
            reset_cpu_threads(started_threads)  # each setting starts from the same state
            # MFU against the better of the sgemm rates measured before and after the run: on a VM whose
            # neighbours come and go one 1 s sample can be 15% low, and MFU would then read high.
            after = sgemm_gflops()
            result["sgemm_gflops"] = round(max(gflops, after), 1)
            result["sgemm_gflops_before_after"] = [round(gflops, 1), round(after, 1)]
            result["mfu"] = round(result["model_gflops_per_s"] / max(gflops, after), 3)
            result["gemv_read_gbps"] = round(bandwidth, 1)
            # one request: the time per token if every weight were read once per token at that bandwidth
            if n == 1:
                result["ms_per_output_token"] = round(1e3 * result["seconds"] / args.output_len, 2)
                weight_bytes = decode_weight_bytes(loaded, kernels)
                result["decode_weight_mb"] = round(weight_bytes / 1e6, 1)
                result["weights_read_ms_per_token"] = round(1e3 * weight_bytes / 1e9 / bandwidth, 2)
            result["machine"] = machine()
            result["loadavg"] = loadavg()
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
