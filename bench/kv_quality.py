"""KV cache dtypes against float32 KV (issue 64, item 5): what storing K and V in 16 bits costs in quality.

For each kv_cache_dtype, the same model and prompts as a float32-KV engine (both on the CPU kernel set asked for):

  greedy agreement      share of the prompts whose --max-tokens greedy tokens are all identical to float32's; for
                        each divergence, float32's top-2 logprob margin where it happened (a small margin: a near
                        tie that any rounding may flip)
  |delta logprob|       mean and max over the chosen tokens both runs share (same context, before any divergence)
  perplexity            teacher-forced over --ppl-tokens tokens of a public-domain text in the repo
                        (bench/data/coriolanus_act1.txt: Shakespeare, Coriolanus, act 1, scenes 1-2), in chunks of
                        --ppl-chunk tokens through the dtype's pool, so later chunks read the stored K and V

The prompts are --prompts windows of --prompt-len tokens of the same text at evenly spaced offsets (after the
tokenizer's BOS where it adds one: Gemma's). All prompts of a dtype run as one batch through the engine, and the
float32 run is made once per invocation and compared with every dtype.

--kv-ops reference (the default): the KV cache write, paged attention and block copies are the numpy reference's
(the ground truth for rounding; the numba and CUDA 8-bit kernels are bit-exact with it), everything else is the
--cpu-kernels set's (numba: its packed-weight GEMMs, ~10x the numpy set's matmul speed here), for float32 too, so
the dtypes differ by their KV storage alone. --kv-ops kernel-set: the set's own KV kernels (numba: its 16-bit
loop nest; the 8-bit dtypes are refused there). Usage:

    .venv/bin/python bench/kv_quality.py [--quick] [--model PATH] [--dtypes ...] [--prompts 64] [--max-tokens 128]

The full size (64 prompts x 128 tokens, 4,096 perplexity tokens) takes ~10-20 minutes per model on the shared
2-core VM; --quick is 8 x 16 and 512.
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


# The KV ops --kv-ops reference takes from the numpy reference (kernel_set.KernelSet's fields).
KV_OPS = ("reshape_and_cache", "rotary_and_cache", "copy_blocks", "plan_attention", "paged_attention")


def reference_kv_backend(kernels: str):
    """A CPU backend whose KV ops are the numpy reference's and whose other ops are the `kernels` set's (its name
    kept, so the model packs its weights for it as usual); its fused GEMM-and-cache write is off."""
    from dataclasses import replace

    from pagedserve.cupy_kernels import backend as backend_mod, kernel_set

    base = backend_mod.get_backend("cpu", kernels)
    ref = kernel_set.numpy_kernels()
    ops = replace(base.ops, **{op: getattr(ref, op) for op in KV_OPS}, linear_rotary_cache=None,
                  kv_cache_dtypes=ref.kv_cache_dtypes)
    return replace(base, ops=ops)


def _engine(loaded, dtype: str, kernels: str, max_model_len: int, kv_ops: str = "kernel-set"):
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.worker import worker as worker_mod

    if kv_ops == "reference":  # the worker asks get_backend for its backend: hand it the mixed one
        backend = reference_kv_backend(kernels)
        originals = worker_mod.get_backend, worker_mod.finish_warm_up
        worker_mod.get_backend = lambda *a, **k: backend
        worker_mod.finish_warm_up = lambda b, kv_dtype=None: originals[1](b)  # no 16-bit numba loop nest to compile
        try:
            return _engine(loaded, dtype, kernels, max_model_len)
        finally:
            worker_mod.get_backend, worker_mod.finish_warm_up = originals
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
    text = TEXT.read_text()
    text_ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    with_special = loaded.tokenizer.encode(text, add_special_tokens=True)
    bos = with_special[:len(with_special) - len(text_ids)]  # [<bos>] where the tokenizer adds one (Gemma), else []
    ppl_ids = (bos + text_ids)[:args.ppl_tokens]
    step = max(1, (len(text_ids) - args.prompt_len) // args.prompts)
    prompts = [bos + text_ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    max_model_len = max(len(ppl_ids), len(prompts[0]) + args.max_tokens) + BLOCK
    results = {}
    ref = None
    for dtype in ["float32", *args.dtypes]:
        engine = _engine(loaded, dtype, args.cpu_kernels, max_model_len, args.kv_ops)
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
        plots.progress(f"{loaded.name} {dtype}: {row}")
        del engine
    return {"benchmark": NAME, "quick": args.quick,
            "config": {"model": loaded.name, "prompts": args.prompts, "prompt_len": args.prompt_len,
                       "max_tokens": args.max_tokens, "ppl_tokens": len(ppl_ids), "ppl_chunk": args.ppl_chunk,
                       "text": TEXT.name, "cpu_kernels": args.cpu_kernels, "kernels": kernels,
                       "kv_ops": args.kv_ops, "bos": bos},
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
    ap.add_argument("--kv-ops", choices=("reference", "kernel-set"), default="reference",
                    help="the KV write and attention: the numpy reference's (default) or the --cpu-kernels set's")
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
