"""Decode jitter when a long prompt arrives: chunked prefill at several budgets vs off.

16 streams decode (ignore_eos, greedy); after --steps-before steps a --long-prompt-len token prompt
arrives; the run goes on until that prompt has its first token and then --steps-after more steps.
The engine is driven in-process and every step is timestamped: the inter-token latency (ITL) of a
stream is the time between two consecutive steps that gave it a token. The ITLs of all 16 streams
from the first step of the window to its end are pooled into p50 / p90 / p99 / max.

  off          enable_chunked_prefill=False, budget = max_model_len: the whole prompt runs in one step
               beside the 16 decodes, and every stream waits for it.
  budget N     enable_chunked_prefill=True, max_num_batched_tokens=N: the prompt is cut into chunks,
               one per step, each step still carrying the 16 decodes. The engine's default cost-aware
               chunking sizes them by cost: a token attending to k keys counts 1 + k / K of the N - 16
               tokens the decodes leave (K = the model's matmul FLOPs per token over its attention FLOPs
               per key, 3,072 for SmolLM2-135M, over the kernel set's attention cost: 1,336 with numba),
               so chunks shrink as the prompt's context grows.
  budget N by count (budget_N_by_count, --by-count-budgets): cost_aware_chunking=False, chunks of
               N - 16 tokens wherever they are in the prompt (the scheduler before cost-aware chunking).

Each configuration also reports the model FLOPs of its heaviest step while the long prompt prefills
(`heaviest_step_gflop`: its costliest chunk, with the streams' decodes; common.model_flops_per_token) and
that step's time at the sgemm rate, the mean of one second's measurement just before the configuration's
run and one just after (`heaviest_step_floor_s`, `sgemm_gflops_before_after`; on a shared VM the rate moves by
a tenth from one minute to the next, and the header's, taken at the start, is minutes old by then): every
stream waits for that step, so no kernel brings the p99 ITL below it on this machine, whatever the code. The KV
pool's pages are touched before the clock starts, as a long-running server's are (`--cold-pool`: not).

Usage:

    .venv/bin/python bench/jitter.py [--quick] [--model PATH] [--budgets 256 512 1024] [--by-count-budgets 256]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402
from common import model_flops_per_token  # noqa: E402

NAME = "jitter"
CLAIM = {"text": "chunked prefill cuts the P99 inter-token latency of running streams by up to 90%",
         "p99_reduction_pct": 90.0}
LONG_ID = "long"


def run_config(loaded, args: argparse.Namespace, budget: int | None, cost_aware: bool = True) -> dict:
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.gc_heap import freeze_startup_heap
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    max_model_len = args.long_prompt_len + 64
    engine = LLMEngine(EngineConfig(device=args.device, max_model_len=max_model_len,
                                    max_num_batched_tokens=budget or max_model_len,
                                    enable_chunked_prefill=budget is not None, max_num_seqs=args.streams + 1,
                                    cost_aware_chunking=cost_aware, seed=0), loaded=loaded)
    if args.touch_pool and not args.quick:  # --quick (the smoke test): seconds, not a figure
        # As bench/throughput.py: every page of the KV pool touched before the clock starts, as a long-running
        # server's are (first-touch page faults cost ~2.4 s per GiB on the test VM: the long prompt's 184 MB of
        # fresh blocks would add ~10 ms to each of its steps, a cost a warm server does not pay).
        for k, v in engine.runner.kv_caches:
            k.fill(0)
            v.fill(0)
    vocab = loaded.config.vocab_size
    low = min(100, vocab // 4)
    rng = np.random.default_rng(args.seed)
    stream_ids = [f"s{i}" for i in range(args.streams)]
    for rid in stream_ids:
        engine.add_request(rid, rng.integers(low, vocab, size=args.stream_prompt_len).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=max_model_len - args.stream_prompt_len,
                                          ignore_eos=True))
    token_times: dict[str, list[float]] = {rid: [] for rid in [*stream_ids, LONG_ID]}
    frozen = freeze_startup_heap()  # as the server does after its warm-up (runtime/engine/gc_heap.py)
    full_collections = gc.get_stats()[2]["collections"]
    step_times: list[tuple[float, float, int]] = []  # (start, end, tokens batched)
    chunks: list[int] = []  # the long prompt's tokens computed in each step of its prefill

    def step() -> None:
        group = engine.groups.get(LONG_ID)
        done = group.seqs[0].num_computed_tokens if group is not None else None
        start = time.perf_counter()
        outs = engine.step()
        end = time.perf_counter()
        if done is not None and not token_times[LONG_ID]:
            chunks.append(group.seqs[0].num_computed_tokens - done)
        step_times.append((start, end, sum(len(o.outputs[0].new_token_ids) for o in outs)))
        for o in outs:
            token_times[o.request_id].extend([end] * len(o.outputs[0].new_token_ids))

    while any(not token_times[r] for r in stream_ids):  # the streams' own prefill, outside the window
        step()
    window_start = time.perf_counter()
    for _ in range(args.steps_before):
        step()
    arrival = time.perf_counter()
    engine.add_request(LONG_ID, rng.integers(low, vocab, size=args.long_prompt_len).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first_step = len(step_times)
    while not token_times[LONG_ID]:
        step()
    prefill_steps = len(step_times) - first_step
    for _ in range(args.steps_after):
        step()
    engine.abort_request(stream_ids)
    full_collections = gc.get_stats()[2]["collections"] - full_collections
    gc.unfreeze()  # this engine's objects become collectable again once the next config replaces it
    itls, per_stream = [], {}
    for rid in stream_ids:
        times = [t for t in token_times[rid] if t >= window_start]
        gaps = np.diff([window_start_token(token_times[rid], window_start)] + times) if times else []
        per_stream[rid] = [round(float(g), 5) for g in gaps]
        itls.extend(float(g) for g in gaps)
    stats = {k: (round(1000 * v, 2) if v is not None else None) for k, v in plots.percentiles(itls).items()}
    s0 = token_times[stream_ids[0]]
    trace = [(round(t - arrival, 4), round(1000 * (t - p), 2)) for p, t in zip(s0, s0[1:]) if t >= window_start]
    return {"budget": budget, "enable_chunked_prefill": budget is not None,
            "cost_aware_chunking": cost_aware and budget is not None, "max_model_len": max_model_len,
            "keys_per_token": engine.scheduler.keys_per_token if budget is not None else None,
            "itl_ms": stats, "num_itl_samples": len(itls),
            "long_prompt_ttft_s": round(token_times[LONG_ID][0] - arrival, 3),
            "long_prompt_prefill_steps": prefill_steps, "long_prompt_chunks": chunks,
            "slowest_step_s": round(max(e - s for s, e, _ in step_times[first_step:]), 3),
            "backend": engine.backend.name, "cpu_kernels": engine.backend.ops.name,
            "gc_frozen_objects": frozen, "gc_full_collections": full_collections,
            "stream0_itl_trace": {"t_since_arrival_s": [t for t, _ in trace], "itl_ms": [v for _, v in trace]}}


def heaviest_step_gflop(cfg, streams: int, stream_context: float, long_len: int, budget: int | None,
                        keys_per_token: float | None) -> float:
    """Model GFLOPs of the costliest step while the long prompt prefills: its costliest chunk (cut as the
    scheduler cuts it from the budget - streams tokens the streams' decodes leave; the whole prompt when off),
    the logits of the prompt's last position in its last chunk, and the streams' decodes at about
    `stream_context`."""
    from pagedserve.runtime.core.scheduler import chunk_within

    keys = keys_per_token or float("inf")  # the engine's scheduler's (None: chunks by count)
    heaviest, start = 0.0, 0
    while start < long_len:
        n = long_len if budget is None else chunk_within(max(1, budget - streams), start, long_len - start, keys)
        flops = n * model_flops_per_token(cfg, start + n / 2, False)
        if start + n == long_len:
            flops += 2 * cfg.hidden_size * cfg.vocab_size
        heaviest = max(heaviest, flops)
        start += n
    return (heaviest + streams * model_flops_per_token(cfg, stream_context, True)) / 1e9


def window_start_token(times: list[float], window_start: float) -> float:
    """The stream's last token time before the window (so the first gap in the window is a real ITL)."""
    before = [t for t in times if t < window_start]
    return before[-1] if before else window_start


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model

    loaded = load_model(args.model)
    if args.long_prompt_len + 64 > loaded.config.max_position_embeddings:
        raise ValueError(f"--long-prompt-len {args.long_prompt_len} + 64 exceeds the model's "
                         f"max_position_embeddings ({loaded.config.max_position_embeddings})")
    env = plots.environment(args.quick)
    results = {}
    configs = [("off", None, False)] + [(f"budget_{b}", b, True) for b in args.budgets] \
        + [(f"budget_{b}_by_count", b, False) for b in args.by_count_budgets]
    for key, b, cost_aware in configs:
        t = time.perf_counter()
        before = env["sgemm_gflops"] if args.quick else plots.sgemm_gflops()
        results[key] = r = run_config(loaded, args, b, cost_aware)
        after = env["sgemm_gflops"] if args.quick else plots.sgemm_gflops()
        context = args.stream_prompt_len + args.steps_before + r["long_prompt_prefill_steps"]
        r["heaviest_step_gflop"] = round(heaviest_step_gflop(loaded.config, args.streams, context,
                                                             args.long_prompt_len, b, r["keys_per_token"]), 3)
        r["sgemm_gflops_before_after"] = [round(before, 1), round(after, 1)]
        r["heaviest_step_floor_s"] = round(r["heaviest_step_gflop"] / ((before + after) / 2), 4)
        plots.progress(f"jitter: {key} took {time.perf_counter() - t:.1f} s")
    off = results["off"]["itl_ms"]["p99"]
    reductions = {k: round(100 * (1 - v["itl_ms"]["p99"] / off), 1) for k, v in results.items() if k != "off"}
    best = max(reductions, key=reductions.get)
    summary = {"p99_itl_ms_off": off, "p99_itl_ms_by_config": {k: v["itl_ms"]["p99"] for k, v in results.items()},
               "max_itl_ms_by_config": {k: v["itl_ms"]["max"] for k, v in results.items()},
               "p99_reduction_pct_by_budget": reductions, "best_config": best, "best_budget": results[best]["budget"],
               "best_p99_itl_ms": results[best]["itl_ms"]["p99"], "best_p99_reduction_pct": reductions[best],
               "long_prompt_ttft_s_by_config": {k: v["long_prompt_ttft_s"] for k, v in results.items()}}
    summary["claim_90pct_reproduced"] = reductions[best] >= 90.0
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "streams": args.streams,
                       "stream_prompt_len": args.stream_prompt_len, "long_prompt_len": args.long_prompt_len,
                       "steps_before": args.steps_before, "steps_after": args.steps_after,
                       "budgets": args.budgets, "by_count_budgets": args.by_count_budgets, "device": args.device,
                       "window": "ITLs from steps_before steps before the long prompt arrives to steps_after "
                                 "steps after its first token; p99 depends on this window's length"},
            "environment": env, "results": results, "summary": summary}


def draw(record: dict, path: Path) -> None:
    res, cfg, s = record["results"], record["config"], record["summary"]
    names = list(res)
    title = (f"Inter-token latency of {cfg['streams']} decoding streams when a {cfg['long_prompt_len']}-token "
             f"prompt arrives ({cfg['model']})")
    with plots.figure(path, title, ncols=2, size=(12, 4.2)) as (ax1, ax2):
        for n in names:
            t = res[n]["stream0_itl_trace"]
            ax1.plot(t["t_since_arrival_s"], t["itl_ms"], marker=".", markersize=3, linewidth=1, label=n)
        ax1.axvline(0, color="black", linewidth=0.8)
        ax1.set_yscale("log")
        ax1.set_xlabel("time since the long prompt arrived (s)")
        ax1.set_ylabel("inter-token latency of stream 0 (ms)")
        ax1.set_title("One stream's ITL, per token")
        ax1.legend(fontsize=8)
        x = np.arange(len(names))
        w = 0.27
        for i, (q, color) in enumerate((("p50", "#9ecae1"), ("p99", "#2a7ab9"), ("max", "#08306b"))):
            bars = ax2.bar(x + (i - 1) * w, [res[n]["itl_ms"][q] for n in names], w, label=q, color=color)
            if q == "p99":
                plots.bar_labels(ax2, bars, "{:.0f}")
        plots.claim_line(ax2, 0.1 * s["p99_itl_ms_off"], "claim: p99 90% below 'off'")
        ax2.set_xticks(x, names)
        ax2.set_yscale("log")
        ax2.set_ylabel("inter-token latency (ms)")
        ax2.set_title(f"Pooled ITL; best p99 cut {s['best_p99_reduction_pct']:.0f}% ({s['best_config']})")
        ax2.legend(fontsize=8)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench jitter", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--streams", type=int, default=None, help="default 16 (4 with --quick)")
    ap.add_argument("--stream-prompt-len", type=int, default=None, help="default 128 (8 with --quick)")
    ap.add_argument("--long-prompt-len", type=int, default=None, help="default 4000 (200 with --quick)")
    ap.add_argument("--budgets", type=int, nargs="+", default=None,
                    help="max_num_batched_tokens with chunked prefill (default 256 512 1024; 32 64 with --quick)")
    ap.add_argument("--cold-pool", dest="touch_pool", action="store_false",
                    help="leave the KV pool's pages untouched until written (a server just started; default: touched "
                         "first, as a long-running server's are)")
    ap.add_argument("--by-count-budgets", type=int, nargs="*", default=None,
                    help="budgets also run with cost_aware_chunking=False (default 256; 32 with --quick)")
    ap.add_argument("--steps-before", type=int, default=None, help="default 16 (4 with --quick)")
    ap.add_argument("--steps-after", type=int, default=None, help="default 16 (4 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(
        args, quick={"streams": 4, "stream_prompt_len": 8, "long_prompt_len": 200, "budgets": [32, 64],
                     "by_count_budgets": [32], "steps_before": 4, "steps_after": 4},
        full={"streams": 16, "stream_prompt_len": 128, "long_prompt_len": 4000, "budgets": [256, 512, 1024],
              "by_count_budgets": [256], "steps_before": 16, "steps_after": 16},
        positive=("streams", "stream_prompt_len", "long_prompt_len", "budgets", "by_count_budgets", "steps_before",
                  "steps_after"))
    if min(args.budgets + args.by_count_budgets) <= args.streams:
        raise ValueError(f"--budgets must exceed --streams ({args.streams}): the decodes alone fill the budget")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
