"""Parallel sampling memory: peak KV blocks of one request with n samples vs n independent requests.

The n samples fork the prompt's blocks by ref count (only the partial last block is copied on a
sample's first write); the baseline is n separate requests with prefix caching off, each holding its
own copy of the prompt. Prints one JSON line per n.

    .venv/bin/python bench/parallel_sampling.py [--model PATH] [--prompt-len 512] [--n 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from pagedserve.models.loading.loader import load_model  # noqa: E402
from pagedserve.runtime.config import EngineConfig  # noqa: E402
from pagedserve.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.runtime.sampling_params import SamplingParams  # noqa: E402


def peak_blocks(engine: LLMEngine) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_manager.usage().num_used_blocks)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    loaded = load_model(args.model)
    prompt = np.random.default_rng(0).integers(100, loaded.config.vocab_size, size=args.prompt_len).tolist()
    cfg = dict(device="cpu", seed=0, enable_prefix_caching=False)
    for n in args.n:
        shared = LLMEngine(EngineConfig(**cfg), loaded=loaded)
        shared.add_request("r", prompt, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=args.max_tokens,
                                                       ignore_eos=True))
        with_sharing = peak_blocks(shared)
        alone = LLMEngine(EngineConfig(**cfg), loaded=loaded)
        for i in range(n):
            alone.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=1 + i, max_tokens=args.max_tokens,
                                                              ignore_eos=True))
        without = peak_blocks(alone)
        prompt_blocks = args.prompt_len // shared.block_size
        print(json.dumps({
            "benchmark": "parallel_sampling", "n": n, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "block_size": shared.block_size, "peak_blocks_shared": with_sharing, "peak_blocks_independent": without,
            "ratio": round(with_sharing / without, 3),
            "memory_saved": round(1 - with_sharing / without, 3),
            "prompt_memory_saved": round((n - 1) * prompt_blocks / (n * prompt_blocks), 3),
            "machine": machine(),
        }), flush=True)


if __name__ == "__main__":
    main()
