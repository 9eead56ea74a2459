"""Parallel sampling memory: one request with n samples sharing its prompt's KV blocks vs n requests.

For each n (2, 4, 8) one 512-token prompt is sampled n ways, max_tokens 32, ignore_eos:

  shared       one request, SamplingParams(n=k, seed=...): the k samples share the prompt's blocks
               (ref counts) and copy a block only when they write into a shared one.
  independent  k separate requests with the same prompt (seed i each); prefix caching off when the
               engine has that switch (EngineConfig.enable_prefix_caching), so nothing is shared.

The KV pool is sampled after every step; the peak number of blocks in use is reported, and the share
of the prompt's memory saved = (peak independent - peak shared) / (k x prompt blocks). Until the
engine implements n > 1 it raises ValueError for it; the shared case then records why and is skipped.

    .venv/bin/python bench/parallel.py [--quick] [--model PATH] [--n 2 4 8] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "parallel"
CLAIM = {"text": "parallel sampling shares the prompt's KV blocks: up to 75% of prompt memory saved",
         "prompt_memory_saved_pct": 75.0}


def _engine(loaded, args: argparse.Namespace, prefix_caching: bool | None):
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    kwargs = {}
    if prefix_caching is not None and "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kwargs["enable_prefix_caching"] = prefix_caching
    cfg = EngineConfig(device=args.device, max_model_len=args.prompt_len + args.max_tokens, seed=0,
                       block_size=args.block_size, max_num_seqs=max(args.n) * 2, **kwargs)
    return LLMEngine(cfg, loaded=loaded), kwargs


def _run_to_end(engine) -> dict:
    peak = peak_shared = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        usage = engine.kv_manager.usage()
        peak = max(peak, usage.num_used_blocks)
        peak_shared = max(peak_shared, usage.num_shared_blocks)
    # The blocks held right after the prompt's step would be the same measure; the peak covers the
    # copies made when samples first write into a shared, partly filled last prompt block.
    return {"peak_blocks": peak, "peak_shared_blocks": peak_shared, "steps": steps,
            "seconds": round(time.perf_counter() - t0, 2),
            "blocks_in_use_after": engine.kv_manager.usage().num_used_blocks}


def run_shared(loaded, args, prompt: list[int], k: int) -> dict:
    from pagedserve.runtime.sampling_params import SamplingParams

    engine, _ = _engine(loaded, args, None)
    params = SamplingParams(n=k, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0)
    try:
        engine.add_request("p", prompt, params)
    except ValueError as e:
        return {"status": "skipped", "reason": f"engine refused SamplingParams(n={k}): {e}"}
    return {"status": "ok", **_run_to_end(engine)}


def run_independent(loaded, args, prompt: list[int], k: int) -> dict:
    from pagedserve.runtime.sampling_params import SamplingParams

    engine, extra = _engine(loaded, args, False)
    for i in range(k):
        engine.add_request(f"i{i}", prompt, SamplingParams(seed=args.seed + i, max_tokens=args.max_tokens,
                                                           ignore_eos=True, temperature=1.0))
    return {"status": "ok", "engine_config_extra": extra, **_run_to_end(engine)}


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model

    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    prompt = np.random.default_rng(args.seed).integers(min(100, vocab // 4), vocab, size=args.prompt_len).tolist()
    env = plots.environment(args.quick)
    prompt_blocks = -(-args.prompt_len // args.block_size)
    results = {}
    for k in args.n:
        shared = run_shared(loaded, args, prompt, k)
        indep = run_independent(loaded, args, prompt, k)
        row = {"n": k, "prompt_blocks": prompt_blocks, "shared": shared, "independent": indep,
               "ideal_prompt_memory_saved_pct": round(100 * (1 - 1 / k), 1)}
        if shared["status"] == "ok":
            saved = indep["peak_blocks"] - shared["peak_blocks"]
            row["peak_blocks_saved_pct"] = round(100 * saved / indep["peak_blocks"], 1)
            row["prompt_memory_saved_pct"] = round(100 * saved / (k * prompt_blocks), 1)
        results[f"n{k}"] = row
        plots.progress(f"parallel: n={k} done")
    top = results[f"n{max(args.n)}"]
    skipped = [r["shared"]["reason"] for r in results.values() if r["shared"]["status"] != "ok"]
    summary = {"max_n": max(args.n), "peak_blocks_independent_at_max_n": top["independent"]["peak_blocks"],
               "peak_blocks_shared_at_max_n": top["shared"].get("peak_blocks"),
               "prompt_memory_saved_pct_at_max_n": top.get("prompt_memory_saved_pct"),
               "prompt_memory_saved_pct_by_n": {r["n"]: r.get("prompt_memory_saved_pct") for r in results.values()}}
    if skipped:
        summary.update(status="skipped", reason=skipped[0])
        summary["claim_75pct_reproduced"] = None
    else:
        summary["status"] = "ok"
        summary["claim_75pct_reproduced"] = max(r["prompt_memory_saved_pct"] for r in results.values()) >= 75.0
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "n": args.n,
                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "block_size": args.block_size,
                       "sampling": "temperature 1.0, seeded, ignore_eos", "device": args.device},
            "environment": env, "results": results, "summary": summary}


def draw(record: dict, path: Path) -> None:
    res, cfg = record["results"], record["config"]
    rows = list(res.values())
    ns = [r["n"] for r in rows]
    title = (f"Parallel sampling: peak KV blocks, {cfg['prompt_len']}-token prompt, {cfg['max_tokens']} new tokens, "
             f"block {cfg['block_size']}")
    with plots.figure(path, title, ncols=2, size=(12, 4.2)) as (ax1, ax2):
        x = np.arange(len(ns))
        indep = [r["independent"]["peak_blocks"] for r in rows]
        shared = [r["shared"].get("peak_blocks", 0) for r in rows]
        plots.bar_labels(ax1, ax1.bar(x - 0.2, indep, 0.4, label="n independent requests", color="#888888"), "{:.0f}")
        plots.bar_labels(ax1, ax1.bar(x + 0.2, shared, 0.4, label="one request, n samples (shared)",
                                      color="#2a7ab9"), "{:.0f}")
        ax1.set_xticks(x, [f"n = {n}" for n in ns])
        ax1.set_ylabel("peak KV blocks in use")
        ax1.legend(fontsize=8)
        if record["summary"]["status"] != "ok":
            ax1.set_title("shared case not run: engine refused n > 1", fontsize=9)
            ax1.text(0.5, 0.5, "\n".join(_wrap(record["summary"]["reason"], 50)), transform=ax1.transAxes,
                     ha="center", va="center", fontsize=8, color="crimson")
        else:
            ax1.set_title("Peak blocks")
        saved = [r.get("prompt_memory_saved_pct") or 0 for r in rows]
        ideal = [r["ideal_prompt_memory_saved_pct"] for r in rows]
        plots.bar_labels(ax2, ax2.bar(x, saved, 0.5, color="#2a7ab9", label="measured"), "{:.0f}")
        ax2.plot(x, ideal, "k.", markersize=10, label="ideal 1 - 1/n")
        plots.claim_line(ax2, CLAIM["prompt_memory_saved_pct"], "claim: up to 75%")
        ax2.set_xticks(x, [f"n = {n}" for n in ns])
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("prompt memory saved (%)")
        ax2.set_title("(independent - shared) / (n x prompt blocks)")
        ax2.legend(fontsize=8)


def _wrap(text: str, width: int) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) + 1 > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return lines + [line]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench parallel", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (64 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 32 (4 with --quick)")
    ap.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"prompt_len": 64, "max_tokens": 4}, full={"prompt_len": 512, "max_tokens": 32},
                        positive=("prompt_len", "max_tokens"))
    if min(args.n) < 2:
        raise ValueError("--n values must be at least 2")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
