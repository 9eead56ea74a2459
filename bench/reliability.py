"""Reliability: no request can take the sidecar down. Five runs, each against a real server process.

    streams        N concurrent Generate streams (queue limit raised): how many complete, how many are lost
    fuzz           N requests drawn by Hypothesis from the proto (bench/proto_fuzz.py), sent C at a time:
                   each must answer OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED within the deadline (a
                   Generate answers with its admission headers, or its refusal); an admitted Generate must
                   then get through what is read of it within its completion bound (completion_bound);
                   nothing may be left running, waiting or holding a KV block afterwards; health must stay
                   SERVING; the server's peak RSS (VmHWM) must stay within its memory budget (the
                   engine.memory_budget log line). --partial FILE: the figures so far, every 50 requests
    cancels        N mid-stream cancels and N Abort RPCs, each at a random point that races completion:
                   KV blocks in use once the server is idle (must be 0)
    sigterm        SIGTERM while N streams run: each must finish or end UNAVAILABLE; exit status 0
    small_pool     N greedy requests at once on a KV pool 10x too small for them: each must give the tokens
                   it gives alone (computed offline, one request at a time)

The server runs the embedded model with default settings unless a run says otherwise (--quick: the
tiny committed model, small sizes; the tests call these runs the same way). Usage:

    .venv/bin/python bench/reliability.py [--quick] [--model PATH] [--only fuzz streams ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402
from proto_fuzz import FuzzShape, draw_requests  # noqa: E402
from serve import ServerProcess  # noqa: E402

from pagedserve.sidecar.client import PROMPT_TOKENS_HEADER, REQUEST_ID_HEADER  # noqa: E402

NAME = "reliability"
CLAIM = {"text": "no request can take the sidecar down: concurrent streams all complete, fuzzed requests all answer "
                 "OK/INVALID_ARGUMENT/RESOURCE_EXHAUSTED in time within the memory budget, cancels and aborts leak "
                 "no block, SIGTERM drains to exit 0, a KV pool 10x too small changes no greedy token"}
RUNS = ("streams", "fuzz", "cancels", "sigterm", "small_pool")
EXPECTED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
QUICK = {"streams": 100, "fuzz": 300, "cancels": 50, "sigterm": 40, "small_pool": 12, "deadline": 20.0}
FULL = {"streams": 1000, "fuzz": 10000, "cancels": 500, "sigterm": 200, "small_pool": 48, "deadline": 60.0}
# The fuzz's completion bound for an admitted Generate (completion_bound): generous, as this shared 2-core
# machine may give the server a tenth of a core; it is there to catch a request that never ends.
S_PER_TOKEN = 5.0
S_PER_PROMPT_TOKEN = 0.05


def pb_modules():
    from pagedserve.sidecar.pb import generation_pb2 as pb
    from pagedserve.sidecar.pb import generation_pb2_grpc as pb_grpc

    return pb, pb_grpc


class Server(ServerProcess):
    """`pagedserve serve` with info logs (for the memory budget line) and the process's memory figures."""

    def __init__(self, tmp: Path, model: str | None, extra: list[str]) -> None:
        super().__init__(tmp, model, "cpu", ["--log-level", "info", *extra])

    def memory_kib(self) -> dict[str, int]:
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
        return fields

    def budget_bytes(self) -> int | None:
        for line in self.log().splitlines():
            if '"engine.memory_budget"' in line:
                return int(json.loads(line)["total_gib"] * 2**30)
        return None

    def errors_logged(self) -> list[str]:
        """The server's error-level log lines (a request that failed inside it, a bug): none expected."""
        return [line[:300] for line in self.log().splitlines()
                if '"level": "error"' in line or '"level": "critical"' in line]

    def stub(self, channel):
        return pb_modules()[1].GenerationStub(channel)

    def channel(self):
        import grpc

        return grpc.aio.insecure_channel(f"unix:{self.socket}",
                                         options=[("grpc.max_send_message_length", 64 << 20),
                                                  ("grpc.max_receive_message_length", 64 << 20)])


async def wait_idle(stub, timeout: float = 120.0):
    pb, _ = pb_modules()
    deadline = time.monotonic() + timeout
    while True:
        s = await stub.GetServerStats(pb.GetServerStatsRequest())
        if (s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


async def serving(channel) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


async def read_stream(call) -> tuple[str, int, str]:
    """(outcome, tokens, finish reason of sample 0): outcome 'complete' (usage came last) or a status name."""
    import grpc

    tokens, finish, outcome = 0, "", "incomplete"
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:  # read(), not `async for`: callers may have read already
            if msg.HasField("usage"):
                outcome = "complete"
            else:
                tokens += len(msg.chunk.token_ids)
                finish = msg.chunk.finish_reason or finish
    except grpc.aio.AioRpcError as e:
        outcome = e.code().name
    return outcome, tokens, finish


# -- the runs -----------------------------------------------------------------------------------------

async def run_streams(srv: Server, n: int, max_tokens: int, vocab: int) -> dict:
    pb, _ = pb_modules()
    rng = random.Random(1)
    channels = [srv.channel() for _ in range(8)]
    t0 = time.perf_counter()

    async def one(i: int) -> tuple[str, int, str]:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(rng, vocab, 8 + i % 24)),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return await read_stream(srv.stub(channels[i % 8]).Generate(req))

    results = await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - t0
    done = sum(1 for o, t, f in results if o == "complete" and t == max_tokens and f == "length")
    idle = await wait_idle(srv.stub(channels[0]))
    for c in channels:
        await c.close()
    return {"requests": n, "max_tokens": max_tokens, "completed": done, "lost": n - done,
            "outcomes": dict(Counter(o for o, _, _ in results)), "seconds": round(seconds, 1),
            "output_tokens_per_s": round(done * max_tokens / seconds, 1), "kv_blocks_used_after": idle.kv_blocks_used}


def completion_bound(msg, headers: dict, deadline: float, s_per_token: float, s_per_prompt_token: float) -> float:
    """Seconds an admitted Generate may take from its headers to the end of what the fuzz reads of it (9
    messages, or the end of the stream): the deadline, plus its prefill (prompt tokens, from the headers)
    and the tokens it must generate before those messages: a best_of > n request sends nothing until all
    best_of samples have all their max_tokens; a streamed one, at most 9 tokens a sample."""
    if REQUEST_ID_HEADER not in headers:  # refused: the status has already come, there is nothing to wait for
        return deadline
    s = msg.sampling  # admitted, so these passed the server's checks; unset ones take its defaults
    max_tokens = max(1, s.max_tokens) if s.HasField("max_tokens") else 16  # SamplingParams' default
    n = max(1, s.n) if s.HasField("n") else 1
    best_of = max(n, s.best_of) if s.HasField("best_of") else n
    tokens = max_tokens * best_of if best_of > n else min(max_tokens, 9) * best_of
    prompt_tokens = int(headers.get(PROMPT_TOKENS_HEADER, 0))
    return deadline + s_per_token * tokens + s_per_prompt_token * prompt_tokens


async def run_fuzz(srv: Server, shape: FuzzShape, n: int, concurrency: int, deadline: float,
                   s_per_token: float, s_per_prompt_token: float, seed: int = 0, partial: Path | None = None,
                   time_limit_s: float | None = None) -> dict:
    """Each request must be answered within `deadline`: a Tokenize/Detokenize by its reply, a Generate by its
    response headers (sent on admission) or its refusal. An admitted Generate must then also come to the end
    of what is read of it within its completion bound (completion_bound). Afterwards nothing may be left
    running or waiting, and no KV block in use: every request was finished or cancelled.

    time_limit_s: send no new request after this long; those in flight finish and the checks run as
    usual, on the requests that were sent (the record says `stopped_by_time_limit`)."""
    import grpc

    channels = [srv.channel() for _ in range(4)]
    outcomes: Counter = Counter()
    by_rpc: Counter = Counter()
    reasons: Counter = Counter()  # what refused requests were told, numbers blanked out
    bad: list[dict] = []
    slowest = {"answer_s": 0.0, "completion_s": 0.0, "completion_bound_s": 0.0}
    admitted = 0
    peak_rss = 0
    health = []
    t0 = time.perf_counter()
    stop_at = None if time_limit_s is None else t0 + time_limit_s
    done = 0

    def snapshot(final: bool = False) -> dict:
        mem = srv.memory_kib() if srv.proc.poll() is None else {}
        unexpected = sum(v for k, v in outcomes.items() if k not in EXPECTED)
        return {"requests": done, "of": n, "final": final, "stopped_by_time_limit": timed_out(),
                "time_limit_s": time_limit_s, "concurrency": concurrency, "deadline_s": deadline,
                "completion_bound": {"s_per_token": s_per_token, "s_per_prompt_token": s_per_prompt_token},
                "outcomes": dict(outcomes), "generate_admitted": admitted, "by_rpc": dict(sorted(by_rpc.items())),
                "top_reasons": dict(reasons.most_common(25)), "unexpected": unexpected, "unexpected_examples": bad,
                "slowest_answer_s": round(slowest["answer_s"], 2),
                "slowest_completion_s": round(slowest["completion_s"], 2),
                "largest_completion_bound_s": round(slowest["completion_bound_s"], 1),
                "always_serving": all(h == "SERVING" for h in health), "health_checks": len(health),
                "rss_peak_gib": round(mem.get("VmHWM", 0) / 2**20, 3),
                "rss_sampled_peak_gib": round(peak_rss / 2**20, 3),
                "seconds": round(time.perf_counter() - t0, 1), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def timed_out() -> bool:
        return stop_at is not None and time.perf_counter() > stop_at

    def write_partial() -> None:
        if partial is not None:  # so that a run cut off still says honestly how far it got
            tmp = partial.with_suffix(".tmp")
            tmp.write_text(json.dumps(snapshot()) + "\n")
            tmp.replace(partial)

    async def one(k: int, rpc: str, msg) -> None:
        nonlocal admitted, done
        stub = srv.stub(channels[k % len(channels)])
        start = time.perf_counter()
        answered = None
        try:
            if rpc == "Generate":
                call = stub.Generate(msg)
                try:
                    # The answer: the headers sent on admission, or (refused) the status, which ends the call.
                    headers = dict(await asyncio.wait_for(call.initial_metadata(), deadline) or ())
                    answered = time.perf_counter()
                    bound = completion_bound(msg, headers, deadline, s_per_token, s_per_prompt_token)
                    slowest["completion_bound_s"] = max(slowest["completion_bound_s"], bound)
                    if REQUEST_ID_HEADER in headers:
                        admitted += 1

                    async def read_on() -> None:  # the first messages, then hang up (a cancel, racing completion)
                        for _ in range(9):
                            if await call.read() is grpc.aio.EOF:
                                break

                    await asyncio.wait_for(read_on(), bound)
                    slowest["completion_s"] = max(slowest["completion_s"], time.perf_counter() - answered)
                    outcome = "OK"
                finally:
                    call.cancel()
            else:
                await getattr(stub, rpc)(msg, timeout=deadline)
                outcome = "OK"
        except asyncio.TimeoutError:
            outcome = "NO_ANSWER_IN_TIME" if answered is None else "NOT_DONE_IN_COMPLETION_BOUND"
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
            reasons[f"{outcome}: {_shape_of(e.details() or '')}"] += 1
        slowest["answer_s"] = max(slowest["answer_s"], (answered or time.perf_counter()) - start)
        outcomes[outcome] += 1
        by_rpc[f"{rpc}:{outcome}"] += 1
        if outcome not in EXPECTED and len(bad) < 20:
            bad.append({"rpc": rpc, "outcome": outcome, "request": str(msg)[:400]})
        done += 1
        if done % 50 == 0:
            write_partial()

    sent = 0
    for chunk in draw_requests(shape, n, seed):
        queue = list(enumerate(chunk, start=sent))
        sent += len(chunk)

        async def worker() -> None:
            while queue and not timed_out():
                k, (rpc, msg) = queue.pop()
                await one(k, rpc, msg)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        peak_rss = max(peak_rss, srv.memory_kib().get("VmRSS", 0))
        health.append(await serving(channels[0]))
        write_partial()
        plots.progress(f"fuzz: {done}/{n} done, outcomes so far {dict(outcomes)}")
        if timed_out():
            break
    idle = await wait_idle(srv.stub(channels[0]))
    budget = srv.budget_bytes()
    for c in channels:
        await c.close()
    out = snapshot(final=True)
    out.update({"memory_budget_gib": round(budget / 2**30, 3) if budget else None,
                "rss_within_budget": budget is not None and out["rss_peak_gib"] * 2**30 <= budget,
                "kv_blocks_used_after": idle.kv_blocks_used, "running_after": idle.num_running,
                "waiting_after": idle.num_waiting})
    if partial is not None:
        partial.write_text(json.dumps(out) + "\n")
    return out


def _shape_of(detail: str) -> str:
    """An error message with its numbers and quoted values blanked, so that like messages count together."""
    import re

    detail = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", detail)
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?|nan|inf", "N", detail)[:90]


async def run_cancels(srv: Server, n: int, vocab: int, seed: int = 2) -> dict:
    import grpc

    pb, _ = pb_modules()
    rng = random.Random(seed)
    channels = [srv.channel() for _ in range(4)]
    outcomes: Counter = Counter()
    found = 0
    sem = asyncio.Semaphore(32)

    async def cancel_one(i: int) -> None:
        max_tokens = rng.randint(1, 24)
        stop_after = rng.randint(0, max_tokens + 1)  # past the end = the stream completes first
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(rng, vocab, rng.randint(1, 40))),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i))
        async with sem:
            call = srv.stub(channels[i % 4]).Generate(req)
            got = 0
            if stop_after:
                async for _ in call:
                    got += 1
                    if got >= stop_after:
                        break
            call.cancel()
            outcomes["cancelled" if got >= stop_after else "completed_first"] += 1

    async def abort_one(i: int) -> None:
        nonlocal found
        max_tokens = rng.randint(1, 24)
        abort_after = rng.randint(0, max_tokens)
        rid = f"abort-{i}"
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt(rng, vocab, rng.randint(1, 40))),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i))
        async with sem:
            stub = srv.stub(channels[i % 4])
            call = stub.Generate(req)
            for _ in range(abort_after):
                if await call.read() is grpc.aio.EOF:
                    break
            resp = await stub.Abort(pb.AbortRequest(request_id=rid))
            found += resp.found
            outcome, _, _ = await read_stream(call)
            outcomes[f"abort_rpc:{outcome}"] += 1

    await asyncio.gather(*(cancel_one(i) for i in range(n)), *(abort_one(i) for i in range(n)))
    idle = await wait_idle(srv.stub(channels[0]))
    health = await serving(channels[0])
    for c in channels:
        await c.close()
    return {"cancels": n, "aborts": n, "aborts_found_in_flight": found, "outcomes": dict(outcomes),
            "kv_blocks_used_after": idle.kv_blocks_used, "running_after": idle.num_running,
            "waiting_after": idle.num_waiting, "health_after": health}


async def run_sigterm(srv: Server, n: int, vocab: int, long_tokens: int) -> dict:
    pb, _ = pb_modules()
    rng = random.Random(3)
    channels = [srv.channel() for _ in range(8)]
    started = 0
    all_started = asyncio.Event()

    async def one(i: int) -> str:
        nonlocal started
        max_tokens = 8 if i % 2 else long_tokens
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(rng, vocab, 8)),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        call = srv.stub(channels[i % 8]).Generate(req)
        first = await call.read()
        started += 1
        if started == n:
            all_started.set()
        outcome, _, finish = await read_stream(call)
        if outcome == "complete":
            return "finished:" + (finish or first.chunk.finish_reason)
        return outcome

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.wait_for(all_started.wait(), 600)
    srv.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    code = await asyncio.to_thread(srv.proc.wait, 120)
    for c in channels:
        await c.close()
    outcomes = Counter(r if isinstance(r, str) else repr(r) for r in results)
    ok = all(o in ("finished:length", "UNAVAILABLE") for o in outcomes)
    return {"streams": n, "outcomes": dict(outcomes), "each_finished_or_unavailable": ok, "exit_code": code}


async def run_small_pool(srv: Server, prompts: list[list[int]], max_tokens: int, alone: list[list[int]]) -> dict:
    pb, _ = pb_modules()
    channels = [srv.channel() for _ in range(4)]

    async def one(i: int) -> list[int]:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return [t async for msg in srv.stub(channels[i % 4]).Generate(req) for t in msg.chunk.token_ids]

    got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    stats = await wait_idle(srv.stub(channels[0]))
    info = await srv.stub(channels[0]).GetModelInfo(pb.GetModelInfoRequest())
    for c in channels:
        await c.close()
    mismatched = [i for i in range(len(prompts)) if got[i] != alone[i]]
    return {"requests": len(prompts), "max_tokens": max_tokens, "num_kv_blocks": info.num_kv_blocks,
            "blocks_the_load_needs": sum(-(-(len(p) + max_tokens) // info.block_size) for p in prompts),
            "preemptions": stats.num_preemptions, "mismatched": len(mismatched), "mismatched_ids": mismatched[:10],
            "kv_blocks_used_after": stats.kv_blocks_used}


# -- driving ------------------------------------------------------------------------------------------

def small_pool_case(model: str | None, n: int, prompt_len: int, max_tokens: int) -> tuple[list, list, int]:
    """Prompts, their greedy tokens alone (offline, one at a time), and KV bytes for a pool 10x too small."""
    from pagedserve.models.kv_cache import kv_bytes_per_block
    from pagedserve.runtime import LLM, SamplingParams

    llm = LLM(model, device="cpu", seed=0, kv_cache_memory_bytes=256 << 20)
    cfg = llm.engine.model_config
    rng = random.Random(4)
    prompts = [prompt(rng, cfg.vocab_size, prompt_len + i % 7) for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    need = sum(-(-(len(p) + max_tokens) // 16) for p in prompts)
    return prompts, alone, max(need // 10, -(-(prompt_len + 6 + max_tokens) // 16)) * kv_bytes_per_block(cfg, 16, 4)


def run(args: argparse.Namespace) -> dict:
    sizes = dict(QUICK if args.quick else FULL)
    for item in args.size:
        name, _, value = item.partition("=")
        if name not in RUNS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--size must be RUN=N with RUN one of {', '.join(RUNS)} and N >= 1, got {item!r}")
        sizes[name] = int(value)
    env = plots.environment(args.quick)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for k, name in enumerate(args.only or RUNS):
            d = tmp / f"{k}-{name}"
            d.mkdir()
            plots.progress(f"{name}: starting")
            results[name] = run_one(name, d, args.model, sizes, args.quick, args.partial, args.fuzz_time_limit)
            plots.progress(f"{name}: {json.dumps(results[name])[:300]}")
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM, "environment": env, "model": args.model,
            "config": {"sizes": sizes}, "results": results, "summary": summarize(results)}


def run_one(name: str, tmp: Path, model: str | None, sizes: dict, quick: bool, partial: str | None = None,
            time_limit_s: float | None = None) -> dict:
    if name == "small_pool":
        max_tokens = 48 if quick else 64  # short prompts, long outputs: admitted together, then preempted
        prompts, alone, kv_bytes = small_pool_case(model, sizes["small_pool"], 8, max_tokens)
        srv = Server(tmp, model, ["--kv-cache-memory-bytes", str(kv_bytes), "--max-waiting-requests", "4096"])
    elif name == "sigterm":
        srv = Server(tmp, model, ["--max-waiting-requests", "4096", "--drain-timeout", "3" if quick else "10"])
    elif name == "fuzz":
        srv = Server(tmp, model, ["--max-prompt-chars", "20000"] if quick else [])
    else:
        srv = Server(tmp, model, ["--max-waiting-requests", "4096"])
    try:
        srv.wait_serving(300)
        info = asyncio.run(_model_info(srv))
        if name == "streams":
            out = asyncio.run(run_streams(srv, sizes["streams"], 8 if quick else 16, info.vocab_size))
        elif name == "fuzz":
            shape = FuzzShape(info.vocab_size, info.max_model_len, 20000 if quick else 1_000_000)
            per_token = S_PER_TOKEN / 2.5 if quick else S_PER_TOKEN
            out = asyncio.run(run_fuzz(srv, shape, sizes["fuzz"], 8, sizes["deadline"], per_token, S_PER_PROMPT_TOKEN,
                                       partial=Path(partial) if partial else None, time_limit_s=time_limit_s))
        elif name == "cancels":
            out = asyncio.run(run_cancels(srv, sizes["cancels"], info.vocab_size))
        elif name == "sigterm":
            out = asyncio.run(run_sigterm(srv, sizes["sigterm"], info.vocab_size, min(2000, info.max_model_len - 16)))
        else:
            out = asyncio.run(run_small_pool(srv, prompts, max_tokens, alone))
    finally:
        code = srv.stop()
    out.setdefault("exit_code", code)
    errors = srv.errors_logged()
    out["server_errors_logged"] = len(errors)
    out["server_error_examples"] = errors[:5]
    return out


async def _model_info(srv: Server):
    pb, _ = pb_modules()
    async with srv.channel() as ch:
        return await srv.stub(ch).GetModelInfo(pb.GetModelInfoRequest())


def summarize(r: dict) -> dict:
    s: dict = {}
    if "streams" in r:
        s["streams_completed"] = f"{r['streams']['completed']}/{r['streams']['requests']}"
        s["claim_streams_reproduced"] = r["streams"]["lost"] == 0
    if "fuzz" in r:
        f = r["fuzz"]
        s["fuzz_outcomes"] = f["outcomes"]
        s["fuzz_requests"] = f"{f['requests']}/{f['of']}"
        s["fuzz_checks_passed"] = (f["unexpected"] == 0 and f["always_serving"] and f["rss_within_budget"]
                                   and f["kv_blocks_used_after"] == f["running_after"] == f["waiting_after"] == 0)
        s["claim_fuzz_reproduced"] = s["fuzz_checks_passed"] and f["requests"] == f["of"]  # all of them ran
    if "cancels" in r:
        s["cancels_kv_blocks_leaked"] = r["cancels"]["kv_blocks_used_after"]
        s["claim_cancels_reproduced"] = r["cancels"]["kv_blocks_used_after"] == 0
    if "sigterm" in r:
        s["sigterm_exit_code"] = r["sigterm"]["exit_code"]
        s["claim_sigterm_reproduced"] = r["sigterm"]["each_finished_or_unavailable"] and r["sigterm"]["exit_code"] == 0
    if "small_pool" in r:
        p = r["small_pool"]
        s["small_pool_mismatched"] = p["mismatched"]
        s["claim_small_pool_reproduced"] = p["mismatched"] == 0 and p["preemptions"] > 0
    return s


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/reliability.py", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--only", nargs="+", choices=RUNS, default=None, help="run only these (default: all)")
    ap.add_argument("--size", action="append", default=[], metavar="RUN=N",
                    help="override a run's count, e.g. --size fuzz=1000 (repeat for several)")
    ap.add_argument("--partial", default=None, metavar="FILE",
                    help="the fuzz writes its figures so far here every 50 requests (and its final record at the "
                         "end), so a run cut off still says how far it got")
    ap.add_argument("--fuzz-time-limit", type=float, default=None, metavar="S",
                    help="the fuzz sends no new request after S seconds; those in flight finish and every check "
                         "runs on the requests sent (the record says stopped_by_time_limit and how many)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.emit(NAME, run(args), args.out_dir, None, False, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
