"""Multi-LoRA serving: output tokens/s with requests spread over 0 (the base), 1, 4 and 16 adapters, beside the
same run with an adapter merged into the weights (the cost ceiling: no LoRA work at all); adapter load times.

Every run is one engine over the same --requests greedy requests (random prompts of --prompt-len tokens,
--max-tokens each, ignore_eos), submitted at once; request i runs with adapter i mod A (A = 0: none). Adapters
are random PEFT adapters of rank --rank on all seven projections (scripts/make_lora.py), max_loras = A, so every
adapter is resident and a step mixes all of them. Rates are per wall-clock second and per CPU second of this
process (a shared host moves the first more than the second). With --rounds N every configuration runs N times,
interleaved (base, 1, 4, 16 adapters, merged, then again), and each figure is the median of its N runs, so a
neighbour's load lands on every configuration alike; the ratios to the base are ratios of those medians (wall
and CPU), and the record carries the load average before and after (a contended host is marked so).

Load times: cold = an adapter read and checked from disk (load_peft_adapter); warm = one already in host memory
copied into an execution slot (LoRASlots.set), each the median of --load-repeats.

    .venv/bin/python bench/lora.py [--quick] [--model PATH] [--requests 64] [--adapters 0 1 4 16] [--rank 16]
                                   [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "lora"
CLAIM = {"text": "4 adapters mixed in one batch: >= 0.8x the base's output tokens/s on the CPU",
         "min_ratio_4_adapters": 0.8}
ROOT = Path(__file__).resolve().parents[1]


def _make_lora():
    spec = importlib.util.spec_from_file_location("make_lora_script", ROOT / "scripts" / "make_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_lora


def run(loaded, requests: list[list[int]], max_tokens: int, loras: list, device: str) -> dict:
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    lora_kw = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=max(a.rank for a in loras)) if loras else {}
    # A KV pool of what the run needs (every request's prompt and output, whole blocks, plus one block each),
    # not the default budget: the benchmark must start on a host whose memory others hold.
    blocks = sum(-(-(len(p) + max_tokens) // 16) + 1 for p in requests)
    engine = LLMEngine(EngineConfig(device=device, seed=0, max_num_seqs=max(len(requests), 1), num_kv_blocks=blocks,
                                    **lora_kw), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for lora in loras:
        engine.lora.register(lora.request)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params, lora_request=loras[i % len(loras)].request if loras else None)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    plots.progress(f"  {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), CPU {cpu:.1f} s")
    return {"output_tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "output_tokens_per_s": round(tokens / wall, 1), "output_tokens_per_cpu_s": round(tokens / cpu, 1)}


@dataclasses.dataclass
class Adapter:
    request: object
    rank: int


def merged(loaded, path: str):
    """`loaded` with the adapter at `path` folded into its weights (W + scale B A). A GGUF model's blocks of a merged
    projection no longer hold its weight, so they are dropped: those matmuls run on float32 weights."""
    from pagedserve.models.loading.gguf_loader import is_quant_name
    from pagedserve.models.loading.peft import load_peft_adapter

    adapter = load_peft_adapter(path, loaded.config)
    w = dict(loaded.weights)
    for (n, module), (a, b) in adapter.weights.items():
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.{n}.{block}.{module}.weight"
        w[name] = (np.asarray(w[name], dtype=np.float32) + adapter.scale * (b @ a)).astype(np.float32)
        for k in [k for k in w if k.startswith(name + ".") and is_quant_name(k)]:
            del w[k]
    return dataclasses.replace(loaded, weights=w)


def load_times(loaded, path: str, max_rank: int, repeats: int) -> dict:
    from pagedserve.models.lora import LoRASlots
    from pagedserve.models.loading.peft import load_peft_adapter

    cold, warm = [], []
    slots = LoRASlots(loaded.config, 1, max_rank)
    for _ in range(repeats):
        t0 = time.perf_counter()
        adapter = load_peft_adapter(path, loaded.config, max_rank)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        slots.set(0, adapter)
        warm.append(time.perf_counter() - t0)
    return {"cold_load_ms": round(1e3 * statistics.median(cold), 3),
            "warm_load_ms": round(1e3 * statistics.median(warm), 3), "adapter_bytes": adapter.nbytes}


def medians(samples: list[dict]) -> dict:
    """Each figure of `run`'s records: its median over the rounds."""
    return {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--adapters", type=int, nargs="+", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--load-repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved runs of every configuration (medians)")
    args = ap.parse_args()
    plots.fill_defaults(args, quick=dict(requests=8, adapters=[0, 1, 4], prompt_len=16, max_tokens=8, rounds=1),
                        full=dict(requests=64, adapters=[0, 1, 4, 16], prompt_len=64, max_tokens=64, rounds=3),
                        positive=("requests", "rank", "prompt_len", "max_tokens", "load_repeats", "rounds"))
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    from pagedserve.models.loading.loader import load_model
    from pagedserve.runtime.lora import LoRARequest

    loaded = load_model(args.model)
    rng = np.random.default_rng(0)
    requests = [rng.integers(10, loaded.config.vocab_size, size=args.prompt_len).tolist() for _ in range(args.requests)]
    make_lora = _make_lora()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(make_lora(Path(tmp) / f"a{k}", loaded.config, rank=args.rank, seed=k))
                 for k in range(max(args.adapters + [1]))]
        adapters = [Adapter(LoRARequest(f"a{k}", k + 1, p), args.rank) for k, p in enumerate(paths)]
        merged_model = merged(loaded, paths[0])
        for r in range(args.rounds):
            for count in args.adapters:
                plots.progress(f"round {r + 1}/{args.rounds}: {count} adapters")
                runs.setdefault(f"adapters_{count}", []).append(
                    run(loaded, requests, args.max_tokens, adapters[:count], args.device))
            plots.progress(f"round {r + 1}/{args.rounds}: merged")
            runs.setdefault("merged", []).append(run(merged_model, requests, args.max_tokens, [], args.device))
        load = load_times(loaded, paths[0], args.rank, args.load_repeats)
    results = {k: medians(v) for k, v in runs.items()}
    base = results.get("adapters_0", results["merged"])
    ratios = {k: round(v["output_tokens_per_cpu_s"] / base["output_tokens_per_cpu_s"], 3) for k, v in results.items()}
    wall_ratios = {k: round(v["output_tokens_per_s"] / base["output_tokens_per_s"], 3) for k, v in results.items()}
    load_after = os.getloadavg()
    cores = os.cpu_count() or 1
    summary = {"output_tokens_per_s": {k: v["output_tokens_per_s"] for k, v in results.items()},
               "ratio_to_base_cpu_time": ratios, "ratio_to_base_wall": wall_ratios, "rounds": args.rounds,
               "loadavg_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
               "contended": max(load_before[0], load_after[0]) > 0.5 * cores, **load}
    if "adapters_4" in ratios:
        summary["claim_4_adapters_reproduced"] = ratios["adapters_4"] >= CLAIM["min_ratio_4_adapters"]
    record = {"benchmark": NAME, "quick": args.quick, "claim": CLAIM, "environment": plots.environment(args.quick),
              "config": {"requests": args.requests, "rank": args.rank, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens, "model": args.model or "embedded SmolLM2"},
              "results": results, "runs": runs, "summary": summary}
    plots.emit(NAME, record, args.out_dir, draw, not args.no_plot, t_start)
    return 0


def draw(record: dict, png: Path) -> None:
    names = list(record["results"])
    base = record["results"].get("adapters_0", record["results"]["merged"])["output_tokens_per_cpu_s"]
    with plots.figure(png, f"Multi-LoRA, {record['config']['requests']} requests, rank {record['config']['rank']}") \
            as ax:
        bars = ax.bar(names, [record["results"][n]["output_tokens_per_cpu_s"] for n in names])
        plots.bar_labels(ax, bars)
        plots.claim_line(ax, CLAIM["min_ratio_4_adapters"] * base, "0.8x the base")
        ax.set_ylabel("output tokens / CPU s")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    plots.run_script(main)
