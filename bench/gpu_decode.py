"""Decode step time on the GPU for a random-weight model of Llama-3.1-8B's shape, in float16.

Prints one JSON object on stdout, and nothing else there (logs go to stderr): for each batch size (1,
16, 64, 256 by default) every sequence decodes one token at a --context-token context; the step time
(LlamaForCausalLM.forward, logits included) is set next to the HBM roofline, (weights + KV cache read) /
peak bandwidth. Three figures per batch: `step_ms` with the batch metadata already on the device (the
kernels alone, launched eagerly); `step_ms_host_metadata` with numpy metadata, which the forward checks
and uploads once per step (models/device_batch.py: what an eager engine step costs); and
`step_ms_graph`, the same host metadata through runtime/worker/cuda_graphs.py (padding, two uploads into static
buffers, one graph launch: what an engine decode step costs with CUDA graphs on). `graph_speedup` =
host-metadata eager / graph. A capture failure does not stop the benchmark:
`cuda_graphs.disabled_reason` says why, and the graph figures are null.

Weights are random (values do not change the timing) and generated on the device: the model's
`_put` hook is overridden so that 16 GB never pass through host memory. That hook is the one place
this couples to models/llama.py internals. Imports only numpy, CuPy and pagedserve's GPU path.

    python bench/gpu_decode.py [--batches 1 16 64 256] [--context 1024] [--layers 32] [--steps 10] [--no-graphs]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, gpu_seconds  # noqa: E402

try:
    import pagedserve.models.llama  # noqa: F401
except ImportError as e:
    sys.exit(f"bench/gpu_decode.py: pagedserve is not importable ({e}); pip install -e . or see scripts/gpu_check.sh")

from pagedserve.cupy_kernels.backend import get_backend  # noqa: E402
from pagedserve.models.batch import ForwardBatch  # noqa: E402
from pagedserve.models.config import ModelConfig  # noqa: E402
from pagedserve.models.kv_cache import allocate_kv_caches, kv_bytes_per_block  # noqa: E402
from pagedserve.models.llama import LlamaForCausalLM, expected_shapes  # noqa: E402
from pagedserve.runtime.worker.cuda_graphs import CupyGraphCapturer, DecodeGraphs  # noqa: E402


def llama31_8b_config(layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        name="random-llama-3.1-8b-shape")


class RandomDeviceLlama(LlamaForCausalLM):
    """Weights are drawn on the device with the shape of whatever the constructor uploads."""

    def _put(self, w):
        import cupy as cp

        if w.ndim == 1:  # norm weights
            return cp.ones(w.shape, dtype=cp.float16)
        std = np.float32(0.5 / np.sqrt(max(w.shape)))
        return (cp.random.standard_normal(w.shape, dtype=cp.float32) * std).astype(cp.float16)


def build_model(cfg: ModelConfig) -> LlamaForCausalLM:
    # Zero-stride stand-ins: the constructor only reads their shapes (and concatenates q/k/v, gate/up).
    stand_ins = {name: np.broadcast_to(np.float16(0), shape) for name, shape in expected_shapes(cfg).items()}
    return RandomDeviceLlama(cfg, stand_ins, get_backend("cuda"))


def decode_batch(xp, batch: int, context: int, block_size: int, vocab: int) -> ForwardBatch:
    """`batch` sequences, each decoding its token at position context - 1, on disjoint blocks."""
    nb = -(-context // block_size)
    tables = np.arange(batch * nb, dtype=np.int32).reshape(batch, nb)
    pos = context - 1
    rng = np.random.default_rng(batch)
    fields = dict(
        input_ids=rng.integers(0, vocab, size=batch).astype(np.int64),
        positions=np.full(batch, pos, dtype=np.int64),
        slot_mapping=(tables[:, pos // block_size].astype(np.int64) * block_size + pos % block_size),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        seq_lens=np.full(batch, context, dtype=np.int32),
        block_tables=tables,
        logits_indices=np.arange(batch, dtype=np.int64),
    )
    return ForwardBatch(**{k: xp.asarray(v) for k, v in fields.items()})


def time_steps(cp, step, batch, steps: int) -> float:
    """Mean ms of `step(batch)` (a forward, or a graph run) between events on the current stream."""
    seconds, logits = gpu_seconds(cp, lambda: step(batch), steps)
    assert logits.shape[0] == batch.num_seqs
    return seconds * 1e3


def capture_graphs(model, kv, batches, max_blocks: int) -> DecodeGraphs:
    graphs = DecodeGraphs(model, kv, tuple(batches), max_blocks, CupyGraphCapturer())
    graphs.capture_all()  # on failure: disabled_reason set, graphs.run returns None
    return graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per sequence (new one included)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tbps", type=float, default=4.8)
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA graph figures")
    args = parser.parse_args()
    emit_json(lambda: run(args))


def run(args: argparse.Namespace) -> dict:
    import cupy as cp

    cfg = llama31_8b_config(args.layers)
    t0 = time.perf_counter()
    model = build_model(cfg)
    cp.cuda.Device().synchronize()
    build_s = time.perf_counter() - t0
    weight_bytes = sum(int(np.prod(s)) for s in expected_shapes(cfg).values()) * 2
    # Bytes a decode step must read: every weight except the embedding table (B rows of it).
    read_weight_bytes = weight_bytes - cfg.vocab_size * cfg.hidden_size * 2
    nb = -(-args.context // args.block_size)
    kv = allocate_kv_caches(cfg, max(args.batches) * nb, args.block_size, get_backend("cuda"))
    kv_bytes_per_token = kv_bytes_per_block(cfg, args.block_size, 2) // args.block_size
    graphs = None
    if not args.no_graphs:
        t0 = time.perf_counter()
        graphs = capture_graphs(model, kv, args.batches, nb)
        graph_info = {"captured": graphs.enabled, "batch_sizes": list(graphs.sizes),
                      "table_widths": list(graphs.widths), "num_graphs": len(graphs.captured),
                      "capture_s": round(time.perf_counter() - t0, 2), "disabled_reason": graphs.disabled_reason,
                      "pool_bytes": graphs.capturer.pool_bytes() if graphs.enabled else 0}
    else:
        graph_info = {"captured": False, "disabled_reason": "--no-graphs"}
    results = []
    for b in args.batches:
        host_batch = decode_batch(np, b, args.context, args.block_size, cfg.vocab_size)
        step_ms = time_steps(cp, lambda x: model.forward(x, kv),
                             decode_batch(cp, b, args.context, args.block_size, cfg.vocab_size), args.steps)
        host_ms = time_steps(cp, lambda x: model.forward(x, kv), host_batch, max(2, args.steps // 2))
        graph_ms = None
        if graphs is not None and graphs.enabled:
            graph_ms = time_steps(cp, graphs.run, host_batch, args.steps)
        kv_read = b * args.context * kv_bytes_per_token
        roofline_ms = (read_weight_bytes + kv_read) / (args.peak_tbps * 1e12) * 1e3
        results.append({
            "batch": b, "step_ms": round(step_ms, 3), "step_ms_host_metadata": round(host_ms, 3),
            "step_ms_graph": None if graph_ms is None else round(graph_ms, 3),
            "graph_speedup": None if graph_ms is None else round(host_ms / graph_ms, 2),
            "roofline_ms": round(roofline_ms, 3), "pct_of_roofline": round(100 * roofline_ms / step_ms, 1),
            "tokens_per_s": round(b / step_ms * 1e3, 1), "kv_bytes_read": kv_read,
        })
    return {
        "benchmark": "decode_step", "model": cfg.name, "layers": cfg.num_hidden_layers, "dtype": "float16",
        "context": args.context, "block_size": args.block_size, "weight_bytes": weight_bytes,
        "weights_read_per_step_bytes": read_weight_bytes, "peak_tbps": args.peak_tbps,
        "model_build_s": round(build_s, 1), "cuda_graphs": graph_info, "results": results,
    }


if __name__ == "__main__":
    main()
