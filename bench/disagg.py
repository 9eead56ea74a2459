"""Disaggregated prefill/decode vs one colocated instance: running streams' ITL while long prompts arrive.

Each configuration runs real `pagedserve serve` processes on this machine:

  colocated      one `--role both` instance on both cores (`--cpu-threads 2`, affinity {0, 1})
  colocated_1thread  the same with `--cpu-threads 1` (OpenBLAS's two threads wait on each other when
                 the cores are shared with anything else; this row separates that from scheduling)
  disagg_shm     a `--role prefill` instance on core 0 and a `--role decode` one on core 1 (each
                 `--cpu-threads 1` and os.sched_setaffinity to its core), KV over shared memory
  disagg_grpc    the same pair, KV streamed over gRPC (unix socket)

each with chunked prefill on (`--max-num-batched-tokens --budget`) and off (a budget of max_model_len),
except disagg_grpc, which is run chunked only (its decode-side behaviour equals disagg_shm's; it is
there for the transport figures). The load, sent to the app-facing instance (colocated or decode):
--streams requests decode (greedy, ignore_eos) until the window ends; once every stream has tokens,
--long-prompts prompts of --long-prompt-len random tokens arrive --long-interval seconds apart
(max_tokens 4). Measured on the client: the streams' inter-token latency (gaps between token-carrying
chunks) inside the window (first long arrival .. last long first token + 0.5 s), and each long
prompt's TTFT. From the decode instance's ServerStats: transfer bytes, seconds and blocks, so GB/s
and per-request transfer time per transport.

Then a leak check: --leak-requests long-prompt requests to a fresh disagg pair, half cancelled at
random times while their KV is on its way or decoding; afterwards both instances must hold 0 blocks.

The client runs in this process, unpinned, and shares the two cores with the servers. Usage:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/disagg.py [--quick] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402
from serve import ServerProcess, server_env  # noqa: E402

NAME = "disagg"
CLAIM = {"text": "prefill and decode on separate instances keep running streams' inter-token latency "
                 "steady while long prompts arrive",
         "note": "the seeds claim better use of resources, no number; the flag below compares p99 ITL "
                 "with the colocated instance at the same chunked-prefill setting"}
CORES = (0, 1)


def pinned(cores: set[int], argv: list[str]) -> list[str]:
    """`argv` (a Python command line) run on `cores` only, every thread of it: a first interpreter sets its
    own affinity and execs into `argv`, keeping the pid (as taskset -c does, without needing util-linux).
    Never a Popen preexec_fn: that makes Popen fork() instead of vfork(), and fork() runs gRPC's prefork
    handler, which waited forever (a futex in cygrpc's pthread_atfork hook) about once in ~100 starts while
    this process held client channels: the hang of CI run 55's test_disagg. vfork runs no fork handlers."""
    trampoline = f"import os, sys; os.sched_setaffinity(0, {sorted(cores)}); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", trampoline, *argv]


class Server(ServerProcess):
    """serve.py's server process, started with its CPU affinity already set (so every thread inherits it)."""

    def __init__(self, tmp: Path, model: str | None, extra: list[str], cores: set[int]) -> None:
        import subprocess

        tmp.mkdir(parents=True, exist_ok=True)
        self.socket = str(tmp / "ps.sock")
        self.log_path = tmp / "server.log"
        cmd = [sys.executable, "-m", "pagedserve.sidecar.cli", "serve", "--socket", self.socket, "--device", "cpu",
               "--max-waiting-requests", "4096", *extra]
        if model is not None:
            cmd += ["--model", model]
        self._log = open(self.log_path, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(pinned(cores, cmd), stdout=self._log, stderr=subprocess.STDOUT, env=server_env())


def start_config(tmp: Path, args: argparse.Namespace, kind: str, chunked: bool) -> tuple[list[Server], str]:
    budget = args.budget if chunked else args.max_model_len
    common = ["--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(budget),
              "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
              "--kv-cache-memory-bytes", str(args.kv_bytes), "--log-level", "warning"]
    if kind.startswith("colocated"):
        threads = "1" if kind == "colocated_1thread" else "2"
        srv = Server(tmp / "both", args.model, [*common, "--cpu-threads", threads], set(CORES))
        srv.wait_serving(300)
        return [srv], srv.socket
    prefill = Server(tmp / "prefill", args.model, [*common, "--role", "prefill", "--cpu-threads", "1"], {CORES[0]})
    prefill.wait_serving(300)
    decode = Server(tmp / "decode", args.model,
                    [*common, "--role", "decode", "--cpu-threads", "1", "--prefill-target", f"unix:{prefill.socket}",
                     "--kv-transport", kind.removeprefix("disagg_"), "--prefill-timeout", "600"], {CORES[1]})
    decode.wait_serving(300)
    return [prefill, decode], decode.socket


def report_servers(servers: list[Server]) -> None:
    """The run failed: each server's exit status and log tail to stderr (the folder is deleted after)."""
    for srv in servers:
        print(srv.post_mortem(), file=sys.stderr)


def _stream(socket: str, prompt: list[int], max_tokens: int, times: list[float], stop: threading.Event) -> None:
    from pagedserve.sidecar.client import PagedServeClient

    with PagedServeClient(socket, timeout=None) as c, c.generate(prompt, temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True) as s:
        for chunk in s:
            if chunk.token_ids:
                times.append(time.perf_counter())
            if stop.is_set():
                break


def _long(socket: str, prompt: list[int], out: dict) -> None:
    from pagedserve.sidecar.client import PagedServeClient

    with PagedServeClient(socket, timeout=None) as c:
        out["sent"] = time.perf_counter()
        for chunk in c.generate(prompt, temperature=0.0, max_tokens=4, ignore_eos=True):
            if chunk.token_ids and "first" not in out:
                out["first"] = time.perf_counter()


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def run_load(socket: str, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    from pagedserve.sidecar.client import PagedServeClient

    rng = np.random.default_rng(seed)
    low = min(100, vocab // 4)
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(args.streams)]
    streams = [threading.Thread(target=_stream, args=(socket, rng.integers(low, vocab, 16).tolist(),
                                                      args.max_model_len - 16, times[i], stop), daemon=True)
               for i in range(args.streams)]
    for t in streams:
        t.start()
    wait_until(lambda: all(len(t) >= 3 for t in times), 600, "every stream to decode")
    with PagedServeClient(socket) as c:
        before = c.server_stats()
    longs = [{} for _ in range(args.long_prompts)]
    threads = []
    window_start = time.perf_counter()
    for i, rec in enumerate(longs):
        t = threading.Thread(target=_long, args=(socket, rng.integers(low, vocab, args.long_prompt_len).tolist(), rec))
        t.start()
        threads.append(t)
        if i + 1 < len(longs):
            time.sleep(args.long_interval)  # the arrival schedule itself, not a synchronisation
    for t in threads:
        t.join(600)
        if t.is_alive():
            raise RuntimeError("a long prompt got no first token in 600 s")
    window_end = max(r["first"] for r in longs) + 0.5
    wait_until(lambda: time.perf_counter() >= window_end, 5, "the end of the window")
    stop.set()
    with PagedServeClient(socket) as c:
        after = c.server_stats()
    for t in streams:
        t.join(60)
    itls, baseline = [], []
    for ts in times:
        gaps = np.diff(ts)
        ends = np.asarray(ts[1:])
        itls += [float(g) for g, e in zip(gaps, ends) if window_start <= e <= window_end]
        baseline += [float(g) for g, e in zip(gaps, ends) if e < window_start]

    def ms(xs):
        return {k: (round(1000 * v, 2) if v is not None else None) for k, v in plots.percentiles(xs).items()}

    d = {k: getattr(after, k) - getattr(before, k) for k in ("kv_blocks_received", "kv_bytes_received",
                                                             "remote_prefills", "local_prefill_fallbacks")}
    seconds = after.kv_transfer_s - before.kv_transfer_s
    return {"itl_ms": ms(itls), "itl_ms_before_long_prompts": ms(baseline), "num_itl_samples": len(itls),
            "long_prompt_ttft_s": [round(r["first"] - r["sent"], 3) for r in longs],
            "long_prompt_ttft_s_mean": round(float(np.mean([r["first"] - r["sent"] for r in longs])), 3),
            "window_s": round(window_end - window_start, 2), **d,
            "kv_transfer_s": round(seconds, 6),
            "transfer_gb_per_s": round(d["kv_bytes_received"] / seconds / 1e9, 3) if seconds > 0 else None,
            "transfer_ms_per_request": (round(1000 * seconds / d["remote_prefills"], 3)
                                        if d["remote_prefills"] else None)}


def leak_check(tmp: Path, args: argparse.Namespace, vocab: int) -> dict:
    """--leak-requests requests with long prompts, 8 at a time; every other one cancelled at a random moment
    within --leak-cancel-within seconds of being sent (during its remote prefill and transfer, or later)."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.sidecar.client import PagedServeClient

    servers, socket = start_config(tmp, args, "disagg_shm", True)
    rng = np.random.default_rng(7)
    low = min(100, vocab // 4)
    prompts = [rng.integers(low, vocab, args.long_prompt_len // 2).tolist() for _ in range(args.leak_requests)]
    delays = rng.uniform(0, args.leak_cancel_within, args.leak_requests)

    def one(i: int) -> str:
        with PagedServeClient(socket, timeout=None) as c, c.generate(prompts[i], max_tokens=8, ignore_eos=True) as s:
            timer = threading.Timer(float(delays[i]), s.cancel) if i % 2 == 0 else None
            if timer:
                timer.start()
            got = sum(len(chunk.token_ids) for chunk in s)
            if timer:
                timer.cancel()
            return "completed" if got == 8 else ("cancelled_before_first_token" if got == 0 else "cancelled_later")

    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(args.leak_requests)))
        stats = []
        for srv in servers:
            with PagedServeClient(srv.socket) as c:
                wait_until(lambda: c.server_stats().kv_blocks_used == 0 and c.server_stats().num_running == 0, 60,
                           "the instances to go idle")
                stats.append(c.server_stats())
        prefill, decode = stats
        return {"requests": args.leak_requests, **{k: outcomes.count(k) for k in
                                                   ("completed", "cancelled_before_first_token", "cancelled_later")},
                "remote_prefills": decode.remote_prefills, "local_prefill_fallbacks": decode.local_prefill_fallbacks,
                "kv_blocks_received": decode.kv_blocks_received, "kv_blocks_sent": prefill.kv_blocks_sent,
                "kv_blocks_used_after": {"prefill": prefill.kv_blocks_used, "decode": decode.kv_blocks_used}}
    except Exception:
        report_servers(servers)
        raise
    finally:
        for srv in servers:
            srv.stop()


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model

    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    env = plots.environment(args.quick)
    configs = [("colocated", True), ("colocated_1thread", True), ("disagg_shm", True), ("disagg_grpc", True),
               ("colocated", False), ("disagg_shm", False)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pagedserve-disagg-") as tmp:
        for i, (kind, chunked) in enumerate(configs):
            key = f"{kind}_{'chunked' if chunked else 'unchunked'}"
            t = time.perf_counter()
            folder = Path(tmp) / key
            folder.mkdir()
            servers, socket = start_config(folder, args, kind, chunked)
            try:
                results[key] = {"kind": kind, "chunked_prefill": chunked, **run_load(socket, args, vocab, seed=i)}
            except Exception:
                report_servers(servers)
                raise
            finally:
                codes = [s.stop() for s in servers]
            results[key]["exit_codes"] = codes
            plots.progress(f"disagg: {key} took {time.perf_counter() - t:.1f} s")
        leak_dir = Path(tmp) / "leak"
        leak_dir.mkdir()
        leak = leak_check(leak_dir, args, vocab)
    p99 = {k: v["itl_ms"]["p99"] for k, v in results.items()}
    summary = {"p99_itl_ms_by_config": p99, "p50_itl_ms_by_config": {k: v["itl_ms"]["p50"] for k, v in results.items()},
               "long_prompt_ttft_s_mean_by_config": {k: v["long_prompt_ttft_s_mean"] for k, v in results.items()},
               "transfer_gb_per_s": {k: results[k]["transfer_gb_per_s"]
                                     for k in ("disagg_shm_chunked", "disagg_grpc_chunked")},
               "transfer_ms_per_request": {k: results[k]["transfer_ms_per_request"]
                                           for k in ("disagg_shm_chunked", "disagg_grpc_chunked")},
               "leak_check_blocks_left": sum(leak["kv_blocks_used_after"].values())}
    summary["p99_itl_ms_colocated_1thread_chunked"] = p99["colocated_1thread_chunked"]
    summary["claim_p99_itl_below_colocated_reproduced"] = bool(
        p99["disagg_shm_chunked"] < p99["colocated_chunked"]
        and p99["disagg_shm_unchunked"] < p99["colocated_unchunked"])
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "streams": args.streams,
                       "long_prompts": args.long_prompts, "long_prompt_len": args.long_prompt_len,
                       "long_interval_s": args.long_interval, "budget": args.budget,
                       "max_model_len": args.max_model_len, "leak_requests": args.leak_requests,
                       "affinity": "colocated: cores {0,1}, --cpu-threads 2; disagg: prefill core 0, decode core 1, "
                                   "--cpu-threads 1 each (os.sched_setaffinity); client unpinned"},
            "environment": env, "results": results, "leak_check": leak, "summary": summary}


def draw(record: dict, path: Path) -> None:
    res, cfg = record["results"], record["config"]
    names = list(res)
    title = (f"{cfg['streams']} streams decoding while {cfg['long_prompts']} prompts of {cfg['long_prompt_len']} "
             f"tokens arrive ({cfg['model']}, 2 cores)")
    with plots.figure(path, title, ncols=2, size=(12, 4.2)) as (ax1, ax2):
        x = np.arange(len(names))
        w = 0.38
        for i, (q, color) in enumerate((("p50", "#9ecae1"), ("p99", "#2a7ab9"))):
            bars = ax1.bar(x + (i - 0.5) * w, [res[n]["itl_ms"][q] or 0 for n in names], w, label=q, color=color)
            plots.bar_labels(ax1, bars, "{:.0f}")
        ax1.set_xticks(x, [n.replace("_", "\n", 1) for n in names], fontsize=7)
        ax1.set_yscale("log")
        ax1.set_ylabel("running streams' inter-token latency (ms, log)")
        ax1.set_title("ITL while long prompts arrive")
        ax1.legend(fontsize=8)
        bars = ax2.bar(x, [res[n]["long_prompt_ttft_s_mean"] for n in names], 0.6, color="#fdae6b")
        plots.bar_labels(ax2, bars, "{:.2f}")
        ax2.set_xticks(x, [n.replace("_", "\n", 1) for n in names], fontsize=7)
        ax2.set_ylabel("long prompts' mean TTFT (s)")
        s = record["summary"]
        gbs = ", ".join(f"{k.split('_')[1]} {v} GB/s" for k, v in s["transfer_gb_per_s"].items())
        ax2.set_title(f"TTFT; KV transfer {gbs}", fontsize=9)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench disagg", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--streams", type=int, default=None, help="default 8 (3 with --quick)")
    ap.add_argument("--long-prompts", type=int, default=None, help="default 3 (2 with --quick)")
    ap.add_argument("--long-prompt-len", type=int, default=None, help="default 1024 (300 with --quick)")
    ap.add_argument("--long-interval", type=float, default=None, help="seconds between arrivals; default 2 (0.2)")
    ap.add_argument("--budget", type=int, default=None,
                    help="chunked prefill's max_num_batched_tokens; default 256 (64)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 2048 (512 with --quick)")
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="each instance's KV cache budget; default 512 MiB (64 MiB)")
    ap.add_argument("--leak-requests", type=int, default=None, help="default 100 (20 with --quick)")
    ap.add_argument("--leak-cancel-within", type=float, default=None,
                    help="cancels land uniformly within this many seconds of sending; default 3 (0.2)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(
        args, quick={"streams": 3, "long_prompts": 2, "long_prompt_len": 300, "long_interval": 0.2, "budget": 64,
                     "max_model_len": 512, "kv_bytes": 64 << 20, "leak_requests": 20, "leak_cancel_within": 0.2},
        full={"streams": 8, "long_prompts": 3, "long_prompt_len": 1024, "long_interval": 2.0, "budget": 256,
              "max_model_len": 2048, "kv_bytes": 512 << 20, "leak_requests": 100, "leak_cancel_within": 3.0},
        positive=("streams", "long_prompts", "long_prompt_len", "long_interval", "budget", "max_model_len",
                  "kv_bytes", "leak_requests", "leak_cancel_within"))
    if args.long_prompt_len + 4 > args.max_model_len:
        raise ValueError(f"--long-prompt-len {args.long_prompt_len} + 4 exceeds --max-model-len {args.max_model_len}")
    if os.cpu_count() is None or os.cpu_count() < 2 or not set(CORES) <= os.sched_getaffinity(0):
        raise ValueError("this benchmark pins instances to cores 0 and 1; it needs both available")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
