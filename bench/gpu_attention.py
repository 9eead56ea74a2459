"""Paged attention on the GPU: effective HBM bandwidth of decode batches, and prefill throughput.

Prints one JSON object on stdout, and nothing else there (logs go to stderr). The headline case is
Llama-3.1-8B's attention shape (32 query heads, 8 kv heads, head dim 128) for a batch of 64 decodes at a
4096-token context, block size 16: bytes moved (K and V of every context token, plus the queries and
outputs) / kernel time, as a share of the H200's 4.8 TB/s. Batch metadata lives on the device (no host
copies inside the timed loop), block tables are shuffled over the pool. Imports only numpy, CuPy and
pagedserve's CUDA op layer.

    python bench/gpu_attention.py [--peak-tbps 4.8] [--iters 50]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json  # noqa: E402

try:  # run from a checkout without installing: the repository's folders are pagedserve's subpackages
    import pagedserve.cupy_kernels  # noqa: F401
except ImportError:
    sys.exit("bench/gpu_attention.py: pagedserve is not importable (pip install -e . or see scripts/gpu_check.sh)")

from pagedserve.cupy_kernels.cuda import ops as cuda_ops  # noqa: E402
from pagedserve.cupy_kernels.kernel_set import cuda_kernels  # noqa: E402

paged_attention = cuda_kernels().paged_attention  # the CUDA op table: device arrays only

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B


def _case(cp, name: str, specs: list[tuple[int, int]], block_size: int, iters: int, peak_tbps: float) -> dict:
    """specs: (seq_len, num_new_tokens) per sequence."""
    rng = np.random.default_rng(0)
    lens = np.array([s for s, _ in specs], dtype=np.int32)
    news = np.array([n for _, n in specs], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    needed = -(-lens // block_size)
    num_blocks = int(needed.sum())
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(specs), int(needed.max())), dtype=np.int32)
    at = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = perm[at: at + nb]
        at += nb
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    num_tokens = int(qsl[-1])
    q = cp.random.standard_normal((num_tokens, HEADS, HEAD_DIM), dtype=cp.float32).astype(cp.float16)
    meta = [cp.asarray(qsl), cp.asarray(lens), cp.asarray(tables)]
    scale = HEAD_DIM ** -0.5
    for _ in range(3):
        out = paged_attention(q, k, v, *meta, scale)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        out = paged_attention(q, k, v, *meta, scale)
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3 / iters
    assert bool(cp.isfinite(out).all())
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
    qo_bytes = 2 * num_tokens * HEADS * HEAD_DIM * 2
    # Causal attention work: each query token sees its position + 1 keys.
    visible = sum(int(s) * n - n * (n - 1) // 2 for s, n in zip(lens, news))
    flops = 4 * HEADS * HEAD_DIM * visible  # QK^T and PV, 2 flops per multiply-add
    tbps = (kv_bytes + qo_bytes) / seconds / 1e12
    return {
        "case": name, "num_seqs": len(specs), "num_tokens": num_tokens, "max_seq_len": int(lens.max()),
        "block_size": block_size, "time_us": round(seconds * 1e6, 2), "kv_bytes": kv_bytes,
        "effective_tbps": round(tbps, 3), "pct_of_peak_bandwidth": round(100 * tbps / peak_tbps, 1),
        "tflops": round(flops / seconds / 1e12, 2),
        "partitions_per_long_decode": math.ceil(int(lens.max()) / cuda_ops.PARTITION_SIZE),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth to compare against (H200: 4.8)")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    emit_json(lambda: run(args))


def run(args: argparse.Namespace) -> dict:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    cases = [
        _case(cp, "decode_b64_ctx4096_bs16", [(4096, 1)] * 64, 16, args.iters, args.peak_tbps),
        _case(cp, "decode_b64_ctx4096_bs32", [(4096, 1)] * 64, 32, args.iters, args.peak_tbps),
        _case(cp, "decode_b256_ctx1024_bs16", [(1024, 1)] * 256, 16, args.iters, args.peak_tbps),
        _case(cp, "decode_b8_ctx32768_bs16", [(32768, 1)] * 8, 16, args.iters, args.peak_tbps),
        _case(cp, "prefill_1x2048_fresh_bs16", [(2048, 2048)], 16, max(3, args.iters // 10), args.peak_tbps),
        _case(cp, "mixed_63dec4096_1x512chunk_bs16", [(4096, 1)] * 63 + [(4096, 512)], 16, max(3, args.iters // 5),
              args.peak_tbps),
    ]
    headline = cases[0]
    return {
        "benchmark": "paged_attention", "device": name, "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                                    "head_dim": HEAD_DIM},
        "peak_tbps": args.peak_tbps, "headline_case": headline["case"],
        "headline_pct_of_peak_bandwidth": headline["pct_of_peak_bandwidth"], "cases": cases,
    }


if __name__ == "__main__":
    main()
