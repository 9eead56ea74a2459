"""KV cache dtypes against float32 KV (issue 64, item 5): what storing K and V in 16 bits costs in quality.

For each kv_cache_dtype, the same model and prompts as a float32-KV engine (both on the CPU kernel set asked for):

  greedy agreement      share of the prompts whose --max-tokens greedy tokens are all identical to float32's; for
                        each divergence, float32's top-2 logprob margin where it happened (a small margin: a near
                        tie that any rounding may flip)
  |delta logprob|       mean and max over the chosen tokens both runs share (same context, before any divergence)
  perplexity            teacher-forced over --ppl-tokens tokens of a public-domain text in the repo
                        (bench/data/coriolanus_act1.txt: Shakespeare, Coriolanus, act 1, scenes 1-2), in chunks of
                        --ppl-chunk tokens through the dtype's pool, so later chunks read the stored K and V

The prompts are --prompts windows of --prompt-len tokens of the same text at evenly spaced offsets. Usage:

    .venv/bin/python bench/kv_quality.py [--quick] [--model PATH] [--prompts 64] [--max-tokens 128] [--out-dir DIR]

The full size (64 prompts x 128 tokens, SmolLM2) takes many minutes of a quiet machine; --quick is 8 x 16.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "kv_quality"
TEXT = Path(__file__).parent / "data" / "coriolanus_act1.txt"
BLOCK = 16


def _engine(loaded, dtype: str, kernels: str, max_model_len: int):
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(device="cpu", cpu_kernels=kernels, kv_cache_dtype=dtype, seed=0,
                                  max_model_len=max_model_len, kv_cache_memory_bytes=256 << 20), loaded=loaded)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's greedy tokens and, per token, the logprobs of the chosen and top-2 tokens."""
    from pagedserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    for _ in range(len(prompts) * (max_tokens + max(map(len, prompts))) + 10):  # bounded: a step moves each one on
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if not engine.has_unfinished_requests():
            break
    return [(list(done[str(i)].token_ids), list(done[str(i)].logprobs)) for i in range(len(prompts))]


def compare(ref: list, other: list) -> dict:
    """Greedy agreement, float32's top-2 margins at the divergences, |delta logprob| over the shared tokens."""
    same, margins, deltas = 0, [], []
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, other):
        n = next((j for j, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
        shared = len(ref_ids) if n is None else n
        deltas += [abs(ref_lp[j][ref_ids[j]] - lp[j][ids[j]]) for j in range(shared)]
        if n is None:
            same += 1
        else:
            top = sorted(ref_lp[n].values(), reverse=True)
            margins.append(round(top[0] - top[1], 4) if len(top) > 1 else None)
    return {"greedy_agreement": same / len(ref), "divergences": len(ref) - same,
            "float32_top2_margin_at_divergences": margins,
            "mean_abs_delta_logprob": float(np.mean(deltas)) if deltas else 0.0,
            "max_abs_delta_logprob": float(np.max(deltas)) if deltas else 0.0}


def perplexity(engine, ids: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given the text before, fed in chunks through a fresh pool of the
    engine's layout (the model's own forward; block table in order)."""
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    worker = engine.executor.driver_worker
    model = worker.model
    nblocks = -(-len(ids) // BLOCK)
    kv = allocate_kv_caches(model.config, nblocks, BLOCK, model.backend, storage=worker.kv_layout.storage)
    table = list(range(nblocks))
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        part = ids[start:start + chunk]
        batch = build_forward_batch([SeqChunk(part, start, table, num_logits=len(part), prompt_len=len(ids))], BLOCK)
        logits = np.asarray(model.forward(batch, kv), dtype=np.float64)
        targets = np.asarray(ids[start + 1:start + 1 + len(part)])
        logits = logits[:len(targets)]
        top = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += float((lse - logits[np.arange(len(targets)), targets]).sum())
    return math.exp(nll / (len(ids) - 1))


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model

    loaded = load_model(args.model)
    text_ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    ppl_ids = text_ids[:args.ppl_tokens]
    step = max(1, (len(text_ids) - args.prompt_len) // args.prompts)
    prompts = [text_ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    max_model_len = max(len(ppl_ids), args.prompt_len + args.max_tokens) + BLOCK
    results = {}
    ref = None
    for dtype in ["float32", *args.dtypes]:
        engine = _engine(loaded, dtype, args.cpu_kernels, max_model_len)
        kernels = engine.backend.ops.name  # the set that ran ("numba" or "numpy")
        t = time.perf_counter()
        runs = greedy(engine, prompts, args.max_tokens)
        row = {"perplexity": perplexity(engine, ppl_ids, args.ppl_chunk), "seconds": 0.0}
        row["seconds"] = round(time.perf_counter() - t, 1)
        if ref is None:
            ref = runs
        else:
            row.update(compare(ref, runs))
            row["perplexity_vs_float32"] = row["perplexity"] / results["float32"]["perplexity"] - 1.0
        results[dtype] = row
    return {"benchmark": NAME, "quick": args.quick,
            "config": {"model": loaded.name, "prompts": args.prompts, "prompt_len": args.prompt_len,
                       "max_tokens": args.max_tokens, "ppl_tokens": len(ppl_ids), "ppl_chunk": args.ppl_chunk,
                       "text": TEXT.name, "cpu_kernels": args.cpu_kernels, "kernels": kernels},
            "environment": plots.environment(args.quick), "results": results}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, 512 perplexity tokens")
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                    help="kv_cache_dtypes against float32 (int8: with --cpu-kernels numpy)")
    ap.add_argument("--prompts", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--ppl-tokens", type=int, default=None, help="default 4096 (512 with --quick)")
    ap.add_argument("--ppl-chunk", type=int, default=256)
    ap.add_argument("--cpu-kernels", default="auto")
    ap.add_argument("--out-dir", default=None, help="where kv_quality.json goes (default bench/results)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"prompts": 8, "max_tokens": 16, "ppl_tokens": 512},
                        full={"prompts": 64, "max_tokens": 128, "ppl_tokens": 4096},
                        positive=("prompts", "prompt_len", "max_tokens", "ppl_tokens", "ppl_chunk"))
    plots.emit(NAME, run(args), args.out_dir, None, False, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
