"""A sliding-window layer's attention against a global one's, per token, at a long context (issue #35: "a
sliding-window layer must cost no more per token than a global one at 2,000 tokens"). The CPU kernel sets
(numba by default, --set numpy for the reference), Gemma 3 270M's attention shapes (4 query heads, 1 kv head,
head_dim 256, window 512, block 16), a pool larger than the L3 cache with shuffled blocks, as in a server.

Cases, each timed with sliding_window=None and =--window (median of --reps interleaved rounds, ms per call
and us per token): --decodes sequences decoding one token at --context; one prefill chunk of --chunk new tokens
ending at --context. Prints one JSON object. Usage:

    .venv/bin/python bench/sliding_window.py [--context 2000] [--window 512] [--decodes 16] [--chunk 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import emit_json, loadavg, machine  # noqa: E402

from pagedserve.cupy_kernels.numba_cpu import attention as na  # noqa: E402
from pagedserve.cupy_kernels.reference import paged_attention as pa  # noqa: E402


def make_batch(rng, context: int, new: int, sequences: int, args):
    blocks = -(-context // args.block_size)
    pool = max(sequences * blocks + 1, (256 << 20) // (args.block_size * args.head_dim * 4))  # 256 MiB a cache
    k = rng.standard_normal((pool, args.block_size, 1, args.head_dim), dtype=np.float32)
    v = rng.standard_normal((pool, args.block_size, 1, args.head_dim), dtype=np.float32)
    tables = rng.permutation(pool)[: sequences * blocks].reshape(sequences, blocks).astype(np.int32)
    q = rng.standard_normal((sequences * new, args.heads, args.head_dim), dtype=np.float32)
    return q, k, v, np.arange(sequences + 1, dtype=np.int64) * new, np.full(sequences, context, np.int64), tables


def time_case(attention, batch, window: int, reps: int) -> dict:
    tokens = batch[0].shape[0]
    scale = batch[0].shape[2] ** -0.5
    runs: dict[str, list[float]] = {"global": [], "sliding": []}
    for kind, w in (("global", None), ("sliding", window)):  # warm up (compile, first touch)
        attention(*batch, scale, sliding_window=w)
    for _ in range(reps):  # interleaved, so a busy moment of the shared host hits both
        for kind, w in (("global", None), ("sliding", window)):
            t0 = time.perf_counter()
            attention(*batch, scale, sliding_window=w)
            runs[kind].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for kind, ms in runs.items():
        med = statistics.median(ms)
        out[kind] = {"ms": round(med, 3), "us_per_token": round(med * 1e3 / tokens, 2),
                     "min_ms": round(min(ms), 3)}
    out["sliding_over_global"] = round(out["sliding"]["ms"] / out["global"]["ms"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", choices=["numba", "numpy"], default="numba")
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    attention = na.paged_attention if args.set == "numba" else pa.paged_attention
    rng = np.random.default_rng(0)

    def run() -> dict:
        result = {"set": args.set, "context": args.context, "window": args.window, "heads": args.heads,
                  "kv_heads": 1, "head_dim": args.head_dim, "block_size": args.block_size, "reps": args.reps,
                  "loadavg_before": loadavg()}
        decode = make_batch(rng, args.context, 1, args.decodes, args)
        result[f"decode_{args.decodes}_seqs"] = time_case(attention, decode, args.window, args.reps)
        del decode
        chunk = make_batch(rng, args.context, args.chunk, 1, args)
        result[f"prefill_chunk_{args.chunk}"] = time_case(attention, chunk, args.window, args.reps)
        result["loadavg_after"] = loadavg()
        result["machine"] = machine()
        return result

    emit_json(run)


if __name__ == "__main__":
    main()
