"""What a verify step costs against a plain decode step: the few-row matmul kernels at 1 .. 9 rows.

A speculative verify step multiplies 1 + k rows (the last token and k drafts) by every weight of the model
where a plain decode step multiplies one: it pays only if cost(k + 1 rows) / cost(1 row) stays near 1. This
times the CPU kernels a decode step runs, on the embedded SmolLM2's real weights and shapes (its 30 layers'
qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], and the lm_head [49152, 576]), each
matmul streamed over every layer as a step does:
  Q4_1     the layers' GGUF blocks (numba_cpu/quant.py), the lm_head's Q8_0 blocks
  Q8_0     the layers' weights as Q8_0 blocks (quantized here from the Q4_1 values: the same shapes)
  float32  the layers' float32 weights in the packed GEMM's panels (numba_cpu/gemm.py)
For each, milliseconds per step (per matmul shape over the layers, their per-layer sum, the lm_head) and
ratio_k = cost(k + 1 rows) / cost(1 row), medians of interleaved repeats (every row count and format each
repeat, so a busy neighbour slows them alike), on the host's code path and, in a child process each, with
AVX2 code forced (tests/code_paths.py's NUMBA_CPU_NAME / NUMBA_CPU_FEATURES). Goal: ratio_4 <= 1.5 (5 rows)
for the Q4_1 and Q8_0 layers.

    .venv/bin/python bench/decode_rows.py [--quick] [--paths host avx2] [--repeats 7] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "decode_rows"
CLAIM = {"text": "a 5-row verify step's layer matmuls cost at most 1.5x a 1-row decode step's (Q4_1 and Q8_0 "
                 "blocks, every code path)", "max_ratio_5_rows": 1.5}
ROWS = list(range(1, 10))
FORMATS = ("Q4_1", "Q8_0", "float32")
SHAPES = ("qkv", "o", "gate_up", "down")
AVX2_FEATURES = "+avx,+avx2,+fma,+sse4.2,+popcnt,+bmi,+bmi2,+f16c,+lzcnt,+movbe,+xsave"  # tests/code_paths.py's
FORCED_ENV = {"avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES}}


def q8_0(w: np.ndarray):
    """Q8_0 blocks of float32 [out, in] (d = amax / 127 as float16, q = round(w / d)): a QuantWeight."""
    from pagedserve.cupy_kernels.reference.quant import BLOCK, make_quant_weight

    out, k = w.shape
    blocks = w.reshape(out, k // BLOCK, BLOCK)
    d = (np.abs(blocks).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(blocks * inv[:, :, None]), -127, 127).astype(np.int8).reshape(out, k)
    return make_quant_weight("q8", q, d, None)


def load_weights(layers: int) -> dict:
    """{format: {shape: [weight per layer]}} and the lm_head's Q8_0 blocks, from the embedded GGUF file."""
    from pagedserve.cupy_kernels.numba_cpu import gemm
    from pagedserve.cupy_kernels.reference.quant import (concat_rows, dequantize, kind_of, make_quant_weight,
                                                         split_blocks)
    from pagedserve.models.loading.gguf_loader import open_gguf
    from pagedserve.models.loading.loader import default_model_path

    reader = open_gguf(default_model_path())
    tensors = {t.name: t for t in reader.tensors}

    def blocks(name: str):
        t = tensors[name]
        qtype = t.tensor_type.name
        a = split_blocks(qtype, np.asarray(t.data).reshape(int(t.shape[1]), -1))
        return make_quant_weight(kind_of(qtype), a["qs"], a["scales"], a.get("mins"))

    parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
             "down": ("ffn_down",)}
    weights: dict = {f: {s: [] for s in SHAPES} for f in FORMATS}
    for i in range(layers):
        for shape, names in parts.items():
            q4 = concat_rows([blocks(f"blk.{i}.{n}.weight") for n in names])
            dense = dequantize(q4)
            weights["Q4_1"][shape].append(q4)
            weights["Q8_0"][shape].append(q8_0(dense))
            weights["float32"][shape].append(gemm.pack(dense))
    weights["lm_head"] = blocks("token_embd.weight")
    return weights


def measure(layers: int, repeats: int, threads: int) -> dict:
    """This process's figures: ms per step per format, shape and row count (medians), and the setup. On one
    thread the time is the thread's CPU time (time.thread_time: the kernel's own cost, not the time the OS
    gave the neighbours), on more the wall time."""
    from pagedserve.cupy_kernels.host.blas_threads import set_cpu_threads
    from pagedserve.cupy_kernels.numba_cpu import gemm, quant, setup

    set_cpu_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    weights = load_weights(layers)
    rng = np.random.default_rng(0)
    xs = {(r, k): rng.standard_normal((r, k)).astype(np.float32) for r in ROWS for k in (576, 1536)}

    def run(fmt: str, shape: str, rows: int) -> float:
        total = 0.0
        for w in weights[fmt][shape]:
            x = xs[rows, w.shape[1] if fmt != "float32" else w.in_features]
            t = clock()
            quant.linear(x, w) if fmt != "float32" else gemm.matmul(x, w)
            total += clock() - t
        return total

    def lm_head(rows: int) -> float:
        t = clock()
        quant.linear(xs[rows, 576], weights["lm_head"])
        return clock() - t

    for rows in ROWS:  # compile, and touch every weight once
        lm_head(rows)
        for fmt in FORMATS:
            for shape in SHAPES:
                run(fmt, shape, rows)
    times: dict = {f: {s: {r: [] for r in ROWS} for s in (*SHAPES, "layer_sum")} for f in FORMATS}
    times["lm_head_Q8_0"] = {r: [] for r in ROWS}
    for _ in range(repeats):
        for rows in ROWS:
            times["lm_head_Q8_0"][rows].append(lm_head(rows))
            for fmt in FORMATS:
                per = [run(fmt, shape, rows) for shape in SHAPES]
                for shape, t in zip(SHAPES, per):
                    times[fmt][shape][rows].append(t)
                times[fmt]["layer_sum"][rows].append(sum(per))

    def summary(series: dict) -> dict:
        ms = {r: 1e3 * float(np.median(series[r])) for r in ROWS}
        return {"ms": {str(r): round(ms[r], 3) for r in ROWS},
                "ratio": {str(r - 1): round(ms[r] / ms[1], 3) for r in ROWS[1:]}}  # ratio_k: k drafts

    results = {f: {s: summary(times[f][s]) for s in (*SHAPES, "layer_sum")} for f in FORMATS}
    results["lm_head_Q8_0"] = summary(times["lm_head_Q8_0"])
    return {"code_path": setup.CODE_PATH, "numba_threads": setup.apply_threads(parallel=True),
            "clock": "thread CPU time" if threads == 1 else "wall",
            "quant_max_rows": quant.QUANT_MAX_ROWS, "layers": layers, "repeats": repeats,
            "loadavg": plots.loadavg(), "results": results}


def child(path: str, layers: int, repeats: int, threads: int) -> dict:
    """measure() in a process compiling for `path` ("host": this process's environment)."""
    env = {k: v for k, v in os.environ.items() if path == "host" or k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env.update(FORCED_ENV.get(path, {}))
    proc = subprocess.run([sys.executable, __file__, "--child", "--layers", str(layers), "--repeats", str(repeats),
                           "--threads", str(threads)],
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"decode_rows child ({path}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def draw(record: dict, png: Path) -> None:
    with plots.figure(png, "Few-row matmuls: cost(rows) / cost(1 row), SmolLM2's layers") as ax:
        for path, res in record["results"].items():
            for fmt in FORMATS:
                ratio = res["results"][fmt]["layer_sum"]["ratio"]
                ax.plot(ROWS, [1.0] + [ratio[str(r - 1)] for r in ROWS[1:]], marker="o", label=f"{fmt} ({path})")
        plots.claim_line(ax, CLAIM["max_ratio_5_rows"], "goal at 5 rows")
        ax.set_xlabel("rows (1 + drafts)")
        ax.set_ylabel("cost / cost at 1 row")
        ax.legend(fontsize=7)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    plots.add_common_args(ap, with_model=False)
    ap.add_argument("--paths", nargs="+", default=None, choices=["host", "avx2"],
                    help="code paths to time (default host avx2; host with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7; 2 with --quick)")
    ap.add_argument("--layers", type=int, default=None, help="SmolLM2 layers streamed (default 30; 2 with --quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="numba threads (default 1: a kernel's own CPU time, least moved by a busy machine)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    plots.fill_defaults(args, dict(paths=["host"], repeats=2, layers=2, threads=1),
                        dict(paths=["host", "avx2"], repeats=7, layers=30, threads=1),
                        positive=("repeats", "layers", "threads"))
    if args.layers > 30:
        raise ValueError(f"--layers: SmolLM2-135M has 30 layers, got {args.layers}")
    if args.child:
        print(json.dumps(measure(args.layers, args.repeats, args.threads)))
        return 0
    t0 = time.perf_counter()
    env = plots.environment(args.quick)
    results = {}
    for path in args.paths:
        plots.progress(f"decode_rows: {path} code path")
        results[path] = child(path, args.layers, args.repeats, args.threads)
    goal = CLAIM["max_ratio_5_rows"]
    summary = {f"{path}_{fmt}_ratio_5_rows": res["results"][fmt]["layer_sum"]["ratio"]["4"]
               for path, res in results.items() for fmt in FORMATS}
    met = [summary[f"{p}_{f}_ratio_5_rows"] <= goal for p in results for f in ("Q4_1", "Q8_0")]
    record = {"benchmark": NAME, "quick": args.quick, "claim": CLAIM, "environment": env,
              "note": "timed on a machine shared with other work: contended figures, medians of interleaved repeats",
              "results": results, "summary": summary,
              "claim_reproduced": None if args.quick else all(met)}
    plots.emit(NAME, record, args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
