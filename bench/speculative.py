"""Speculative decoding: output tokens/s with and without drafts, single stream and 8 streams.

Three workloads (and a fourth on request), greedy, on the embedded SmolLM2 (chat template):

  code_edit   rename a variable / function / parameter in a ~260-token Python file, or repeat it, and show
              the whole code: the answer repeats most of the prompt.
  quote       answer a question about a passage by quoting it word for word (a RAG answer citing its source).
  chat        plain questions (a story, an explanation, advice): little to look up.
  json        (not in the default run) "repeat this JSON record" under the record's JSON Schema (guided
              decoding): drafts are checked against the grammar and verify rows masked by it.

Methods: off, n-gram (prompt lookup, k = 4 to start, adaptive, n-grams of 2..4 tokens), suffix decoding
(suffix trees over the request and earlier outputs, runtime/spec_decode/suffix_proposer.py, vLLM's
defaults), and on request a self-draft (--methods draft: the target's first --draft-layers layers; k = 3).
Each (workload, streams, method) runs in a fresh engine; the figure is decode throughput: output tokens after
each request's first one, divided by the time from the moment every request had its first token to the end
(the prefill is the same for every method and is reported apart). Greedy outputs are checked equal to `off`.

Timing on a shared machine. The engine runs single-threaded (--cpu-threads 1) and each rate is given
twice: per wall-clock second and per CPU second of this process (time.process_time); speedups are taken
from the CPU-time rates, which other processes on the cores move least. The methods run interleaved (off,
ngram, suffix, off, ngram, suffix, ...) --rounds times and each reports its median round; the record is
marked contended. The table on stderr names the CPU, the numba code path, the BLAS kernel and threads, and
gives per method the speedup, the acceptance rate, the tokens per verify step and the policy's 5-row step
cost in decode steps (calibrated at start, runtime/spec_decode/calibration.py, then measured).

Single stream means each of the workload's prompts alone, one after another, each in a fresh engine
(4 code-edit or quote prompts, 8 chat ones; --single-prompts N takes the first N); the rates are over all of
them, and per-prompt speedups are kept in the JSON. 8 streams run the first 8 prompts (cycling) together.

Goals (the summary's claim_* flags, on a full run): >= 1.5x single stream on code_edit and quote, >= 0.97x
on chat, >= 0.97x with 8 streams. --methods, --ngram-config and --suffix-config are for A/B runs.

    .venv/bin/python bench/speculative.py [--quick] [--model PATH] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plots  # noqa: E402

NAME = "speculative"
CLAIM = {"text": "n-gram and suffix speculation: >= 1.5x single-stream decode on a code edit and on an answer "
                 "quoting a passage, >= 0.97x on free chat, >= 0.97x with 8 streams",
         "copy_speedup": 1.5, "chat_min_speedup": 0.97, "batch_min_speedup": 0.97}

CODE = '''def merge_sort(items):
    """Sort a list with merge sort and return a new list."""
    if len(items) <= 1:
        return list(items)
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged


def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
'''

PROSE = ("The printing press changed how knowledge moved through Europe. Before it, books were copied by hand, "
         "usually in monasteries, and a single volume could take months to finish. After Gutenberg built his "
         "press in Mainz around 1440, a workshop could print hundreds of copies of a book in the time a scribe "
         "needed for one. Prices fell, and more people learned to read. Printers spread to Venice, Paris and "
         "London within a few decades, and pamphlets carried new ideas about science, religion and politics "
         "faster than any authority could control them. Scholars could compare identical copies of a text, "
         "cite page numbers, and build on each other's work. Some historians argue that the scientific "
         "revolution would have been impossible without this steady supply of cheap, accurate books. Others "
         "point out that the press also spread errors, rumours and propaganda just as quickly. Either way, "
         "the way people stored and shared what they knew had changed for good.")

PASSAGE = ("The city library opened its new reading room on the first of March. The room seats eighty people "
           "and stays open until ten in the evening on weekdays. Visitors may borrow up to six books at a time, "
           "for three weeks, and renew them twice online. Laptops can be used at every table, and the wireless "
           "network needs no password. Group study rooms must be booked at the front desk at least one day "
           "ahead. Food is not allowed in the reading room, but covered drinks are.")

# A code edit that repeats most of the prompt: the answer is the code again with a small change.
CODE_EDIT = [
    ("Rename the variable `merged` to `result` in this code and show the whole code:\n\n" + CODE, "```python\n"),
    ("Repeat the following code exactly, without any change:\n\n" + CODE, "```python\n"),
    ("Rename the function `binary_search` to `find_index` and show the whole code:\n\n" + CODE, "```python\n"),
    ("Rename the parameter `items` to `values` everywhere in this code and show the whole code:\n\n" + CODE,
     "```python\n"),
]
# An answer quoting a given passage (a RAG answer citing its source word for word).
QUOTE = [
    ("Read the passage and answer by quoting the sentences that answer the question, word for word.\n\n"
     "Passage: " + PASSAGE + "\n\nQuestion: What are the rules for borrowing books and using the rooms?", "\""),
    ("Read the passage and answer by quoting it word for word.\n\nPassage: " + PROSE
     + "\n\nQuestion: What happened after Gutenberg built his press?", "\""),
    ("Quote the passage below in full, then say in one sentence what it is about.\n\n" + PASSAGE, "\""),
    ("Copy this paragraph, replacing 'printing press' with 'press':\n\n" + PROSE, ""),
]
WORKLOADS = {"code_edit": CODE_EDIT, "quote": QUOTE}

RECORD = {"order_id": 48213, "customer": {"name": "Maria Fernandez", "email": "maria.fernandez@example.com",
                                           "city": "Valencia"},
          "items": [{"sku": "KB-2041", "name": "mechanical keyboard", "qty": 1, "price": 89.5},
                    {"sku": "MS-1187", "name": "wireless mouse", "qty": 2, "price": 24.99},
                    {"sku": "CB-0032", "name": "usb-c cable", "qty": 3, "price": 7.25}],
          "status": "shipped", "notes": "leave the parcel with the neighbour"}
TEXT = {"type": "string", "maxLength": 60}
RECORD_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["order_id", "customer", "items", "status", "notes"],
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "city"],
                     "properties": {"name": TEXT, "email": TEXT, "city": TEXT}},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "name", "qty", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}, "name": TEXT,
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0, "maximum": 10000}}}},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "notes": TEXT,
    },
}

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, in simple terms.",
    "Give me five tips for getting better sleep.",
    "What are the main differences between cats and dogs as pets?",
    "Describe a perfect autumn day in the countryside.",
    "How do I start learning to play the guitar?",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Suggest a healthy breakfast and explain why it is good.",
]


def prompts(tokenizer, workload: str, streams: int) -> list[list[int]]:
    out = []
    for i in range(streams):
        if workload in WORKLOADS:
            text, prefix = WORKLOADS[workload][i % len(WORKLOADS[workload])]
        elif workload == "json":
            text, prefix = "Repeat this JSON record exactly, as compact JSON:\n\n" + json.dumps(RECORD), ""
        else:
            text, prefix = CHAT[i % len(CHAT)], ""
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids) + (tokenizer.encode(prefix) if prefix else []))
    return out


def run_single(loaded, args: argparse.Namespace, spec: dict | None, batch: list[list[int]],
               workload: str = "") -> dict:
    """Single stream: each prompt of the workload alone, one after another, each in a fresh engine (so
    nothing learned on one prompt helps the next); rates are over all of them, per-prompt figures kept."""
    runs = [run_one(loaded, args, spec, [p], workload) for p in batch]
    res = {k: round(sum(r[k] for r in runs), 3)
           for k in ("output_tokens", "e2e_s", "decode_s", "e2e_cpu_s", "decode_cpu_s")}
    decode_tokens = sum(r["decode_tokens"] for r in runs)
    res.update(e2e_tokens_per_s=round(res["output_tokens"] / res["e2e_s"], 2),
               decode_tokens_per_s=round(decode_tokens / res["decode_s"], 2),
               decode_tokens_per_cpu_s=round(decode_tokens / res["decode_cpu_s"], 2),
               tokens=[r["tokens"][0] for r in runs],
               per_prompt=[{k: r[k] for k in ("decode_tokens", "decode_cpu_s", "decode_s")} for r in runs])
    if spec is not None:
        draft, acc, steps = (sum(r[k] for r in runs) for k in ("draft_tokens", "accepted_tokens", "verify_steps"))
        res["verify_5_rows_in_steps"] = runs[-1].get("verify_5_rows_in_steps")  # the last prompt's engine
        res.update(draft_tokens=draft, accepted_tokens=acc, verify_steps=steps,
                   acceptance_rate=round(acc / draft, 4) if draft else 0.0,
                   mean_accepted_length=round(1 + acc / steps, 3) if steps else 0.0)
    return res


def run_one(loaded, args: argparse.Namespace, spec: dict | None, batch: list[list[int]], workload: str = "") -> dict:
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(device=args.device, seed=0, speculative_config=spec, cpu_threads=args.cpu_threads,
                                    max_model_len=2048, kv_cache_memory_bytes=256 << 20, max_num_seqs=16),
                       loaded=loaded)
    guided = None
    if workload == "json":
        from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

        guided = StructuredOutputsParams(json=RECORD_SCHEMA)
        engine.structured.compile(guided).result()  # compiled before the clock starts
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                     structured_outputs=guided))
    started: set[str] = set()
    all_first_at, tokens_at_all_first, produced = None, 0, 0
    done, finished = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
            produced += len(out.outputs[0].new_token_ids)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                finished[out.request_id] = out.outputs[0]
        if all_first_at is None and len(started) == len(batch):
            all_first_at, cpu_first_at, tokens_at_all_first = time.perf_counter(), time.process_time(), produced
    end, cpu_end = time.perf_counter(), time.process_time()
    total = sum(len(t) for t in done.values())
    if guided is not None:  # an output the grammar completed is a whole record of the schema
        assert all(isinstance(json.loads(c.text), dict) for c in finished.values() if c.finish_reason == "stop")
    decode_tokens = total - tokens_at_all_first
    res = {"output_tokens": total, "decode_tokens": decode_tokens, "e2e_s": round(end - t0, 3),
           "e2e_tokens_per_s": round(total / (end - t0), 2),
           "decode_s": round(end - all_first_at, 3),
           "decode_tokens_per_s": round(decode_tokens / (end - all_first_at), 2) if end > all_first_at else None,
           "e2e_cpu_s": round(cpu_end - c0, 3), "decode_cpu_s": round(cpu_end - cpu_first_at, 3),
           "decode_tokens_per_cpu_s": round(decode_tokens / (cpu_end - cpu_first_at), 2)
           if cpu_end > cpu_first_at else None,
           "tokens": [done[str(i)] for i in range(len(batch))]}
    if engine.spec is not None:
        res["verify_5_rows_in_steps"] = round(engine.spec.policy.costs.ratio(5, 1), 3)  # the policy's figure at the end
        s = engine.spec.stats
        res.update(draft_tokens=s.num_draft_tokens, accepted_tokens=s.num_accepted_tokens,
                   acceptance_rate=round(s.acceptance_rate, 4), mean_accepted_length=round(s.mean_accepted_length, 3),
                   verify_steps=s.num_drafts)
    return res


def median_round(rounds: list[dict]) -> dict:
    """The round with the median decode rate per CPU second (the lower middle one of an even count)."""
    ranked = sorted(rounds, key=lambda r: r["decode_tokens_per_cpu_s"] or 0.0)
    pick = dict(ranked[(len(ranked) - 1) // 2])
    pick["rounds_decode_tokens_per_cpu_s"] = [r["decode_tokens_per_cpu_s"] for r in rounds]
    return pick


def run(args: argparse.Namespace) -> dict:
    from pagedserve.models.loading.loader import load_model
    from pagedserve.runtime.spec_decode.calibration import cpu_name

    env = plots.environment(args.quick)
    env["cpu"] = cpu_name()
    env["contended"] = True  # figures are medians of interleaved rounds on a machine shared with other work
    loaded = load_model(args.model)
    methods = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.ngram_tokens, "prompt_lookup_max": 4,
                  "prompt_lookup_min": args.prompt_lookup_min},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.ngram_tokens},
        "draft": {"method": "draft", "draft_num_layers": args.draft_layers, "num_speculative_tokens": 3},
    }
    methods["ngram"].update(json.loads(args.ngram_config))
    methods["suffix"].update(json.loads(args.suffix_config))
    methods = {m: spec for m, spec in methods.items() if m == "off" or m in args.methods}
    results: dict = {}
    for workload in args.workloads:
        for streams in args.streams:
            distinct = {"chat": len(CHAT), "json": 1}.get(workload) or len(WORKLOADS[workload])
            batch = prompts(loaded.tokenizer, workload, streams if streams > 1 else min(args.single_prompts, distinct))
            row = results.setdefault(workload, {}).setdefault(f"streams_{streams}", {})
            rounds: dict[str, list[dict]] = {m: [] for m in methods}
            for rnd in range(args.rounds):  # interleaved: off, ngram, suffix, off, ngram, suffix, ...
                for method, spec in methods.items():
                    plots.progress(f"{workload}, {streams} stream(s), {method}, round {rnd + 1}")
                    rounds[method].append(run_single(loaded, args, spec, batch, workload) if streams == 1
                                          else run_one(loaded, args, spec, batch, workload))
            for method in methods:
                row[method] = median_round(rounds[method])
            for method in [m for m in methods if m != "off"]:
                r = row[method]
                if "per_prompt" in r:
                    for mine, off in zip(r["per_prompt"], row["off"]["per_prompt"]):
                        mine["speedup"] = round((mine["decode_tokens"] / mine["decode_cpu_s"])
                                                / (off["decode_tokens"] / off["decode_cpu_s"]), 3)
                r["same_tokens_as_off"] = all(x["tokens"] == rounds["off"][0]["tokens"] for x in rounds[method])
                r.pop("tokens")
                r["speedup"] = round(r["decode_tokens_per_cpu_s"] / row["off"]["decode_tokens_per_cpu_s"], 3)
                r["speedup_wall"] = round(r["decode_tokens_per_s"] / row["off"]["decode_tokens_per_s"], 3)
            row["off"].pop("tokens")
    spec_methods = [m for m in methods if m != "off"]
    summary = {
        "speedup": {f"{w}/{k}/{m}": v[m]["speedup"] for w in results for k, v in results[w].items()
                    for m in spec_methods},
        "acceptance_rate": {f"{w}/{k}/{m}": v[m]["acceptance_rate"] for w in results for k, v in results[w].items()
                            for m in spec_methods},
        "tokens_per_verify": {f"{w}/{k}/{m}": v[m]["mean_accepted_length"] for w in results
                              for k, v in results[w].items() for m in spec_methods},
        "greedy_outputs_identical": all(v[m]["same_tokens_as_off"] for w in results for v in results[w].values()
                                        for m in spec_methods),
    }
    full = not args.quick and {"code_edit", "quote", "chat"} <= set(results) and 1 in args.streams
    for m in spec_methods:  # the goals, per method; none on a quick or partial run
        one = [results[w]["streams_1"][m]["speedup"] for w in ("code_edit", "quote")] if full else []
        chat = [results["chat"][k][m]["speedup"] for k in results["chat"]] if full else []
        batch = [v[m]["speedup"] for w in results for k, v in results[w].items() if k != "streams_1"] if full else []
        summary[f"claim_{m}_copy_reproduced"] = min(one) >= CLAIM["copy_speedup"] if one else None
        summary[f"claim_{m}_chat_reproduced"] = min(chat) >= CLAIM["chat_min_speedup"] if chat else None
        summary[f"claim_{m}_batch_reproduced"] = min(batch) >= CLAIM["batch_min_speedup"] if batch else None
    return {"benchmark": NAME, "quick": args.quick, "claim": CLAIM,
            "config": {"model": loaded.name, "max_tokens": args.max_tokens, "streams": args.streams,
                       "rounds": args.rounds, "single_stream_prompts": args.single_prompts,
                       "speedup_from": "decode tokens per CPU second (process_time), median of interleaved rounds",
                       "draft_layers": args.draft_layers, "cpu_threads": args.cpu_threads, "device": args.device,
                       "sampling": "greedy", "methods": methods},
            "environment": env, "results": results, "summary": summary}


def report(record: dict) -> None:
    """The figures as a table on stderr (stdout carries the JSON)."""
    env = record["environment"]
    lines = [f"CPU {env.get('cpu')}, numba code path {env.get('numba_code_path')}, BLAS kernel "
             f"{env.get('blas_kernel')}, engine threads {record['config']['cpu_threads']} (BLAS threads "
             f"{env.get('blas_threads')}), load {env.get('loadavg')}; contended: medians of "
             f"{record['config']['rounds']} interleaved round(s)",
             f"{'workload':<10} {'streams':>7} {'method':<7} {'tok/CPU s':>9} {'speedup':>7} {'accept':>6} "
             f"{'tok/verify':>10} {'5-row step':>10}"]
    for w, by_streams in record["results"].items():
        for k, row in by_streams.items():
            for m, r in row.items():
                lines.append(f"{w:<10} {k.replace('streams_', ''):>7} {m:<7} {r['decode_tokens_per_cpu_s'] or 0:>9.1f} "
                             f"{r.get('speedup', 1.0):>7.3f} {r.get('acceptance_rate', 0.0):>6.2f} "
                             f"{r.get('mean_accepted_length', 0.0):>10.2f} "
                             f"{r.get('verify_5_rows_in_steps') or 0:>10.2f}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def draw(record: dict, path: Path) -> None:
    res = record["results"]
    cols = [(w, k) for w in res for k in res[w]]
    labels = [f"{w}\n{k.replace('streams_', '')} stream(s)" for w, k in cols]
    methods = [(m, c) for m, c in (("off", "#888888"), ("ngram", "#2a7ab9"), ("suffix", "#3a9a4a"),
                                   ("draft", "#d98b2b")) if m in record["config"]["methods"]]
    with plots.figure(path, f"Speculative decoding, {record['config']['model']}, greedy, "
                            f"{record['config']['max_tokens']} new tokens", ncols=2, size=(13, 4.4)) as (ax1, ax2):
        x = np.arange(len(cols))
        for n, (m, color) in enumerate(methods):
            vals = [res[w][k][m]["decode_tokens_per_cpu_s"] or 0 for w, k in cols]
            plots.bar_labels(ax1, ax1.bar(x + (n - 1) * 0.27, vals, 0.27, label=m, color=color))
        ax1.set_xticks(x, labels, fontsize=8)
        ax1.set_ylabel("decode output tokens per CPU second (1 thread)")
        ax1.legend(fontsize=8)
        ax1.set_title("Throughput")
        for n, (m, color) in enumerate(methods[1:]):
            vals = [(res[w][k][m].get("acceptance_rate") or 0) * 100 for w, k in cols]
            plots.bar_labels(ax2, ax2.bar(x + (n - 0.5) * 0.35, vals, 0.35, label=m, color=color), "{:.0f}")
        ax2.set_xticks(x, labels, fontsize=8)
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("drafts accepted (%)")
        ax2.set_title("Acceptance rate")
        ax2.legend(fontsize=8)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve bench speculative", description=__doc__.splitlines()[0])
    plots.add_common_args(ap)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="default 1 8 (1 2 with --quick)")
    ap.add_argument("--ngram-tokens", type=int, default=4, help="k of the n-gram method (default 4)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram match (default 2)")
    ap.add_argument("--workloads", nargs="+", default=["code_edit", "quote", "chat"],
                    choices=["code_edit", "quote", "chat", "json"],
                    help="json: guided decoding (not in the default run)")
    ap.add_argument("--draft-layers", type=int, default=None, help="self-draft layers; default 8 (1 with --quick)")
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix", "draft"],
                    help="methods run beside 'off' (default ngram suffix; draft: a self-draft)")
    ap.add_argument("--ngram-config", default="{}",
                    help='JSON merged into the n-gram speculative_config, e.g. \'{"min_acceptance_rate": 0}\'')
    ap.add_argument("--suffix-config", default="{}", help="JSON merged into the suffix speculative_config")
    ap.add_argument("--single-prompts", type=int, default=None,
                    help="single stream: how many of the workload's prompts run, one at a time "
                         "(default all; 2 with --quick)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="numpy BLAS threads (default 1: the CPU-time rates assume one thread)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved runs per method, median kept; default 3 (1 with --quick)")
    return ap


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plots.fill_defaults(args, quick={"max_tokens": 8, "streams": [1, 2], "draft_layers": 1, "rounds": 1,
                                     "single_prompts": 2},
                        full={"max_tokens": 64, "streams": [1, 8], "draft_layers": 8, "rounds": 3, "single_prompts": 8},
                        positive=("max_tokens", "streams", "draft_layers", "rounds", "single_prompts"))
    record = run(args)
    report(record)
    plots.emit(NAME, record, args.out_dir, draw, not args.no_plot, t0)
    return 0


if __name__ == "__main__":
    plots.run_script(main)
