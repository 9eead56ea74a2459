"""What every benchmark shares on the way out: the record's header, the JSON file, the PNG plot.

Each benchmark builds one dict (its record: `environment()` header, claim, config, results, summary),
and `emit()` writes `<out_dir>/<name>.json`, prints it, and, when matplotlib is installed
(`pip install -e '.[bench]'`), calls the benchmark's `draw(record, png_path)`, which draws inside
`figure()`, to write `<out_dir>/<name>.png` beside it.

Run as a script it rebuilds the figures table of docs/benchmarks.md from the JSON files (`--redraw`
first draws the PNGs again from them):

    .venv/bin/python bench/plots.py --results bench/results --doc docs/benchmarks.md \
        --img-dir docs/img --label "quiet machine"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).parent))
from common import blas_kernel, blas_threads, loadavg, machine, numba_code_path, sgemm_gflops  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_DIR = BENCH_DIR / "results"
DOC_START = "<!-- bench-results:start -->"
DOC_END = "<!-- bench-results:end -->"
# Small PNGs: they are committed under docs/img.
DPI = 80


def quiet_engine_logs() -> None:
    """Engine log events go to stderr at warning level, so stdout carries only the JSON."""
    from pagedserve.sidecar.logging_setup import configure_logging

    configure_logging(level="warning", stream=sys.stderr)


def add_common_args(ap: argparse.ArgumentParser, with_model: bool = True) -> None:
    """The options every model benchmark takes: --quick, --model, --device, --out-dir, --no-plot."""
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test's)")
    if with_model:
        ap.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the embedded SmolLM2)")
        ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out-dir", default=None, help="where <name>.json and .png go (default bench/results)")
    ap.add_argument("--no-plot", action="store_true")


def fill_defaults(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any],
                  positive: tuple[str, ...] = ()) -> None:
    """Options left unset (None) take the --quick or the full-size default; `positive` ones must be > 0."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in positive:
        values = getattr(args, name)
        for v in values if isinstance(values, list) else [values]:
            if v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")


def progress(message: str) -> None:
    """One line on stderr, so a long run shows where it is (stdout carries only the JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_script(main: Callable[[], int]) -> None:
    """The `__main__` of a benchmark: engine logs to stderr, a bad option as one line (exit 2)."""
    quiet_engine_logs()
    try:
        code = main()
    except ValueError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


def environment(quick: bool) -> dict[str, Any]:
    """The header every record carries: the machine (with the BLAS kernel), its sgemm rate measured now,
    the BLAS threads, the load average."""
    gflops = sgemm_gflops(n=256, seconds=0.1) if quick else sgemm_gflops()
    return {"machine": machine(), "sgemm_gflops": round(gflops, 1), "blas_threads": blas_threads(),
            "blas_kernel": blas_kernel(), "numba_code_path": numba_code_path(), "loadavg": loadavg(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git_commit()}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ..., "max": ..., "mean": ...} in the values' unit (None when empty)."""
    import numpy as np

    if not values:
        return {**{f"p{q}": None for q in qs}, "max": None, "mean": None}
    a = np.asarray(values, dtype=float)
    out = {f"p{q}": float(np.percentile(a, q)) for q in qs}
    out["max"] = float(a.max())
    out["mean"] = float(a.mean())
    return out


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def figure(path: Path, title: str, ncols: int = 1, nrows: int = 1, size: tuple[float, float] | None = None
           ) -> Iterator[Any]:
    """Yield the axes of a new figure; on exit give it `title`, lay it out and save it to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = size or (5.2 * ncols, 3.9 * nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
    try:
        flat = [ax for row in axes for ax in row]
        yield flat if len(flat) > 1 else flat[0]
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def claim_line(ax: Any, y: float, label: str, axis: str = "y") -> None:
    """The claim as a dashed reference line, labelled in the legend."""
    draw = ax.axhline if axis == "y" else ax.axvline
    draw(y, color="crimson", linestyle="--", linewidth=1.2, label=label)


def bar_labels(ax: Any, bars: Any, fmt: str = "{:.1f}") -> None:
    for bar in bars:
        h = bar.get_height()
        ax.annotate(fmt.format(h), (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")


def save(name: str, record: dict, out_dir: str | Path | None, draw: Callable[[dict, Path], None] | None,
         plot: bool = True) -> dict[str, str]:
    """Write `<name>.json` (and `<name>.png` via `draw(record, png_path)`); return the paths written."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{name}.json")}
    record["files"] = paths  # the saved JSON says where its plot is
    if plot and draw is not None:
        if have_matplotlib():
            png = out / f"{name}.png"
            draw(record, png)
            paths["png"] = str(png)
        else:
            print(f"bench {name}: matplotlib is not installed (pip install -e '.[bench]'); no plot drawn",
                  file=sys.stderr)
    Path(paths["json"]).write_text(json.dumps(record, indent=1) + "\n")
    return paths


def emit(name: str, record: dict, out_dir: str | Path | None, draw: Callable[[dict, Path], None] | None,
         plot: bool, t0: float) -> dict:
    """The common tail of every benchmark: stamp the elapsed time, save, print the JSON."""
    record["elapsed_s"] = round(time.perf_counter() - t0, 1)
    save(name, record, out_dir, draw, plot)
    print(json.dumps(record))
    return record


# -- the doc's figures table ----------------------------------------------------------------------

BENCHMARKS = ("memory", "batching", "jitter", "parallel", "serve", "disagg", "structured", "speculative")


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def headline(record: dict) -> tuple[str, str]:
    """(claim, what we measured) as one short line each, from a record's `claim` and `summary`."""
    claim = record.get("claim", {}).get("text", "")
    s = record.get("summary", {})
    name = record.get("benchmark")
    if name == "memory":
        got = (f"waste: contiguous max_model_len {_fmt(s.get('waste_pct_contiguous_max_model_len'), '%')}, "
               f"contiguous prompt+max_tokens {_fmt(s.get('waste_pct_contiguous_max_tokens'), '%')}, "
               f"paged (block 16) {_fmt(s.get('waste_pct_paged_16'), '%')}; concurrent requests "
               f"{_fmt(s.get('mean_running_paged_16'))} paged vs "
               f"{_fmt(s.get('mean_running_contiguous_max_model_len'))} contiguous")
    elif name == "batching":
        got = (f"continuous {_fmt(s.get('continuous_output_tokens_per_s'), ' tok/s')} vs static "
               f"{_fmt(s.get('static_output_tokens_per_s'), ' tok/s')}: "
               f"{_fmt(s.get('speedup_vs_static'), 'x', 2)}")
        if s.get("speedup_vs_hf") is not None:
            got += f"; vs HF generate {_fmt(s.get('speedup_vs_hf'), 'x', 2)}"
    elif name == "jitter":
        cut = s.get("p99_reduction_pct_by_budget", {})
        ttft = s.get("long_prompt_ttft_s_by_config", {})
        got = (f"p99 ITL off {_fmt(s.get('p99_itl_ms_off'), ' ms', 0)}; best chunked "
               f"{_fmt(s.get('best_p99_itl_ms'), ' ms', 0)} (budget {s.get('best_budget')}): "
               f"{_fmt(s.get('best_p99_reduction_pct'), '%')} lower (budgets "
               + ", ".join(f"{k.removeprefix('budget_')}: {v}%" for k, v in cut.items())
               + "); the long prompt's TTFT "
               + ", ".join(f"{k.removeprefix('budget_')}: {v} s" for k, v in ttft.items()))
    elif name == "parallel":
        if s.get("status") == "skipped":
            got = f"not measured: {s.get('reason')}"
        else:
            got = (f"prompt memory saved at n={s.get('max_n')}: "
                   f"{_fmt(s.get('prompt_memory_saved_pct_at_max_n'), '%')}; "
                   f"peak KV blocks {s.get('peak_blocks_shared_at_max_n')} shared vs "
                   f"{s.get('peak_blocks_independent_at_max_n')} independent")
    elif name == "serve":
        best = s.get("max_rate_within_slo")
        got = (f"highest rate with <= 10% SLO violations: {'none' if best is None else f'{best:g} req/s'}; "
               f"violations at {s.get('rates')} req/s: {s.get('slo_violation_pct_by_rate')} % (shared prefix "
               f"{s.get('prefix_slo_violation_pct_by_rate')} %); TTFT p50 {s.get('unique_ttft_p50_ms_by_rate')} ms "
               f"(shared prefix {s.get('prefix_ttft_p50_ms_by_rate')} ms, up to "
               f"{s.get('prefix_mean_cached_tokens')} prompt tokens cached per request)")
    elif name == "disagg":
        p99, ttft = s.get("p99_itl_ms_by_config", {}), s.get("long_prompt_ttft_s_mean_by_config", {})
        got = ("p99 ITL " + ", ".join(f"{k}: {_fmt(v, ' ms', 0)}" for k, v in p99.items())
               + "; long prompts' TTFT " + ", ".join(f"{k}: {_fmt(v, ' s', 2)}" for k, v in ttft.items())
               + "; KV transfer " + ", ".join(f"{k}: {v} GB/s" for k, v in s.get("transfer_gb_per_s", {}).items()))
    elif name == "structured":
        got = (f"overhead {_fmt(s.get('throughput_overhead_pct'), '%')} ({_fmt(s.get('guided_output_tokens_per_s'))} "
               f"vs {_fmt(s.get('unguided_output_tokens_per_s'))} tok/s, {s.get('requests')} requests); compile "
               f"p50 {_fmt(s.get('compile_ms_p50'), ' ms', 2)} / p99 {_fmt(s.get('compile_ms_p99'), ' ms', 2)}; "
               f"mask {_fmt(s.get('mask_fill_us_per_token'), ' us/token')} + apply "
               f"{_fmt(s.get('mask_apply_ms_per_step'), ' ms/step', 2)}; valid JSON {s.get('valid_outputs')}/"
               f"{s.get('requests')}")
    elif name == "speculative":
        acc = s.get("acceptance_rate", {})
        got = ("speedup " + ", ".join(f"{k}: {v}" for k, v in s.get("speedup", {}).items())
               + "; acceptance " + ", ".join(f"{k}: {v}" for k, v in acc.items()))
    else:
        got = json.dumps(s)[:200]
    return claim, got


def reproduced(record: dict) -> str:
    """yes / no / partly / n/a from the record's claim_..._reproduced flags."""
    flags = [v for k, v in record.get("summary", {}).items() if k.startswith("claim_") and k.endswith("_reproduced")]
    flags = [f for f in flags if f is not None]
    if not flags:
        return "n/a"
    return "yes" if all(flags) else ("no" if not any(flags) else "partly")


def doc_table(results: Path, img_rel: str, label: str) -> str:
    lines = [f"Results: **{label}**.", ""]
    rows = ["| benchmark | claim | measured | reproduced | run time | sgemm GFLOP/s |",
            "| --- | --- | --- | --- | --- | --- |"]
    figures, env = [], None
    for name in BENCHMARKS:
        path = results / f"{name}.json"
        if not path.exists():
            rows.append(f"| {name} | | not run | | | |")
            continue
        record = json.loads(path.read_text())
        env = env or record.get("environment")
        claim, got = headline(record)
        quick = " (quick mode)" if record.get("quick") else ""
        rows.append(f"| [{name}](#{name}){quick} | {claim} | {got} | {reproduced(record)} | "
                    f"{record.get('elapsed_s')} s | {record.get('environment', {}).get('sgemm_gflops')} |")
        if (results / f"{name}.png").exists():
            figures += [f"**{name}**", "", f"![{name}: {claim}]({img_rel}/{name}.png)", ""]
    if env:
        m = env.get("machine", {})
        lines += [f"Machine: {m.get('cpu_count')} CPUs ({m.get('machine')}), Python {m.get('python')}, "
                  f"numpy {m.get('numpy')}, BLAS threads {env.get('blas_threads')}, BLAS kernel "
                  f"{env.get('blas_kernel') or m.get('blas_kernel')}, numba code "
                  f"{env.get('numba_code_path') or m.get('numba_code_path')}; first run "
                  f"{env.get('date_utc')}, commit {env.get('git_commit')}. The sgemm column is the float32 "
                  "matmul rate each run measured at its start (lower = a busier machine).", ""]
    return "\n".join(lines + rows + [""] + figures).rstrip() + "\n"


def update_doc(results: Path, doc: Path, img_dir: Path, label: str) -> None:
    """Copy the PNGs to `img_dir` and replace the doc's table between the two marker comments."""
    img_dir.mkdir(parents=True, exist_ok=True)
    for name in BENCHMARKS:
        png = results / f"{name}.png"
        if png.exists():
            shutil.copyfile(png, img_dir / png.name)
    text = doc.read_text()
    start, end = text.find(DOC_START), text.find(DOC_END)
    if start < 0 or end < start:
        raise ValueError(f"{doc}: no {DOC_START} ... {DOC_END} markers to replace")
    img_rel = os.path.relpath(img_dir, doc.parent)
    table = doc_table(results, img_rel, label)
    doc.write_text(text[:start + len(DOC_START)] + "\n" + table + text[end:])


def redraw(results: Path) -> list[str]:
    """Draw each <name>.png again from its <name>.json (after a change to a plot, without a rerun)."""
    import importlib.util

    done = []
    for name in BENCHMARKS:
        path = results / f"{name}.json"
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"bench_redraw_{name}", BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses need their module registered
        spec.loader.exec_module(module)
        module.draw(json.loads(path.read_text()), results / f"{name}.png")
        done.append(name)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild the figures table of docs/benchmarks.md from bench results")
    ap.add_argument("--results", default=str(DEFAULT_OUT_DIR))
    ap.add_argument("--doc", default=str(BENCH_DIR.parent / "docs" / "benchmarks.md"))
    ap.add_argument("--img-dir", default=str(BENCH_DIR.parent / "docs" / "img"))
    ap.add_argument("--label", default="preliminary (noisy machine)",
                    help="how the numbers were taken, shown above the table")
    ap.add_argument("--redraw", action="store_true", help="first draw the PNGs again from the JSON files")
    args = ap.parse_args(argv)
    if args.redraw:
        progress(f"redrew {redraw(Path(args.results))}")
    update_doc(Path(args.results), Path(args.doc), Path(args.img_dir), args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
