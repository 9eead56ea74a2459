"""Prefix caching: TTFT of requests sharing a 500-token system prompt, with the cache on and off.

A first wave of requests fills the cache; a second wave with the same system prompt (and different
user turns) should find it and finish its prefill faster. Prints one JSON line; TTFT is measured
per request from arrival to first token, each request alone so that it is the prefill's cost.

    .venv/bin/python bench/prefix_cache.py [--model PATH] [--requests 8]
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
from common import machine, sgemm_gflops  # noqa: E402

from pagedserve.models.loading.loader import load_model  # noqa: E402
from pagedserve.runtime.config import EngineConfig  # noqa: E402
from pagedserve.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.runtime.sampling_params import SamplingParams  # noqa: E402


def ttfts(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[list[float], list[int], list[list[int]]]:
    times, cached, tokens = [], [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if out.finished:
                    cached.append(out.num_cached_tokens)
                    tokens.append(out.outputs[0].token_ids)
        times.append(first)
    return times, cached, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=500)
    args = ap.parse_args()
    loaded = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    system = rng.integers(100, vocab, size=args.system_len).tolist()
    users = [rng.integers(100, vocab, size=int(rng.integers(10, 40))).tolist() for _ in range(2 * args.requests)]
    wave1 = [system + u for u in users[: args.requests]]
    wave2 = [system + u for u in users[args.requests :]]
    results = {}
    outputs = {}
    for caching in (False, True):
        e = LLMEngine(EngineConfig(device="cpu", enable_prefix_caching=caching, seed=0), loaded=loaded)
        first, _, _ = ttfts(e, wave1, "a")
        second, cached, toks = ttfts(e, wave2, "b")
        outputs[caching] = toks
        results["on" if caching else "off"] = {
            "wave1_ttft_s_mean": round(float(np.mean(first)), 4),
            "wave2_ttft_s_mean": round(float(np.mean(second)), 4),
            "wave2_cached_tokens_mean": float(np.mean(cached)),
            "hit_rate_tokens": round(e.get_stats().prefix_cache_hit_rate, 4),
        }
    print(json.dumps({
        "benchmark": "prefix_cache", "requests_per_wave": args.requests, "system_prompt_tokens": args.system_len,
        **results,
        "wave2_ttft_speedup": round(results["off"]["wave2_ttft_s_mean"] / results["on"]["wave2_ttft_s_mean"], 2),
        "outputs_identical": outputs[True] == outputs[False],
        "sgemm_gflops": round(sgemm_gflops(), 1), "machine": machine(),
    }))


if __name__ == "__main__":
    main()
