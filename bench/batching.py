"""Continuous batching vs static batching: the same requests, the same engine and model.

Every request has the same prompt length and its own output length (uniform in [16, 512] tokens,
seeded; ignore_eos, greedy), so only the batching policy differs:

  continuous  all requests queued at once; pagedserve admits a new one whenever a seat
              (max_num_seqs) and KV blocks free up, and a finished one leaves at once.
  static      batches of --static-batch-size formed up front in the same order; a batch is
              admitted only when the previous one has fully drained, and, like a padded
              `generate` call, every member runs until the batch's longest member ends
              (max_tokens = the batch's longest output). The tokens past a member's own
              length are computed but are padding: only the useful ones count as output.
  hf          optional: Hugging Face transformers `generate` in static batches of the same size,
              run only when `transformers` and `torch` import (never in the test venv).

Output tokens/s counts useful tokens only. Usage:

    .venv/bin/python bench/batching.py [--quick] [--model PATH] [--requests 64] [--max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "batching"
CLAIM = {"text": "continuous batching: up to 24x the throughput of HF transformers (static batches)",
         "speedup": 24.0}


def make_requests(num: int, prompt_len: int, min_out: int, max_out: int, vocab: int, seed: int
                  ) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    low = min(100, vocab // 4)  # stay clear of the special tokens at the start of the vocabulary
    prompts = [rng.integers(low, vocab, size=prompt_len).tolist() for _ in range(num)]
    outputs = rng.integers(min_out, max_out + 1, size=num).tolist()
    return prompts, outputs


def _engine(loaded, args: argparse.Namespace):
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(device=args.device, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.prompt_len + args.max_output, seed=0), loaded=loaded)


def _drain(engine, trace: list, t0: float) -> int:
    """Step until idle; append (seconds since t0, requests that got a token) per step; return the steps."""
    steps = 0
    while engine.has_unfinished_requests():
        produced = len(engine.step())  # requests that got a token this step = the batch's occupancy
        steps += 1
        trace.append((time.perf_counter() - t0, produced))
    return steps


def run_continuous(loaded, args, prompts, outputs) -> dict:
    from pagedserve.runtime.sampling_params import SamplingParams

    engine = _engine(loaded, args)
    trace: list = []
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"c{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    steps = _drain(engine, trace, t0)
    return _mode_result(time.perf_counter() - t0, steps, sum(outputs), sum(outputs), trace,
                        engine.num_preemptions, engine.backend.name)


def run_static(loaded, args, prompts, outputs, batch_size: int) -> dict:
    from pagedserve.runtime.sampling_params import SamplingParams

    engine = _engine(loaded, args)
    trace: list = []
    steps = computed = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch_out = outputs[start:start + batch_size]
        longest = max(batch_out)
        for i, p in enumerate(prompts[start:start + batch_size]):
            engine.add_request(f"s{start + i}", p, SamplingParams(temperature=0.0, max_tokens=longest,
                                                                  ignore_eos=True))
        computed += longest * len(batch_out)
        steps += _drain(engine, trace, t0)
    return _mode_result(time.perf_counter() - t0, steps, sum(outputs), computed, trace, engine.num_preemptions,
                        engine.backend.name, batch_size=batch_size)


def _mode_result(seconds: float, steps: int, useful: int, computed: int, trace: list, preemptions: int,
                 backend: str, batch_size: int | None = None) -> dict:
    running = [r for _, r in trace]
    idx = np.unique(np.linspace(0, len(trace) - 1, min(300, len(trace))).astype(int)) if trace else []
    out = {"seconds": round(seconds, 2), "steps": steps, "useful_output_tokens": useful,
           "computed_output_tokens": computed,
           "padding_waste_pct": round(100 * (1 - useful / computed), 2) if computed else 0.0,
           "output_tokens_per_s": round(useful / seconds, 2), "mean_running": round(float(np.mean(running)), 2)
           if running else 0.0, "preemptions": preemptions, "backend": backend,
           "trace": {"t_s": [round(trace[i][0], 3) for i in idx], "running": [trace[i][1] for i in idx]}}
    if batch_size is not None:
        out["batch_size"] = batch_size
    return out


def hf_available() -> str | None:
    """None when transformers and torch import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers/torch not importable ({e})"
    return None


def run_hf(model: str | None, prompts, outputs, batch_size: int) -> dict:
    """HF transformers generate, static batches, float32 CPU; every row runs to the batch's longest."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if model is None:
        from pagedserve.models.loading.loader import default_model_path

        model = str(default_model_path())
    path = Path(model)
    # transformers 5 renamed torch_dtype to dtype.
    dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), **dtype)
    hf.eval()
    trace: list = []
    computed = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch_out = outputs[start:start + batch_size]
            longest = max(batch_out)
            ids = torch.tensor(prompts[start:start + batch_size])  # equal lengths: no prompt padding
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, pad_token_id=0)
            computed += longest * len(batch_out)
            trace.append((time.perf_counter() - t0, len(batch_out)))
    return _mode_result(time.perf_counter() - t0, 0, sum(outputs), computed, trace, 0,
                        f"torch {torch.__version__}", batch_size=batch_size)


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model

    loaded = load_model(args.model)
    prompts, outputs = make_requests(args.requests, args.prompt_len, args.min_output, args.max_output,
                                     loaded.config.vocab_size, args.seed)
    env = plots.environment(args.quick)
    plots.progress(f"batching: continuous, {args.requests} requests")
    results = {"continuous": run_continuous(loaded, args, prompts, outputs)}
    plots.progress(f"batching: continuous took {results['continuous']['seconds']} s")
    for b in args.static_batch_sizes:
        results[f"static_b{b}"] = run_static(loaded, args, prompts, outputs, b)
        plots.progress(f"batching: static batch {b} took {results[f'static_b{b}']['seconds']} s")
    hf_skip = "disabled with --no-hf" if args.no_hf else hf_available()
    if hf_skip is None:
        plots.progress("batching: transformers generate")
        results[f"hf_b{args.static_batch_sizes[0]}"] = run_hf(args.model, prompts, outputs,
                                                             args.static_batch_sizes[0])
    cont = results["continuous"]["output_tokens_per_s"]
    static = results[f"static_b{args.static_batch_sizes[0]}"]
    hf = results.get(f"hf_b{args.static_batch_sizes[0]}")
    summary = {"continuous_output_tokens_per_s": cont, "static_output_tokens_per_s": static["output_tokens_per_s"],
               "speedup_vs_static": round(cont / static["output_tokens_per_s"], 3),
               "static_padding_waste_pct": static["padding_waste_pct"],
               "speedups_by_static_batch_size": {b: round(cont / results[f"static_b{b}"]["output_tokens_per_s"], 3)
                                                 for b in args.static_batch_sizes},
               "speedup_vs_hf": round(cont / hf["output_tokens_per_s"], 3) if hf else None,
               "hf_skipped": hf_skip}
    summary["claim_24x_reproduced"] = max([summary["speedup_vs_static"], summary["speedup_vs_hf"] or 0]) >= 24.0
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "requests": args.requests,
                       "prompt_len": args.prompt_len, "output_len": f"uniform integers in [{args.min_output}, "
                       f"{args.max_output}], seed {args.seed}", "output_len_range": [args.min_output, args.max_output],
                       "max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "static_batch_sizes": args.static_batch_sizes, "device": args.device,
                       "sizing_note": "the claim's setting is larger (256 requests and more, real prompts); "
                       "this run is sized to finish in minutes on a 2-core CPU"},
            "environment": env, "results": results, "summary": summary}


def draw(record: dict, path: Path) -> None:
    res, cfg, s = record["results"], record["config"], record["summary"]
    names = list(res)
    lo, hi = cfg["output_len_range"]
    title = (f"Continuous vs static batching: {cfg['requests']} requests, prompt {cfg['prompt_len']} tokens, "
             f"output {lo}-{hi} tokens, max {cfg['max_num_seqs']} running, {cfg['model']}")
    with plots.figure(path, title, ncols=2, size=(12, 4.2)) as (ax1, ax2):
        colors = ["#2a7ab9" if n == "continuous" else "#888888" for n in names]
        bars = ax1.bar(names, [res[n]["output_tokens_per_s"] for n in names], color=colors)
        plots.bar_labels(ax1, bars)
        base = s["static_output_tokens_per_s"]
        plots.claim_line(ax1, base * CLAIM["speedup"], f"claim: 24x the static baseline ({base * 24:.0f} tok/s)")
        ax1.set_ylabel("useful output tokens/s")
        ax1.set_yscale("log")
        ax1.set_title(f"Throughput: continuous = {s['speedup_vs_static']:.2f}x static")
        ax1.legend(fontsize=8)
        for n in names:
            t = res[n]["trace"]
            if len(t["t_s"]) > 1:
                ax2.plot(t["t_s"], t["running"], "-" if n == "continuous" else "--", label=n, linewidth=1)
        ax2.set_xlabel("time since start (s)")
        ax2.set_ylabel("requests in the batch")
        ax2.set_title("Batch occupancy (static: padded rows count)")
        ax2.legend(fontsize=8)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench batching", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=None, help="default 64 (12 with --quick)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=None, help="default 512 (32 with --quick)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 32 (4 with --quick)")
    ap.add_argument("--static-batch-sizes", type=int, nargs="+", default=None,
                    help="static baselines to run; the first is the headline (default: max-num-seqs)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline even if it imports")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"requests": 12, "prompt_len": 8, "max_output": 32, "max_num_seqs": 4},
                        full={"requests": 64, "prompt_len": 64, "max_output": 512, "max_num_seqs": 32},
                        positive=("requests", "prompt_len", "min_output", "max_output", "max_num_seqs"))
    args.min_output = min(args.min_output, args.max_output)
    args.static_batch_sizes = args.static_batch_sizes or [args.max_num_seqs]
    if min(args.static_batch_sizes) <= 0:
        raise ValueError("--static-batch-sizes must be positive")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
