"""Greedy goldens of the packaged Gemma 3 270M (`--model gemma3-270m`) from transformers fp32 on the same GGUF file.

transformers loads the GGUF with its own dequantizer (gguf-py, to float32) and runs Gemma3ForCausalLM on CPU in
float32 with eager attention; pagedserve's tests compare their tokens with these. Two files:

  tests/data/goldens/gemma3-270m.npz       four short base-model prompts (the GGUF's tokenizer, <bos> first), per i
        prompt_ids_{i}        int64 [L]
        greedy_ids_{i}        int64 [32]     a plain loop of full forwards + argmax (no KV cache, no EOS stopping)
        greedy_top2_ids_{i}   int64 [32]     the runner-up at each greedy step
        greedy_top2_gap_{i}   float32 [32]   top-1 minus top-2 logit at each greedy step (how safe argmax is)
        last_topk_ids_{i}     int64 [10]     top-10 ids at the last prompt position, by logit, descending
        last_topk_logits_{i}  float32 [10]   their logits
        num_prompts           int64 scalar
  tests/data/goldens/gemma3-270m-long.npz  one prompt of LONG_TOKENS tokens, well past the 512-token window of the
                                           sliding layers (and past the engine's default 2048-token step budget)
        prompt_ids            int64 [L]
        tail_top1_ids         int64 [16]     argmax at the last 16 prompt positions (one forward over the prompt)
        tail_top2_gap         float32 [16]   top-1 minus top-2 there
        tail_top1_ids_global  int64 [16]     the same with the sliding layers' window opened to the whole prompt
                                             (their local rope kept): shows that the window decides some of
                                             these, so a kernel that ignored it would fail
        greedy_ids            int64 [LONG_GREEDY]  greedy continuation by full forwards
        greedy_top2_ids       int64 [LONG_GREEDY]
        greedy_top2_gap       float32 [LONG_GREEDY]
  tests/data/goldens/gemma3-270m_goldens.json  versions, the GGUF's sha256 (the test checks it is the file it
                                           loads), prompt texts, greedy texts, smallest gaps

The file is found as pagedserve finds it (models/loading/packaged.py joins the part packages into its cache): the
project's venv is asked for the path in a subprocess, so this process never imports pagedserve. Run from the
repository root with the oracle venv (it needs accelerate for transformers' GGUF loading), about 10 minutes on 2
busy cores:

    OMP_NUM_THREADS=2 /work/oracle-venv/bin/python scripts/make_gemma3_goldens.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "goldens"
NUM_GREEDY = 32
TOP_K = 10
TAIL = 16
LONG_TOKENS = 2300  # > 2048: the engine's default budget cuts it into two chunks, the second reaching back
LONG_GREEDY = 4

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Here is a list of the planets of the solar system, in order from the sun:\n1. Mercury\n2.",
]

# The long prompt: facts stated at its start (past the window by the end), text in between, a question at the end.
LONG_HEAD = (
    "Notes for the expedition.\n"
    "The expedition leader is Dr. Amelia Okonkwo. The ship is called the Northern Lantern. The base camp is at "
    "Lake Vostok. The radio call sign is Kestrel Seven. The supply drop happens every Thursday.\n\n"
)
LONG_TAIL = (
    "\n\nQuestions about the notes.\n"
    "Q: What is the name of the ship?\nA: The ship is called the Northern Lantern.\n"
    "Q: Who is the expedition leader?\nA: The expedition leader is Dr. Amelia Okonkwo.\n"
    "Q: What is the radio call sign?\nA: The radio call sign is"
)


def filler_text() -> str:
    """Plain English prose from the Python standard library's module docstrings (stable within a Python release;
    the golden stores the token ids, so only a rerun of this script reads it)."""
    import argparse as m1
    import collections as m2
    import difflib as m3
    import email as m4
    import json as m5
    import logging as m6
    import pickle as m7
    import re as m8
    import textwrap as m9
    import unittest as m10

    return "\n\n".join(m.__doc__.strip() for m in (m1, m2, m3, m4, m5, m6, m7, m8, m9, m10) if m.__doc__)


def packaged_path() -> Path:
    code = ("from pagedserve.models.loading import packaged; "
            "print(packaged.resolve(packaged.PACKAGED_MODELS['gemma3-270m'])[0])")
    out = subprocess.run([str(REPO_ROOT / ".venv/bin/python"), "-c", code], check=True, capture_output=True,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@torch.inference_mode()
def last_logits(model, ids: list[int], keep: int = 1) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids], dtype=torch.long), logits_to_keep=keep, use_cache=False).logits[0]


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[int], list[float]]:
    seq, ids, runner_up, gaps = list(prompt), [], [], []
    for _ in range(n):
        two = torch.topk(last_logits(model, seq)[-1].float(), 2)
        ids.append(int(two.indices[0]))
        runner_up.append(int(two.indices[1]))
        gaps.append(float(two.values[0] - two.values[1]))
        seq.append(ids[-1])
    return ids, runner_up, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the joined GGUF (default: where pagedserve's cache keeps it)")
    args = parser.parse_args()
    path = args.gguf or packaged_path()
    digest = sha256_of(path)
    print(f"{path} sha256 {digest}, torch threads {torch.get_num_threads()}", flush=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    print(f"config: layer_types {cfg.layer_types}, sliding_window {cfg.sliding_window}, query_pre_attn_scalar "
          f"{cfg.query_pre_attn_scalar}, rope {cfg.rope_parameters}", flush=True)

    short, info_short = {"num_prompts": np.asarray(len(PROMPTS), dtype=np.int64)}, []
    for i, text in enumerate(PROMPTS):
        t = time.time()
        ids = tok(text)["input_ids"]
        with torch.inference_mode():
            top = torch.topk(last_logits(model, ids)[-1].float(), TOP_K)
        g, r, gaps = greedy(model, ids, NUM_GREEDY)
        short.update({f"prompt_ids_{i}": np.asarray(ids, np.int64), f"greedy_ids_{i}": np.asarray(g, np.int64),
                      f"greedy_top2_ids_{i}": np.asarray(r, np.int64),
                      f"greedy_top2_gap_{i}": np.asarray(gaps, np.float32),
                      f"last_topk_ids_{i}": top.indices.numpy().astype(np.int64),
                      f"last_topk_logits_{i}": top.values.numpy().astype(np.float32)})
        info_short.append({"prompt": text, "prompt_tokens": len(ids), "greedy_text": tok.decode(g),
                           "min_greedy_top2_gap": min(gaps)})
        print(f"  prompt {i} ({len(ids)} tokens, {time.time() - t:.0f}s): {tok.decode(g)!r}, min gap {min(gaps):.4f}",
              flush=True)
    np.savez_compressed(GOLDEN_DIR / "gemma3-270m.npz", **short)

    head, tail = tok(LONG_HEAD)["input_ids"], tok(LONG_TAIL, add_special_tokens=False)["input_ids"]
    filler = tok(filler_text(), add_special_tokens=False)["input_ids"]
    need = LONG_TOKENS - len(head) - len(tail)
    assert len(filler) >= need, f"filler text has {len(filler)} tokens, {need} needed"
    long_ids = head + filler[:need] + tail
    t = time.time()
    tail_logits = last_logits(model, long_ids, keep=TAIL).float()
    two = torch.topk(tail_logits, 2, dim=-1)
    print(f"  long prompt ({len(long_ids)} tokens): one forward {time.time() - t:.0f}s", flush=True)
    g, runner_up, gaps = greedy(model, long_ids, LONG_GREEDY)
    print(f"  long greedy: {tok.decode(g)!r}, gaps {[round(x, 3) for x in gaps]}", flush=True)
    with torch.inference_mode():
        glob = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="eager",
                                                    sliding_window=1 << 20).eval()
        global_top1 = torch.argmax(last_logits(glob, long_ids, keep=TAIL).float(), dim=-1)
    differ = int((global_top1 != two.indices[:, 0]).sum())
    print(f"  with the window opened, {differ} of the last {TAIL} top-1 ids differ", flush=True)
    np.savez_compressed(GOLDEN_DIR / "gemma3-270m-long.npz", prompt_ids=np.asarray(long_ids, np.int64),
                        tail_top1_ids=two.indices[:, 0].numpy().astype(np.int64),
                        tail_top2_gap=(two.values[:, 0] - two.values[:, 1]).numpy().astype(np.float32),
                        tail_top1_ids_global=global_top1.numpy().astype(np.int64),
                        greedy_ids=np.asarray(g, np.int64), greedy_top2_ids=np.asarray(runner_up, np.int64),
                        greedy_top2_gap=np.asarray(gaps, np.float32))

    info = {
        "script": "scripts/make_gemma3_goldens.py",
        "oracle": "transformers on CPU, float32, attn_implementation=eager, full forward per step (no KV cache)",
        "transformers": transformers.__version__, "torch": torch.__version__, "gguf_file": path.name,
        "gguf_sha256": digest, "short": info_short,
        "long": {"prompt_tokens": len(long_ids), "greedy_text": tok.decode(g), "min_tail_top2_gap":
                 float((two.values[:, 0] - two.values[:, 1]).min()), "tail_top1_differing_without_window": differ},
    }
    (GOLDEN_DIR / "gemma3-270m_goldens.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
