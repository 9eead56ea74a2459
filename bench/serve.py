"""Online serving: the sidecar under Poisson load, latency percentiles and SLO violations per request rate.

This script starts `pagedserve serve` as its own process on a unix socket in a temporary folder (the
embedded model unless --model), then acts as the client process: for each request rate it sends
requests at Poisson arrival times (bounded by --duration seconds and --max-requests) through
AsyncPagedServeClient, streams the tokens back, and measures per request

  TTFT   time from sending to the first token (client side)
  TPOT   (last token time - first token time) / (output tokens - 1)
  ITL    gaps between consecutive token-carrying chunks

(latencies pool every request that streamed, including ones cut off by the drain timeout), and the
output tokens/s received over the rate's span. --concurrency N sends N requests at once instead of a
Poisson stream (a closed burst: TTFT then includes the queue and prefill of all N).
A request breaks the SLOs when it fails, does not finish within --drain-timeout after the last
arrival, or has TTFT > --slo-ttft or TPOT > --slo-tpot. The run is repeated for a prefix case whose
prompts share a long system prompt (token ids) and differ in a short suffix; cached_tokens comes from
each request's Usage. Server and load generator share this machine's cores.

--api openai runs every load twice on the same server, through gRPC (AsyncPagedServeClient) and through
the OpenAI-compatible HTTP API (the official `openai` client, AsyncOpenAI, streaming with token ids):
same arrival times, same prompt lengths, fresh prompts for each, and reports both side by side with the
HTTP layer's overhead (`http_overhead_pct`: TPOT p50, TTFT p50, output tokens/s). Usage:

    .venv/bin/python bench/serve.py [--quick] [--model PATH] [--rates 0.5 1 2 4] [--duration 20]
    .venv/bin/python bench/serve.py --api openai --concurrency 32 --output-len 64 --prompt-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "serve"
CLAIM = {"text": "latency SLOs held under load (TTFT and TPOT targets), prefix caching cuts prefill work",
         "note": "no single number is claimed; the SLOs below are this benchmark's targets",
         "http_target": "--api openai: the HTTP API's TPOT p50 within 5% of gRPC's at 32 concurrent streams"}


def server_env() -> dict[str, str]:
    """This process's environment, plus a crashed server leaving every thread's Python traceback in its log
    (as the systemd unit's servers do)."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


class ServerProcess:
    """`pagedserve serve` on a unix socket in `tmp`, its log in tmp/server.log."""

    def __init__(self, tmp: Path, model: str | None, device: str, extra: list[str], http: bool = False) -> None:
        self.socket = str(tmp / "ps.sock")
        # The server logs at warning level (no server.listening line to read a port 0 from): pick a free port.
        self.http_port = free_port() if http else None
        self.model_name = ""  # once serving: what the HTTP API calls its model
        self.log_path = tmp / "server.log"
        cmd = [sys.executable, "-m", "pagedserve.sidecar.cli", "serve", "--socket", self.socket, "--device", device,
               "--log-level", "warning", "--max-waiting-requests", "4096", *extra]
        if model is not None:
            cmd += ["--model", model]
        if self.http_port is not None:
            cmd += ["--http-port", str(self.http_port)]
        self._log = open(self.log_path, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=server_env())

    def wait_serving(self, timeout: float) -> float:
        from pagedserve.sidecar.client import PagedServeClient, PagedServeError

        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            self._check_alive(deadline)
            time.sleep(0.02)
        with PagedServeClient(self.socket, timeout=2.0) as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        return time.perf_counter() - self.t0
                except PagedServeError:
                    pass
                self._check_alive(deadline)
                time.sleep(0.05)

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up:\n{self.log()[-4000:]}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def post_mortem(self) -> str:
        """For a benchmark that failed: this server's exit status (None: still running) and its log's tail."""
        return f"server {self.socket}: exit status {self.proc.poll()}; log tail:\n{self.log()[-3000:]}"

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Record:
    prompt_len: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per token-carrying chunk
    num_tokens: int = 0
    cached_tokens: int | None = None
    server_ttft_s: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)


async def _one(client, rec: Record, prompt: list[int], sampling: dict) -> None:
    from pagedserve.sidecar.client import PagedServeError

    rec.sent = time.perf_counter()
    try:
        stream = client.generate(prompt, **sampling)
        async for chunk in stream:
            if chunk.token_ids:
                rec.token_times.append(time.perf_counter())
                rec.num_tokens += len(chunk.token_ids)
        if stream.usage is not None:
            rec.cached_tokens = stream.usage.cached_tokens
            rec.server_ttft_s = stream.usage.ttft_s
    except PagedServeError as e:
        rec.error = e.code.name


async def _one_http(client, rec: Record, prompt: list[int], sampling: dict) -> None:
    """One streamed completion through the HTTP API; token ids per chunk (vLLM's return_token_ids) count the
    tokens as gRPC's chunks do, and the final usage chunk carries cached_tokens."""
    import openai

    rec.sent = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=sampling["model"], prompt=prompt, max_tokens=sampling["max_tokens"],
            temperature=sampling["temperature"], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": sampling["ignore_eos"], "return_token_ids": True})
        async for chunk in stream:
            ids = sum(len((c.model_extra or {}).get("token_ids") or []) for c in chunk.choices)
            if ids:
                rec.token_times.append(time.perf_counter())
                rec.num_tokens += ids
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                rec.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
    except openai.APIStatusError as e:
        rec.error = f"HTTP_{e.status_code}"
    except openai.APIError as e:  # an error event ending the stream, or the connection
        rec.error = type(e).__name__


async def _one_http_warm_up(server: ServerProcess, prompt: list[int]) -> None:
    import openai

    rec = Record(len(prompt))
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                                  max_retries=0, timeout=60) as client:
        await _one_http(client, rec, prompt, {"model": server.model_name, "max_tokens": 2, "temperature": 0.0,
                                              "ignore_eos": True})
    if rec.error is not None or rec.num_tokens != 2:
        raise RuntimeError(f"the HTTP API's warm-up request failed: {rec.error or rec.num_tokens}")


async def _wait_idle(client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = await client.server_stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.1)


def arrival_times(load: dict, args: argparse.Namespace, seed: int) -> list[float]:
    """Seconds after the start: Poisson at load["rate"], or load["concurrency"] requests at once."""
    if "concurrency" in load:
        return [0.0] * load["concurrency"]
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / load["rate"], size=args.max_requests)
    return [t for t in np.cumsum(gaps) - gaps[0] if t <= args.duration]  # the first one at t = 0


async def run_rate(server: ServerProcess, load: dict, api: str, prompts: list[list[int]], args: argparse.Namespace,
                   seed: int) -> dict:
    from pagedserve.sidecar.client import AsyncPagedServeClient

    arrivals = arrival_times(load, args, seed)
    sampling = {"max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    records = [Record(len(prompts[i % len(prompts)])) for i in range(len(arrivals))]
    if api == "openai":
        sampling["model"] = server.model_name
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(AsyncPagedServeClient(server.socket, generate_timeout=None))
        one, via = _one, client
        if api == "openai":
            import openai

            via = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0, timeout=None))
            one = _one_http
        start = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(via, records[i], prompts[i % len(prompts)], sampling)))
        last_send = time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout) if tasks else (set(), set())
        for i, t in enumerate(tasks):
            if t in pending:
                t.cancel()  # the RPC is cancelled; the server aborts the request
                records[i].error = "DRAIN_TIMEOUT"
        await asyncio.gather(*pending, return_exceptions=True)
        end = time.perf_counter()
        await _wait_idle(client, 30.0)
        stats = await client.server_stats()
    return {"api": api, **summarize(load, records, end - start, last_send - start, args, stats)}


def summarize(load: dict, records: list[Record], span: float, send_span: float, args, stats) -> dict:
    """Latencies over every request that streamed tokens, finished or cut off by the drain timeout
    (an overloaded rate would otherwise report nothing); completion and SLOs over all requests."""
    ok = [r for r in records if r.error is None and r.num_tokens > 0]
    started = [r for r in records if r.token_times]
    itls = [b - a for r in started for a, b in zip(r.token_times, r.token_times[1:])]

    def ms(values: list[float]) -> dict:
        return {k: (round(1000 * v, 1) if v is not None else None) for k, v in plots.percentiles(values).items()}

    ttfts = [r.ttft for r in started]
    tpots = [r.tpot for r in started if r.tpot is not None]
    broken = [r for r in records if r.error is not None or r.num_tokens == 0 or r.ttft > args.slo_ttft
              or (r.tpot is not None and r.tpot > args.slo_tpot)]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    burst = {"concurrency": load["concurrency"]} if "concurrency" in load else {}
    return {"rate_req_per_s": load.get("rate"), **burst, "requests_sent": len(records), "requests_ok": len(ok),
            "requests_streaming_when_cut": sum(1 for r in started if r.error is not None),
            "errors": sorted({r.error for r in records if r.error}), "num_errors": sum(1 for r in records if r.error),
            "send_span_s": round(send_span, 2), "span_s": round(span, 2),
            "achieved_rate_req_per_s": round((len(records) - 1) / send_span, 3) if send_span > 0.001 else None,
            "throughput_req_per_s": round(len(ok) / span, 3) if span else None,
            "output_tokens": sum(r.num_tokens for r in records),
            "output_tokens_per_s": round(sum(r.num_tokens for r in records) / span, 2) if span else None,
            "ttft_ms": ms(ttfts), "tpot_ms": ms(tpots), "itl_ms": ms(itls),
            "server_ttft_ms_p50": round(1000 * float(np.median([r.server_ttft_s for r in ok])), 1)
            if ok and all(r.server_ttft_s is not None for r in ok) else None,
            "slo_violation_pct": round(100 * len(broken) / len(records), 1) if records else None,
            "mean_cached_tokens": round(float(np.mean(cached)), 1) if cached else None,
            "mean_prompt_tokens": round(float(np.mean([r.prompt_len for r in records])), 1) if records else None,
            "server_prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
            "server_preemptions_total": stats.num_preemptions}


def make_prompts(args, vocab: int, shared_prefix: bool, seed: int) -> list[list[int]]:
    """Fresh prompts for each rate, so no rate finds the previous rate's prompts in the prefix cache."""
    rng = np.random.default_rng(seed)
    low = min(100, vocab // 4)
    n = max([args.max_requests, *(args.concurrency or [])])  # one prompt per request: no repeats
    if not shared_prefix:
        return [rng.integers(low, vocab, size=args.prompt_len).tolist() for _ in range(n)]
    system = rng.integers(low, vocab, size=args.prefix_len).tolist()
    return [system + rng.integers(low, vocab, size=args.prompt_len - args.prefix_len).tolist() for _ in range(n)]


def run(args: argparse.Namespace) -> dict:
    from pagedserve.sidecar.client import PagedServeClient

    env = plots.environment(args.quick)
    apis = ["grpc", "openai"] if args.api == "openai" else ["grpc"]
    loads = ([{"concurrency": n} for n in args.concurrency] if args.concurrency
             else [{"rate": r} for r in args.rates])
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        server = ServerProcess(Path(tmp), args.model, args.device, args.server_arg, http="openai" in apis)
        try:
            startup = server.wait_serving(args.startup_timeout)
            with PagedServeClient(server.socket) as c:
                info = c.model_info()
                server.model_name = info.name
                # Warm-up: the first request pays one-time costs that are not the load's.
                warm = list(range(min(100, info.vocab_size // 4), min(100, info.vocab_size // 4) + 8))
                c.generate_text(warm, max_tokens=2, temperature=0.0)
            if "openai" in apis:  # and the HTTP path's, and the client's imports
                asyncio.run(_one_http_warm_up(server, warm))
            results: dict[str, dict[str, list[dict]]] = {api: {} for api in apis}
            for case, shared in (("unique", False), ("shared_prefix", True)):
                for i, load in enumerate(loads):
                    seed = args.seed + 1000 * i + (500 if shared else 0)
                    # Same arrival times through each API; fresh prompts for each, so none finds another's
                    # in the prefix cache (gRPC's are those of a run without --api openai).
                    for k, api in enumerate(apis):
                        prompts = make_prompts(args, info.vocab_size, shared, seed + 100 * k)
                        t = time.perf_counter()
                        row = asyncio.run(run_rate(server, load, api, prompts, args, seed))
                        results[api].setdefault(case, []).append(row)
                        plots.progress(f"serve: {case} at {load} through {api} took {time.perf_counter() - t:.1f} s")
        except BaseException:
            print(server.log()[-4000:], file=sys.stderr)
            raise
        finally:
            rc = server.stop()
    cases = results["grpc"]
    unique = cases["unique"]
    load_key = "concurrency" if args.concurrency else "rate_req_per_s"
    within = [r[load_key] for r in unique if r["slo_violation_pct"] is not None and r["slo_violation_pct"] <= 10]
    prefix_cached = [r["mean_cached_tokens"] for r in cases["shared_prefix"]]
    summary = {"rates": args.rates if not args.concurrency else None, "concurrency": args.concurrency,
               "max_rate_within_slo": max(within) if within and not args.concurrency else None,
               "slo_violation_pct_by_rate": [r["slo_violation_pct"] for r in unique],
               "ttft_p99_ms_by_rate": [r["ttft_ms"]["p99"] for r in unique],
               "tpot_p99_ms_by_rate": [r["tpot_ms"]["p99"] for r in unique],
               "output_tokens_per_s_by_rate": [r["output_tokens_per_s"] for r in unique],
               "prefix_slo_violation_pct_by_rate": [r["slo_violation_pct"] for r in cases["shared_prefix"]],
               "prefix_ttft_p50_ms_by_rate": [r["ttft_ms"]["p50"] for r in cases["shared_prefix"]],
               "unique_ttft_p50_ms_by_rate": [r["ttft_ms"]["p50"] for r in unique],
               "prefix_mean_cached_tokens": max((c for c in prefix_cached if c is not None), default=None)}
    record = {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
              "config": {"model": info.name, "backend": info.backend, "max_model_len": info.max_model_len,
                         "num_kv_blocks": info.num_kv_blocks, "block_size": info.block_size, "rates": args.rates,
                         "concurrency": args.concurrency, "api": args.api,
                         "duration_s": args.duration, "max_requests": args.max_requests,
                         "prompt_len": args.prompt_len, "prefix_len": args.prefix_len, "output_len": args.output_len,
                         "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
                         "drain_timeout_s": args.drain_timeout, "server_args": args.server_arg,
                         "prompts": "random token ids (unique case); prefix case: one shared system prompt of "
                                    "prefix_len tokens + a unique suffix, same total length",
                         "sampling": "greedy, ignore_eos, max_tokens = output_len"},
              "environment": env, "server": {"startup_s": round(startup, 2), "exit_code": rc},
              "results": cases, "summary": summary}
    if "openai" in apis:
        record["results_openai"] = results["openai"]
        summary["http_overhead_pct"] = http_overhead(cases, results["openai"], load_key)
    return record


def http_overhead(grpc: dict[str, list[dict]], http: dict[str, list[dict]], load_key: str) -> dict:
    """Per case and load: how much slower (+) the HTTP API was than gRPC, in % of gRPC's figure (for
    tokens/s: how much fewer tokens/s)."""
    def pct(a: float | None, b: float | None, lower_is_better: bool = True) -> float | None:
        if a is None or b is None or a <= 0:
            return None
        return round(100 * ((b / a - 1) if lower_is_better else (1 - b / a)), 1)

    out = {}
    for case, rows in grpc.items():
        out[case] = [{load_key: g[load_key], "tpot_p50": pct(g["tpot_ms"]["p50"], h["tpot_ms"]["p50"]),
                      "ttft_p50": pct(g["ttft_ms"]["p50"], h["ttft_ms"]["p50"]),
                      "output_tokens_per_s": pct(g["output_tokens_per_s"], h["output_tokens_per_s"], False)}
                     for g, h in zip(rows, http[case])]
    return out


def draw(record: dict, path: Path) -> None:
    cases, cfg = record["results"], record["config"]
    slo = cfg["slo"]
    key = "concurrency" if cfg.get("concurrency") else "rate_req_per_s"
    title = (f"Serving under Poisson load: prompt {cfg['prompt_len']}, output {cfg['output_len']} tokens, "
             f"{cfg['model']} ({cfg['backend']}); dashed: shared-prefix case")
    with plots.figure(path, title, ncols=2, nrows=2, size=(11, 7)) as (a, b, c, d):
        for case, style in (("unique", "-"), ("shared_prefix", "--")):
            rows = cases[case]
            rates = [r[key] for r in rows]
            for q, color in (("p50", "#9ecae1"), ("p99", "#08306b")):
                a.plot(rates, [r["ttft_ms"][q] for r in rows], style, marker="o", color=color, label=f"{case} {q}")
                b.plot(rates, [r["tpot_ms"][q] for r in rows], style, marker="o", color=color, label=f"{case} {q}")
            c.plot(rates, [r["output_tokens_per_s"] for r in rows], style, marker="o", color="#2a7ab9", label=case)
            d.plot(rates, [r["slo_violation_pct"] for r in rows], style, marker="o", color="#2a7ab9", label=case)
        plots.claim_line(a, 1000 * slo["ttft_s"], f"SLO: TTFT < {slo['ttft_s']} s")
        plots.claim_line(b, 1000 * slo["tpot_s"], f"SLO: TPOT < {1000 * slo['tpot_s']:.0f} ms")
        a.set_yscale("log")
        a.set_ylabel("time to first token (ms)")
        b.set_ylabel("time per output token (ms)")
        c.set_ylabel("output tokens/s")
        d.set_ylabel("requests breaking an SLO (%)")
        d.set_ylim(-2, 102)
        a.set_title("TTFT (p50, p99)")
        b.set_title("TPOT (p50, p99)")
        c.set_title("Throughput")
        d.set_title(f"SLO violations (TTFT < {slo['ttft_s']} s, TPOT < {1000 * slo['tpot_s']:.0f} ms)")
        for ax in (a, b, c, d):
            ax.set_xlabel("requests at once" if key == "concurrency" else "offered request rate (req/s, Poisson)")
            ax.set_xscale("log", base=2)
            ticks = cfg["concurrency"] if key == "concurrency" else cfg["rates"]
            ax.set_xticks(ticks, [f"{r:g}" for r in ticks])
            ax.minorticks_off()
            ax.legend(fontsize=7)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="req/s (default 0.5 1 2 4; 4 8 with --quick)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (default 20)")
    ap.add_argument("--max-requests", type=int, default=None, help="most requests per rate (default 40)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 320; 32 with --quick)")
    ap.add_argument("--prefix-len", type=int, default=None,
                    help="shared system prompt tokens in the prefix case (default 256; 24 with --quick)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 64; 8 with --quick)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    ap.add_argument("--drain-timeout", type=float, default=None,
                    help="seconds after the last arrival before unfinished requests are cancelled (default 45)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for `pagedserve serve` (repeat; e.g. --server-arg=--max-num-seqs=64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                    help="openai: run each load through gRPC and through the OpenAI HTTP API (the openai client)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="N requests at once per load, instead of Poisson --rates (e.g. 32)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(
        args, quick={"rates": [4.0, 8.0], "duration": 1.0, "max_requests": 6, "prompt_len": 32, "prefix_len": 24,
                     "output_len": 8, "drain_timeout": 30.0},
        full={"rates": [0.5, 1.0, 2.0, 4.0], "duration": 20.0, "max_requests": 40, "prompt_len": 320,
              "prefix_len": 256, "output_len": 64, "drain_timeout": 45.0},
        positive=("rates", "duration", "max_requests", "prompt_len", "output_len", "drain_timeout"))
    if args.concurrency and min(args.concurrency) < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not 0 <= args.prefix_len < args.prompt_len:
        raise ValueError(f"--prefix-len must be in [0, --prompt-len), got {args.prefix_len}")
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
