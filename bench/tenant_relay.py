"""What reading callers' credentials costs: the same server with and without a tenants file, side by side.

With `--tenants`, the public unix socket is the server's own relay (sidecar/peer_proxy.py: SO_PEERCRED, then
every byte copied once on the event loop to gRPC's private socket); without it, gRPC listens on the public
socket itself. Both servers run at once on the same model; the measurements alternate between them in rounds:

  unary         GetModelInfo round trips (no engine work): the relay's per-call latency
  first_token   Generate of an 8-token prompt, max_tokens=1: a whole request's latency through each path
  stream        one Generate of --stream-tokens greedy tokens: chunks per second through each path

Usage:

    .venv/bin/python bench/tenant_relay.py [--quick] [--model PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402
from serve import ServerProcess  # noqa: E402

NAME = "tenant_relay"
CLAIM = {"text": "reading callers' credentials through the relay adds little to a request: unary round trips "
                 "and streamed tokens with and without a tenants file"}


def _measure(socket: str, args: argparse.Namespace) -> dict:
    from pagedserve.sidecar.client import PagedServeClient

    out: dict[str, list[float]] = {"unary_ms": [], "first_token_ms": []}
    with PagedServeClient(socket) as c:
        for _ in range(args.unary):
            t = time.perf_counter()
            c.model_info()
            out["unary_ms"].append(1e3 * (time.perf_counter() - t))
        for _ in range(args.requests):
            t = time.perf_counter()
            list(c.generate([5, 6, 7, 8, 9, 10, 11, 12], max_tokens=1, temperature=0.0))
            out["first_token_ms"].append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        n = sum(len(ch.token_ids) for ch in c.generate([5, 6, 7], max_tokens=args.stream_tokens, temperature=0.0,
                                                       ignore_eos=True))
        out["stream_tok_s"] = [n / (time.perf_counter() - t)]
    return out


def run(args: argparse.Namespace) -> dict:
    env = plots.environment(args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="ps-relay-"))
    uid = os.getuid()
    (tmp / "tenants.toml").write_text(f'[tenants.bench]\nuids = [{uid}]\n')
    common = ["--max-model-len", "512"]
    servers = {}
    try:
        for key, extra in (("direct", []), ("relay", ["--tenants", str(tmp / "tenants.toml")])):
            (tmp / key).mkdir()
            servers[key] = ServerProcess(tmp / key, args.model, args.device, common + extra)
        for s in servers.values():
            s.wait_serving(300)
        samples: dict[str, dict[str, list[float]]] = {k: {} for k in servers}
        for r in range(args.rounds):
            for key in (("direct", "relay") if r % 2 == 0 else ("relay", "direct")):
                for name, values in _measure(servers[key].socket, args).items():
                    samples[key].setdefault(name, []).extend(values)
            plots.progress(f"tenant_relay: round {r + 1}/{args.rounds}")
    finally:
        for s in servers.values():
            s.stop()
    results = {k: {"unary_ms": plots.percentiles(v["unary_ms"]),
                   "first_token_ms": plots.percentiles(v["first_token_ms"]),
                   "stream_tok_s": round(statistics.median(v["stream_tok_s"]), 1)} for k, v in samples.items()}
    d, r = results["direct"], results["relay"]
    summary = {"unary_p50_added_ms": round(r["unary_ms"]["p50"] - d["unary_ms"]["p50"], 3),
               "first_token_p50_added_ms": round(r["first_token_ms"]["p50"] - d["first_token_ms"]["p50"], 3),
               "stream_relay_over_direct": round(r["stream_tok_s"] / d["stream_tok_s"], 3)}
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"rounds": args.rounds, "unary": args.unary, "requests": args.requests,
                       "stream_tokens": args.stream_tokens, "device": args.device},
            "environment": env, "results": results, "summary": summary}


def draw(record: dict, png: Path) -> None:
    res = record["results"]
    with plots.figure(png, "the tenants relay against gRPC on the socket", ncols=2) as axes:
        for ax, metric in zip(axes, ("unary_ms", "first_token_ms")):
            keys = list(res)
            bars = ax.bar(keys, [res[k][metric]["p50"] for k in keys])
            plots.bar_labels(ax, bars, "{:.2f}")
            ax.set_title(f"{metric} p50", fontsize=9)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    plots.add_common_args(ap)
    for name, help_ in (("rounds", "alternating rounds (6; 2)"), ("unary", "GetModelInfo calls a round (200; 20)"),
                        ("requests", "max_tokens=1 requests a round (20; 3)"),
                        ("stream_tokens", "tokens of the streamed request (256; 16)")):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=help_)
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"rounds": 2, "unary": 20, "requests": 3, "stream_tokens": 16},
                        full={"rounds": 6, "unary": 200, "requests": 20, "stream_tokens": 256},
                        positive=("rounds", "unary", "requests", "stream_tokens"))
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
