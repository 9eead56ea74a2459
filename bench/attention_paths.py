"""The numba set's two paged-attention paths for one prefill chunk: the loop nest (numba_attention) and the
matmul path (numba_prefill; OpenBLAS until the packed GEMM replaced it, hence the "blas" JSON keys), timed
side by side over chunk sizes and context lengths (new tokens = context: a whole prompt), --sequences of them
in one call (16 x 128: a prefill step of bench/throughput.py). Where the matmul path wins sets
numba_prefill.MIN_TOKENS and its cost weights
(LOOP_NEST_PAIR_COST, MATMUL_FIXED_PAIRS). SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim
64, block 16) by default; the pool is larger than the L3 cache and its blocks shuffled, as in a server.

Prints one JSON line per (context, new tokens): milliseconds per layer for each path (median of --reps),
and the machine. Usage:

    .venv/bin/python bench/attention_paths.py [--contexts 128 512 2048 4000] [--new 16 32 64 128 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import loadavg, machine, sgemm_gflops  # noqa: E402

from pagedserve.cupy_kernels.numba_cpu import attention as na  # noqa: E402
from pagedserve.cupy_kernels.numba_cpu import prefill as numba_prefill  # noqa: E402
from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup  # noqa: E402


def batch(rng, context: int, new: int, heads: int, kv_heads: int, head_dim: int, block_size: int, pool_blocks: int,
          sequences: int = 1):
    k = rng.standard_normal((pool_blocks, block_size, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((pool_blocks, block_size, kv_heads, head_dim), dtype=np.float32)
    blocks = -(-context // block_size)
    table = rng.permutation(pool_blocks)[: sequences * blocks].reshape(sequences, blocks).astype(np.int32)
    q = rng.standard_normal((sequences * new, heads, head_dim), dtype=np.float32)
    return (q, k, v, np.arange(sequences + 1, dtype=np.int64) * new, np.full(sequences, context, np.int64), table)


def time_path(args_, invariant: bool, reps: int) -> float:
    """ms per call through the loop nest (invariant) or the matmul path (thresholds lifted)."""
    numba_setup.BATCH_INVARIANT = invariant
    limits = numba_prefill.MIN_TOKENS, numba_prefill.LOOP_NEST_PAIR_COST
    numba_prefill.MIN_TOKENS, numba_prefill.LOOP_NEST_PAIR_COST = 2, float("inf")
    try:
        na.paged_attention(*args_, 0.125)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            na.paged_attention(*args_, 0.125)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3
    finally:
        numba_setup.BATCH_INVARIANT = False
        numba_prefill.MIN_TOKENS, numba_prefill.LOOP_NEST_PAIR_COST = limits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 4000])
    ap.add_argument("--new", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--sequences", type=int, default=1, help="sequences of the same shape in one call")
    args = ap.parse_args()
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    pool_blocks = args.pool_mib * 2**20 // (block_size * kv_heads * head_dim * 4)
    rng = np.random.default_rng(0)
    gflops = sgemm_gflops()
    for context in args.contexts:
        for new in args.new:
            if new > context:
                continue
            b = batch(rng, context, new, heads, kv_heads, head_dim, block_size, pool_blocks, args.sequences)
            nest, blas = time_path(b, True, args.reps), time_path(b, False, args.reps)
            routed = bool(numba_prefill.takes_matmul_path(np.array([new]), np.array([context]))[0])
            print(json.dumps({"context": context, "new_tokens": new, "sequences": args.sequences,
                              "ms_loop_nest": round(nest, 3),
                              "ms_blas_path": round(blas, 3), "blas_faster": blas < nest, "routed_to_blas": routed,
                              "sgemm_gflops": round(gflops, 1), "machine": machine(), "loadavg": loadavg()}),
                  flush=True)


if __name__ == "__main__":
    main()
