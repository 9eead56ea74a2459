"""KV cache waste: contiguous per-request reservation vs pagedserve's paged blocks, step by step.

A seeded workload of chat-like requests (heavy-tailed prompt and output lengths) goes through a
continuous-batching loop under a fixed KV memory of `--kv-slots` token slots. Every step each running
request computes its pending tokens (the whole prompt on admission, then one token), then samples one.
Three ways to hold the KV cache are compared on the same workload:

  contiguous_max_model_len   each request reserves max_model_len slots in one piece (first fit)
  contiguous_max_tokens      each request reserves prompt + max_tokens slots in one piece (first fit)
  paged_<B>                  pagedserve's KVCacheManager / BlockPool with block size B (8, 16, 32):
                             blocks on demand; when none is free the newest request is preempted

Per step: token states held (used) vs slots reserved or allocated. Waste % = 1 - sum(used) /
sum(allocated). Needs no model.

KV cache dtypes (`kv_dtypes` in the record): for each kv_cache_dtype a kernel set runs, the bytes of a block of the
embedded SmolLM2 (its config only: 30 layers, 3 kv heads of 64; --kv-model for another), the blocks and the most
concurrent --kv-seq-len-token sequences a GiB holds (arithmetic from the layout), checked against a real pool
allocated from a --kv-check-bytes budget (its arrays' bytes, and its blocks). Usage:

    .venv/bin/python bench/memory.py [--quick] [--requests 500] [--kv-slots 32768] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

from pagedserve.runtime.core.kv_cache_manager import KVCacheManager  # noqa: E402

NAME = "memory"
CLAIM = {"text": "contiguous reservation wastes 60-80% of KV memory; paging wastes under 4%",
         "contiguous_waste_pct": [60.0, 80.0], "paged_waste_pct_max": 4.0}


# -- the workload -----------------------------------------------------------------------------------


@dataclass
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]  # what each request really generates before it stops
    max_tokens: list[int]  # what each client asked for (the limit contiguous reservation must honour)
    description: dict


def make_workload(num_requests: int, max_model_len: int, seed: int, prompt_median: float = 200.0,
                  prompt_sigma: float = 1.0, output_median: float = 150.0, output_sigma: float = 0.9,
                  max_tokens: int = 1024) -> Workload:
    """Lognormal prompt and output lengths (the long tail of chat traffic), capped by max_model_len."""
    rng = np.random.default_rng(seed)
    prompts = np.rint(rng.lognormal(np.log(prompt_median), prompt_sigma, num_requests)).astype(int)
    # A prompt leaves room for at least 16 output tokens, as a server would demand.
    prompts = np.clip(prompts, 4, max_model_len - 16)
    limits = np.minimum(max_tokens, max_model_len - prompts)
    outputs = np.rint(rng.lognormal(np.log(output_median), output_sigma, num_requests)).astype(int)
    outputs = np.clip(outputs, 1, limits)
    desc = {"num_requests": num_requests, "seed": seed, "max_model_len": max_model_len,
            "prompt_len": f"lognormal(median {prompt_median}, sigma {prompt_sigma}) rounded, clipped to "
                          f"[4, max_model_len - 16]",
            "max_tokens": f"min({max_tokens}, max_model_len - prompt_len) (the client's limit)",
            "output_len": f"lognormal(median {output_median}, sigma {output_sigma}) rounded, clipped to "
                          f"[1, max_tokens] (what the model really generates)",
            "prompt_len_stats": _stats(prompts), "output_len_stats": _stats(outputs)}
    return Workload(prompts.tolist(), outputs.tolist(), limits.tolist(), desc)


def _stats(a: np.ndarray) -> dict:
    return {"mean": round(float(a.mean()), 1), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": int(a.max())}


# -- memory policies --------------------------------------------------------------------------------


class ContiguousAllocator:
    """First fit over one linear array of token slots: each request holds one piece of fixed size."""

    def __init__(self, num_slots: int, reserve) -> None:
        self.num_slots = num_slots
        self.reserve = reserve  # (request) -> slots to reserve
        self.holes: list[list[int]] = [[0, num_slots]]  # [start, length], sorted by start
        self.pieces: dict[int, tuple[int, int]] = {}
        self.allocated = 0

    def admit(self, r: "SimRequest") -> bool:
        size = self.reserve(r)
        for i, (start, length) in enumerate(self.holes):
            if length >= size:
                if length == size:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + size, length - size]
                self.pieces[r.rid] = (start, size)
                self.allocated += size
                return True
        return False

    def grow(self, r: "SimRequest") -> bool:
        return True  # everything was reserved up front

    def free(self, r: "SimRequest") -> None:
        start, size = self.pieces.pop(r.rid)
        self.allocated -= size
        i = bisect.bisect_left(self.holes, [start, 0])
        self.holes.insert(i, [start, size])
        # Merge with the next and previous holes.
        if i + 1 < len(self.holes) and self.holes[i][0] + self.holes[i][1] == self.holes[i + 1][0]:
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == self.holes[i][0]:
            self.holes[i - 1][1] += self.holes.pop(i)[1]

    def fits_if_unfragmented(self, r: "SimRequest") -> bool:
        return self.num_slots - self.allocated >= self.reserve(r)


class PagedAllocator:
    """pagedserve's own KVCacheManager: blocks allocated as tokens are computed."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_slots = (num_slots // block_size) * block_size
        self.kv = KVCacheManager(num_slots // block_size, block_size)

    @property
    def allocated(self) -> int:
        return self.kv.pool.num_used_blocks * self.block_size

    def admit(self, r: "SimRequest") -> bool:
        return self.kv.allocate_slots(str(r.rid), 0, r.num_tokens)

    def grow(self, r: "SimRequest") -> bool:
        return self.kv.allocate_slots(str(r.rid), r.num_computed, r.num_tokens - r.num_computed)

    def free(self, r: "SimRequest") -> None:
        self.kv.free(str(r.rid))

    def fits_if_unfragmented(self, r: "SimRequest") -> bool:
        return False  # any free block is usable: no external fragmentation


@dataclass(eq=False)
class SimRequest:
    rid: int
    prompt_len: int
    output_len: int
    max_tokens: int
    num_generated: int = 0
    num_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated


@dataclass
class SimResult:
    steps: int = 0
    preemptions: int = 0
    used: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    blocked_free: list[int] = field(default_factory=list)  # free slots on steps where admission was blocked
    fragmented_steps: int = 0  # blocked although enough slots were free in total (external fragmentation)


def simulate(workload: Workload, alloc, max_num_seqs: int) -> SimResult:
    waiting = [SimRequest(i, p, o, m) for i, (p, o, m) in
               enumerate(zip(workload.prompt_lens, workload.output_lens, workload.max_tokens))]
    waiting.reverse()  # pop() from the end = FCFS
    running: list[SimRequest] = []
    res = SimResult()
    while waiting or running:
        preempted = False
        # 1. running requests make room for their pending token; newest preempted when out of blocks
        for r in list(running):
            if r not in running:
                continue
            while not alloc.grow(r):
                victim = running[-1]
                running.remove(victim)
                alloc.free(victim)
                victim.num_computed = 0  # recomputed from prompt + generated tokens when readmitted
                waiting.append(victim)
                res.preemptions += 1
                preempted = True
                if victim is r:
                    break
        # 2. admit waiting requests FCFS while memory and seats allow (none after a preemption)
        blocked = False
        while waiting and not preempted and len(running) < max_num_seqs:
            r = waiting[-1]
            if not alloc.admit(r):
                blocked = True
                if alloc.fits_if_unfragmented(r):
                    res.fragmented_steps += 1
                break
            running.append(waiting.pop())
        if blocked:
            res.blocked_free.append(alloc.num_slots - alloc.allocated)
        assert running, "a request does not fit in the whole pool"
        # 3. compute: every running request's K/V is written up to its tokens; record; sample one token
        for r in running:
            r.num_computed = r.num_tokens
        res.used.append(sum(r.num_computed for r in running))
        res.allocated.append(alloc.allocated)
        res.running.append(len(running))
        res.waiting.append(len(waiting))
        res.steps += 1
        for r in list(running):
            r.num_generated += 1
            if r.num_generated >= r.output_len:
                running.remove(r)
                alloc.free(r)
    return res


def summarize(res: SimResult, num_slots: int) -> dict:
    used, alloc = np.asarray(res.used, float), np.asarray(res.allocated, float)
    running, waiting = np.asarray(res.running), np.asarray(res.waiting)
    busy = waiting > 0  # the memory-bound phase: requests are queued
    return {
        "waste_pct": round(100 * (1 - used.sum() / alloc.sum()), 2),
        "pool_holding_tokens_pct": round(100 * used.sum() / (num_slots * res.steps), 2),
        "pool_holding_tokens_pct_while_queued": round(100 * used[busy].sum() / (num_slots * busy.sum()), 2)
        if busy.any() else None,
        "mean_running": round(float(running.mean()), 2),
        "mean_running_while_queued": round(float(running[busy].mean()), 2) if busy.any() else None,
        "max_running": int(running.max()),
        "steps": res.steps,
        "preemptions": res.preemptions,
        "steps_blocked_on_memory": len(res.blocked_free),
        "mean_free_pct_when_blocked": round(100 * float(np.mean(res.blocked_free)) / num_slots, 2)
        if res.blocked_free else 0.0,
        "steps_blocked_by_external_fragmentation": res.fragmented_steps,
    }


def _timeline(res: SimResult, points: int) -> dict:
    idx = np.unique(np.linspace(0, res.steps - 1, min(points, res.steps)).astype(int))
    return {"step": idx.tolist(), "used": [res.used[i] for i in idx], "allocated": [res.allocated[i] for i in idx],
            "running": [res.running[i] for i in idx]}


def policies(max_model_len: int, block_sizes: list[int]) -> dict:
    out = {"contiguous_max_model_len": lambda n: ContiguousAllocator(n, lambda r: max_model_len),
           "contiguous_max_tokens": lambda n: ContiguousAllocator(n, lambda r: r.prompt_len + r.max_tokens)}
    for b in block_sizes:
        out[f"paged_{b}"] = lambda n, b=b: PagedAllocator(n, b)
    return out


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    workload = make_workload(args.requests, args.max_model_len, args.seed, max_tokens=args.max_tokens)
    results, timelines = {}, {}
    for name, make in policies(args.max_model_len, args.block_sizes).items():
        res = simulate(workload, make(args.kv_slots), args.max_num_seqs)
        results[name] = summarize(res, args.kv_slots)
        timelines[name] = _timeline(res, 300)
    summary = {f"waste_pct_{k}": v["waste_pct"] for k, v in results.items()}
    summary.update({f"mean_running_{k}": v["mean_running_while_queued"] or v["mean_running"]
                    for k, v in results.items()})
    contig = [results["contiguous_max_model_len"]["waste_pct"], results["contiguous_max_tokens"]["waste_pct"]]
    paged = [v["waste_pct"] for k, v in results.items() if k.startswith("paged_")]
    summary["claim_contiguous_60_80_reproduced"] = all(60.0 <= w <= 80.0 for w in contig)
    summary["contiguous_waste_at_least_60"] = all(w >= 60.0 for w in contig)
    summary["claim_paged_under_4_reproduced"] = all(w <= 4.0 for w in paged)
    summary["concurrency_gain_paged_16_vs_contiguous_max_model_len"] = (
        round(summary["mean_running_paged_16"] / summary["mean_running_contiguous_max_model_len"], 2)
        if "mean_running_paged_16" in summary else None)
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"kv_slots": args.kv_slots, "max_model_len": args.max_model_len,
                       "max_num_seqs": args.max_num_seqs, "block_sizes": args.block_sizes,
                       "model": None, "note": "a simulation of the KV memory only; no model runs. Compute "
                       "budgets are ignored: only memory and max_num_seqs limit admission."},
            "workload": workload.description, "environment": plots.environment(args.quick),
            "results": results, "summary": summary, "timelines": timelines,
            "kv_dtypes": kv_dtype_capacity(args.kv_model, 16, args.kv_seq_len, args.kv_check_bytes),
            "sim_seconds": round(time.perf_counter() - t0, 2)}


def kv_dtype_capacity(model: str | None, block_size: int, seq_len: int, check_bytes: int) -> dict:
    """Per kv_cache_dtype: bytes a block, blocks and concurrent seq_len-token sequences per GiB (from the layout),
    and a pool allocated from check_bytes whose arrays hold exactly the bytes the arithmetic says."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.cupy_kernels.kernel_set import NUMPY_KV_CACHE_DTYPES
    from pagedserve.cupy_kernels.kv_layout import kv_cache_layout
    from pagedserve.models.kv_cache import allocate_kv_caches, kv_bytes_per_block
    from pagedserve.models.loading.gguf_loader import gguf_config
    from pagedserve.models.loading.gguf_metadata import read_gguf
    from pagedserve.models.loading.loader import default_model_path

    path = Path(model) if model else default_model_path()
    cfg = gguf_config(read_gguf(path), path)
    backend = get_backend("cpu", "numpy")
    blocks_per_seq = -(-seq_len // block_size)
    out = {}
    for dtype in NUMPY_KV_CACHE_DTYPES:
        layout = kv_cache_layout(dtype, np.float32)
        per_block = kv_bytes_per_block(cfg, block_size, layout)
        blocks_per_gib = (1 << 30) // per_block
        num_blocks = check_bytes // per_block  # as the worker sizes a CPU pool
        pool = allocate_kv_caches(cfg, num_blocks, block_size, backend, storage=layout.storage)
        pool_bytes = sum(k.nbytes + v.nbytes for k, v in pool)
        assert pool_bytes == num_blocks * per_block <= check_bytes, (dtype, pool_bytes, num_blocks * per_block)
        del pool
        out[dtype] = {"bytes_per_block": per_block, "blocks_per_gib": blocks_per_gib,
                      "tokens_per_gib": blocks_per_gib * block_size,
                      f"sequences_{seq_len}_per_gib": blocks_per_gib // blocks_per_seq,
                      "checked_pool_blocks": num_blocks, "checked_pool_bytes": pool_bytes}
    base = out["float32"]["blocks_per_gib"]
    for row in out.values():
        row["blocks_vs_float32"] = round(row["blocks_per_gib"] / base, 3)
    return {"model": path.name, "block_size": block_size, "seq_len": seq_len, "check_bytes": check_bytes,
            "num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "dtypes": out}


def draw(record: dict, path: Path) -> None:
    res = record["results"]
    names = list(res)
    labels = [n.replace("contiguous_", "contig.\n").replace("paged_", "paged\nblock ") for n in names]
    colors = ["#888888" if n.startswith("contiguous") else "#2a7ab9" for n in names]
    cfg = record["config"]
    title = (f"KV cache waste, {record['workload']['num_requests']} chat-like requests, "
             f"{cfg['kv_slots']} token slots, max_model_len {cfg['max_model_len']}")
    with plots.figure(path, title, ncols=3, size=(15, 4.2)) as (ax1, ax2, ax3):
        bars = ax1.bar(labels, [res[n]["waste_pct"] for n in names], color=colors)
        plots.bar_labels(ax1, bars)
        ax1.axhspan(60, 80, color="crimson", alpha=0.12, label="claim: contiguous wastes 60-80%")
        plots.claim_line(ax1, 4.0, "claim: paged wastes < 4%")
        ax1.set_ylabel("KV slots reserved but not holding a token (%)")
        ax1.set_title("Waste (time-averaged)")
        ax1.set_ylim(0, 100)
        ax1.legend(fontsize=7, loc="upper right")
        ax1.tick_params(axis="x", labelsize=7)
        for n, c in zip(names, colors):
            t = record["timelines"][n]
            style = "--" if n.startswith("contiguous") else "-"
            ax2.plot(t["step"], t["running"], style, label=n, linewidth=1)
        ax2.set_xlabel("engine step (one decode token per running request)")
        ax2.set_ylabel("requests running at once")
        ax2.set_title("Concurrency in the same KV memory")
        ax2.legend(fontsize=7)
        for n, color in (("contiguous_max_model_len", "#888888"), ("paged_16", "#2a7ab9")):
            if n not in record["timelines"]:
                continue
            t = record["timelines"][n]
            ax3.plot(t["step"], t["allocated"], "--", color=color, linewidth=1, label=f"{n}: reserved")
            ax3.plot(t["step"], t["used"], "-", color=color, linewidth=1, label=f"{n}: holding tokens")
        ax3.axhline(cfg["kv_slots"], color="black", linewidth=0.8, label="pool size")
        ax3.set_xlabel("engine step")
        ax3.set_ylabel("KV token slots")
        ax3.set_title("Reserved vs used")
        ax3.legend(fontsize=7)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench memory", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small workload (the smoke test's)")
    ap.add_argument("--requests", type=int, default=None, help="default 500 (40 with --quick)")
    ap.add_argument("--kv-slots", type=int, default=None,
                    help="KV memory in token slots (default 32768; 4096 with --quick)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=1024, help="the clients' max_tokens (capped by max_model_len)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="where <name>.json and .png go (default bench/results)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--kv-model", default=None, help="GGUF whose config sizes the kv_dtypes table (default: SmolLM2)")
    ap.add_argument("--kv-seq-len", type=int, default=4096, help="tokens of a sequence in the kv_dtypes table")
    ap.add_argument("--kv-check-bytes", type=int, default=64 << 20,
                    help="budget of the pool allocated to check the kv_dtypes arithmetic (default 64 MiB)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"requests": 40, "kv_slots": 4096}, full={"requests": 500, "kv_slots": 32768},
                        positive=("requests", "max_model_len", "max_tokens", "max_num_seqs", "block_sizes"))
    if args.kv_slots < args.max_model_len:
        raise ValueError(f"--kv-slots ({args.kv_slots}) must be >= --max-model-len ({args.max_model_len}): "
                         "one request must fit")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
