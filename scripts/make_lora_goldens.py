"""Make the LoRA goldens: greedy tokens of transformers + peft (CPU, float32) for random adapters on the tiny
Llama, Qwen3 and Gemma 3 checkpoints in tests/data.

Writes, for each model M in (tiny-llama, tiny-qwen3, tiny-gemma3) and adapter spec S (rank 8 and 16, rsLoRA on
and off, all seven projections and q/v only):

  tests/data/loras/M-S/                 adapter_config.json + adapter_model.safetensors (float16 A and B, made by
                                        scripts/make_lora.py and rounded, so both sides read the same values)
  tests/data/goldens/lora_M.npz         prompt_ids_{i}   int64 [L]
                                        S_greedy_{i}     int64 [N]   greedy continuation with adapter S
                                        S_gap_{i}        float32 [N] top-1 minus top-2 logit at each step
                                        base_greedy_{i}  int64 [N]   the base model's (each adapter must differ)

A plain loop of full forwards + argmax (no KV cache), as scripts/make_goldens.py does. Needs the oracle extra
(torch, transformers, peft); rerun from the repository root:

    OMP_NUM_THREADS=1 ORACLE_PYTHON scripts/make_lora_goldens.py [MODEL ...]      (default: every model)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MODELS = ("tiny-llama", "tiny-qwen3", "tiny-gemma3")
SPECS = {  # name: make_lora arguments
    "r8": dict(rank=8, alpha=16.0, rslora=False, targets=None, seed=11),
    "r16-rslora": dict(rank=16, alpha=8.0, rslora=True, targets=None, seed=12),
    "r8-qv-rslora": dict(rank=8, alpha=16.0, rslora=True, targets=("q_proj", "v_proj"), seed=13),
    "r16-qv": dict(rank=16, alpha=32.0, rslora=False, targets=("q_proj", "v_proj"), seed=14),
}
STD = 0.15  # large enough that every adapter moves the greedy tokens of these random models
NUM_TOKENS = 12
PROMPTS = [[3, 17, 101, 45, 9, 250, 77, 31], [200, 5, 5, 64, 129, 11, 2, 90, 41, 7, 300, 12, 18]]


def _make_lora_module():
    spec = importlib.util.spec_from_file_location("make_lora_script", ROOT / "scripts" / "make_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_adapter(model: str, name: str) -> Path:
    from pagedserve.models.config import load_hf_config
    from pagedserve.models.loading.peft import TARGET_MODULES

    make_lora = _make_lora_module().make_lora
    s = dict(SPECS[name])
    targets = s.pop("targets") or TARGET_MODULES
    out = make_lora(DATA / "loras" / f"{model}-{name}", load_hf_config(DATA / model), targets=targets, std=STD, **s)
    file = out / "adapter_model.safetensors"
    save_file({k: v.astype(np.float16) for k, v in load_file(str(file)).items()}, str(file))
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = f"tests/data/{model}"
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


@torch.no_grad()
def greedy(model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    seq, ids, gaps = list(prompt), [], []
    for _ in range(NUM_TOKENS):
        logits = model(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        ids.append(int(torch.argmax(logits)))
        gaps.append(float(top2[0] - top2[1]))
        seq.append(ids[-1])
    return np.asarray(ids, dtype=np.int64), np.asarray(gaps, dtype=np.float32)


def main(models: list[str]) -> None:
    torch.manual_seed(0)
    for model_name in models:
        out: dict[str, np.ndarray] = {}
        base = AutoModelForCausalLM.from_pretrained(DATA / model_name, torch_dtype=torch.float32).eval()
        for i, p in enumerate(PROMPTS):
            out[f"prompt_ids_{i}"] = np.asarray(p, dtype=np.int64)
            out[f"base_greedy_{i}"] = greedy(base, p)[0]
        for name in SPECS:
            path = write_adapter(model_name, name)
            base = AutoModelForCausalLM.from_pretrained(DATA / model_name, torch_dtype=torch.float32).eval()
            model = PeftModel.from_pretrained(base, str(path)).eval()
            for i, p in enumerate(PROMPTS):
                ids, gaps = greedy(model, p)
                out[f"{name}_greedy_{i}"], out[f"{name}_gap_{i}"] = ids, gaps
                same = np.array_equal(ids, out[f"base_greedy_{i}"])
                print(f"{model_name} {name} prompt {i}: {ids.tolist()} min gap {gaps.min():.3f}"
                      + ("  (SAME AS BASE)" if same else ""))
        np.savez(DATA / "goldens" / f"lora_{model_name}.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
