"""Guided decoding's cost: 64 concurrent JSON-schema requests vs the same requests unguided, equal lengths.

1. guided    --requests requests at once, each with one of the 32 JSON schemas of
             tests/structured_schemas.py (in turn), a chat prompt asking for it, temperature 1.0 (seeded).
2. unguided  the same prompts and seeds without a constraint and with ignore_eos, in a second engine.

The two engines run in lockstep, one step each in turn, each step timed on its own, so both see the same
machine at the same moments (a shared machine's load drifts over minutes; a run-after-run comparison
measures the drift). When a guided request finishes, its unguided twin, which has produced the same number
of tokens in the same steps, is aborted: both push the same tokens through the same batch shapes and
differ only by the grammar work. The grammars are compiled before the clock starts (compile time is
reported apart, from a cold cache), as is the llguidance tokenizer (a one-time cost per engine).

Reported: output tokens/s of both and the overhead (1 - guided / unguided); grammar compile time p50/p99
(LLMatcher construction against the tokenizer, per distinct schema) and the validation time a request
pays at construction; bitmask fill time per token (in a thread beside the forward), the time the steps
still waited for it, and the time to apply a step's masks to its logits; whether every guided output
validates against its schema.

Corpus mode (--corpus DIR): real-world schemas, one dataset per subfolder of DIR holding *.json files (or
DIR itself), at most --corpus-limit per dataset (sorted by name). Per dataset: the share accepted by the
default (lenient) compile and by strict, the refusal reasons and the keywords only approximated, compile
time p50/p99 (cold cache, against the tokenizer), mask time per token, and one guided request per accepted
schema (temperature 1.0, seeded): the share of finished ("stop") outputs valid against the whole schema
(jsonschema, formats as annotations) and the share flagged (schema_violations). Saved as
structured_corpus.json.

Usage:

    .venv/bin/python bench/structured.py [--quick] [--model PATH] [--requests 64] [--max-tokens 160]
    .venv/bin/python bench/structured.py --corpus DIR [--corpus-limit 200] [--model PATH] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))  # the schemas the tests use
import plots  # noqa: E402
from structured_schemas import SCHEMAS, validate  # noqa: E402

NAME = "structured"
CLAIM = {"text": "guided decoding (JSON schema) costs at most 10% of CPU throughput", "overhead_pct": 10.0}


def _run(engine, requests) -> tuple[float, dict]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finished, t0 = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return time.perf_counter() - t0, finished


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sample.sampling_ops import apply_token_bitmask
    from pagedserve.runtime.sampling_params import SamplingParams
    from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

    env = plots.environment(args.quick)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.requests)]

    def prompt(name: str) -> list[int]:
        text = f"Write a {name.replace('_', ' ')} as JSON."
        if tok.chat_template is None:
            return tok.encode(text)
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(device=args.device, seed=0, max_num_seqs=max(args.requests, 1)), loaded=loaded)

    StructuredOutputsParams(regex="warm-up")  # llguidance's import and first call, off the clock
    validate_s = []
    for name in SCHEMAS:
        t = time.perf_counter()
        StructuredOutputsParams(json=SCHEMAS[name])
        validate_s.append(time.perf_counter() - t)

    warm = engine()  # first forward passes (numpy and BLAS warm-up) off the clock
    _run(warm, [("w", prompt(names[0]), SamplingParams(max_tokens=4, ignore_eos=True))])

    guided, unguided = engine(), engine()
    t = time.perf_counter()
    guided.structured.compiler.ll_tokenizer  # noqa: B018  (built once per engine)
    tokenizer_s = time.perf_counter() - t
    so = guided.structured
    futures = [so.compile(StructuredOutputsParams(json=SCHEMAS[n])) for n in dict.fromkeys(names)]
    for f in futures:
        f.result()  # a cold cache: one compile per distinct schema, timed in the worker
    compile_ms = [1e3 * x for x in so.compiler.compile_times_s]

    plots.progress(f"guided and unguided in lockstep: {args.requests} requests each")
    for i, n in enumerate(names):
        guided.add_request(f"r{i}", prompt(n), SamplingParams(
            temperature=1.0, seed=i, max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[n])))
        unguided.add_request(f"r{i}", prompt(n), SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                                                ignore_eos=True))
    g_out, u_tokens, g_time, u_time = {}, {}, 0.0, 0.0
    while guided.has_unfinished_requests():
        t = time.perf_counter()
        outs = guided.step()
        g_time += time.perf_counter() - t
        t = time.perf_counter()
        for out in unguided.step():
            u_tokens[out.request_id] = len(out.outputs[0].token_ids)
        u_time += time.perf_counter() - t
        done = [o.request_id for o in outs if o.finished]
        for o in outs:
            if o.finished:
                g_out[o.request_id] = o
        unguided.abort_request(done)  # its twin has just produced as many tokens: stop it there
    lengths = [len(g_out[f"r{i}"].outputs[0].token_ids) for i in range(args.requests)]
    if [u_tokens.get(f"r{i}") for i in range(args.requests)] != lengths:
        raise RuntimeError("the unguided twins did not produce the guided lengths: the lockstep broke")
    try:
        import jsonschema  # the test extra; without it validity is not checked (None)
    except ImportError:
        jsonschema = None
    valid, stopped = (0 if jsonschema else None), 0
    for i, n in enumerate(names):
        c = g_out[f"r{i}"].outputs[0]
        stopped += c.finish_reason == "stop"
        if jsonschema is not None:
            try:
                validate(json.loads(c.text), SCHEMAS[n])
                valid += 1
            except (ValueError, jsonschema.ValidationError):  # a cut or invalid output: counted, not fatal
                pass

    # Applying a step's masks: [requests, V] logits, every row constrained (the sampler's extra pass).
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    logits = rng.standard_normal((args.requests, vocab), dtype=np.float32)
    bits = rng.integers(-(2**31), 2**31, size=(args.requests, (vocab + 31) // 32)).astype(np.int32)
    reps, t = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t < 0.2:
        apply_token_bitmask(logits, np.arange(args.requests), bits)
        reps += 1
    apply_ms = 1e3 * (time.perf_counter() - t) / reps

    total = sum(lengths)
    g_tps, u_tps = total / g_time, total / u_time
    overhead = 100 * (1 - g_tps / u_tps)
    summary = {
        "guided_output_tokens_per_s": round(g_tps, 1), "unguided_output_tokens_per_s": round(u_tps, 1),
        "throughput_overhead_pct": round(overhead, 1),
        "compile_ms_p50": round(plots.percentiles(compile_ms)["p50"], 3),
        "compile_ms_p99": round(plots.percentiles(compile_ms)["p99"], 3),
        "validate_ms_p50": round(1e3 * float(np.percentile(validate_s, 50)), 3),
        "validate_ms_p99": round(1e3 * float(np.percentile(validate_s, 99)), 3),
        "mask_fill_us_per_token": round(1e6 * so.mask_time_s / max(so.num_masked_tokens, 1), 1),
        "mask_wait_us_per_token": round(1e6 * so.mask_wait_s / max(so.num_masked_tokens, 1), 1),
        "mask_apply_ms_per_step": round(apply_ms, 2),
        "valid_outputs": valid, "stopped_outputs": stopped, "requests": args.requests,
        "claim_10pct_reproduced": bool(overhead <= CLAIM["overhead_pct"]),
    }
    results = {"guided": {"seconds": round(g_time, 3), "output_tokens": total, "lengths": lengths},
               "unguided": {"seconds": round(u_time, 3), "output_tokens": total},
               "compile_ms": [round(x, 4) for x in compile_ms], "llguidance_tokenizer_build_s": round(tokenizer_s, 3),
               "masked_tokens": so.num_masked_tokens}
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "requests": args.requests,
                       "max_tokens": args.max_tokens, "distinct_schemas": len(set(names)), "device": args.device,
                       "temperature": 1.0},
            "environment": env, "results": results, "summary": summary}


def load_corpus(root: Path, limit: int) -> dict[str, list[tuple[str, str]]]:
    """dataset -> [(file name, schema text)]: each subfolder of `root` holding *.json (searched below it) is a
    dataset, and *.json directly in `root` one more, named after `root`; at most `limit` files each."""
    if not root.is_dir():
        raise ValueError(f"--corpus {root}: not a directory")
    found = {}
    direct = sorted(root.glob("*.json"))
    if direct:
        found[root.name] = direct
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(sub.rglob("*.json"))
        if files:
            found[sub.name] = files
    if not found:
        raise ValueError(f"--corpus {root}: no *.json schema files in it or its subfolders")
    return {name: [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files[:limit]]
            for name, files in found.items()}


def _reason(error: str) -> str:
    """A refusal message without what varies from schema to schema (quoted values, positions)."""
    error = re.sub(r"^structured_outputs\.json ", "", error)
    return re.sub(r"(\"[^\"]*\"|'[^']*'|\d+)", "_", error)[:120]


def _conforms(schema, value) -> bool:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator) \
        if isinstance(schema, dict) else jsonschema.Draft202012Validator
    return cls(schema).is_valid(value)


def run_corpus(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams
    from pagedserve.runtime.structured_output import schema_share
    from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

    env = plots.environment(args.quick)
    corpus = load_corpus(Path(args.corpus), args.corpus_limit)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    StructuredOutputsParams(regex="warm-up")  # llguidance's import and first call, off the clock
    engine = LLMEngine(EngineConfig(device=args.device, seed=0, max_num_seqs=args.requests), loaded=loaded)
    so = engine.structured
    so.compiler.ll_tokenizer  # noqa: B018  (built once per engine, off the clock)
    max_prompt = max(1, min(512, engine.max_model_len - args.max_tokens - 1))

    def prompt(name: str, text: str) -> list[int]:
        ask = f"Write a JSON value for the schema {name}:\n{text[:1500]}"
        if tok.chat_template is None:
            ids = tok.encode(ask)
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": ask}], tokenize=True)
        return list(ids)[-max_prompt:]

    datasets, total = {}, Counter()
    for ds, files in corpus.items():
        plots.progress(f"{ds}: {len(files)} schemas")
        refused, approximated, compile_ms, validate_ms, accepted = Counter(), Counter(), [], [], []
        strict_ok = 0
        for name, text in files:
            try:
                StructuredOutputsParams(json=text, strict=True)
                strict_ok += 1
            except ValueError:
                pass
            schema_share.clear_cache()  # the validation timed is a first sight of the schema
            t = time.perf_counter()
            try:
                params = StructuredOutputsParams(json=text)
            except ValueError as e:
                refused[_reason(str(e))] += 1
                continue
            validate_ms.append(1e3 * (time.perf_counter() - t))
            approximated.update({w.split(":", 1)[0] for w in params.warnings})
            before = len(so.compiler.compile_times_s)
            try:
                so.compile(params).result()
            except ValueError as e:  # against this tokenizer (a character no token produces, ...)
                refused[_reason(str(e))] += 1
                continue
            compile_ms.extend(1e3 * x for x in so.compiler.compile_times_s[before:])
            accepted.append((name, text, params))
        mask_s, masked = so.mask_time_s, so.num_masked_tokens
        for i, (name, text, params) in enumerate(accepted):
            engine.add_request(f"{ds}/{i}", prompt(name, text), SamplingParams(
                temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=params))
        _, finished = _run(engine, [])
        stopped = valid = flagged = flagged_invalid = 0
        for i, (name, text, params) in enumerate(accepted):
            c = finished[f"{ds}/{i}"].outputs[0]
            if c.finish_reason != "stop":
                continue
            stopped += 1
            flagged += bool(c.schema_violations)
            try:
                ok = _conforms(json.loads(text), json.loads(c.text))
            except ValueError:
                ok = False
            valid += ok
            flagged_invalid += (not ok) and bool(c.schema_violations)
        n = len(files)
        tokens = so.num_masked_tokens - masked
        row = {
            "schemas": n, "compiled": len(accepted), "compiled_share": round(len(accepted) / n, 3),
            "strict_accepted_share": round(strict_ok / n, 3),
            "with_warnings": sum(1 for *_, p in accepted if p.warnings),
            "finished": stopped, "finished_valid_share": round(valid / stopped, 3) if stopped else None,
            "finished_flagged": flagged,
            "invalid_unflagged": stopped - valid - flagged_invalid,  # must be 0: nothing invalid passes as valid
            "compile_ms_p50": plots.percentiles(compile_ms)["p50"],
            "compile_ms_p99": plots.percentiles(compile_ms)["p99"],
            "validate_ms_p50": plots.percentiles(validate_ms)["p50"],
            "mask_us_per_token": round(1e6 * (so.mask_time_s - mask_s) / tokens, 1) if tokens else None,
            "refusals": dict(refused.most_common(10)), "approximated_keywords": dict(approximated.most_common()),
        }
        for k in ("compile_ms_p50", "compile_ms_p99", "validate_ms_p50"):
            row[k] = None if row[k] is None else round(row[k], 3)
        datasets[ds] = row
        total.update(schemas=n, compiled=len(accepted), strict=strict_ok, finished=stopped, valid=valid,
                     invalid_unflagged=row["invalid_unflagged"])
    summary = {"datasets": len(datasets), "schemas": total["schemas"],
               "compiled_share": round(total["compiled"] / total["schemas"], 3),
               "strict_accepted_share": round(total["strict"] / total["schemas"], 3),
               "finished_valid_share": round(total["valid"] / total["finished"], 3) if total["finished"] else None,
               "invalid_unflagged": total["invalid_unflagged"]}
    return {"benchmark": f"{NAME}_corpus", "quick": args.quick,
            "config": {"model": loaded.name, "model_path": str(loaded.path), "corpus": str(args.corpus),
                       "corpus_limit": args.corpus_limit, "max_tokens": args.max_tokens, "device": args.device,
                       "temperature": 1.0},
            "environment": env, "results": datasets, "summary": summary}


def draw(record: dict, path: Path) -> None:
    s, cfg, res = record["summary"], record["config"], record["results"]
    title = (f"{cfg['requests']} concurrent JSON-schema requests vs unguided, equal lengths ({cfg['model']})")
    with plots.figure(path, title, ncols=2, size=(11, 4.2)) as (ax1, ax2):
        bars = ax1.bar(["unguided", "guided"], [s["unguided_output_tokens_per_s"], s["guided_output_tokens_per_s"]],
                       color=["#9ecae1", "#2a7ab9"])
        plots.bar_labels(ax1, bars)
        plots.claim_line(ax1, 0.9 * s["unguided_output_tokens_per_s"], "claim: guided >= 90% of unguided")
        ax1.set_ylabel("output tokens/s")
        ax1.set_title(f"Throughput; overhead {s['throughput_overhead_pct']:.1f}%")
        ax1.legend(fontsize=8)
        ax2.hist(res["compile_ms"], bins=20, color="#2a7ab9")
        ax2.set_xlabel("grammar compile time (ms)")
        ax2.set_ylabel("schemas")
        ax2.set_title(f"Compile p50 {s['compile_ms_p50']:.2f} ms, p99 {s['compile_ms_p99']:.2f} ms; "
                      f"mask {s['mask_fill_us_per_token']:.0f} us/token")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench structured", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 160 (48 with --quick)")
    ap.add_argument("--corpus", default=None, help="a folder of real-world schemas (see Corpus mode above)")
    ap.add_argument("--corpus-limit", type=int, default=None, help="schemas per dataset; default 200 (10 with --quick)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"requests": 8, "max_tokens": 48, "corpus_limit": 10},
                        full={"requests": 64, "max_tokens": 160, "corpus_limit": 200},
                        positive=("requests", "max_tokens", "corpus_limit"))
    if args.corpus is not None:
        plots.emit(f"{NAME}_corpus", run_corpus(args), args.out_dir, None, False, t0)
        return 0
    plots.emit(NAME, run(args), args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
