"""Write a small random LoRA adapter in the PEFT format for a model (numpy and safetensors only).

    python scripts/make_lora.py OUT_DIR [--model DIR_OR_GGUF] [--rank 8] [--alpha 16] [--rslora]
                                        [--targets q_proj,v_proj] [--seed 0] [--std 0.05] [--zero-b]

--model: a Hugging Face model directory (its config.json is read) or a GGUF file; default: the embedded
SmolLM2 (its config read from the GGUF header). The adapter's B is random too (PEFT initialises it to zero,
which would change nothing): --zero-b writes PEFT's initial state instead (the adapter then gives the base
model's tokens). Used by the tests and the README's two-command example.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pagedserve.models.config import ModelConfig
from pagedserve.models.loading.peft import ATTENTION_MODULES, TARGET_MODULES, module_shape


def model_config(model: str | None) -> ModelConfig:
    from pagedserve.models.config import load_hf_config

    if model is not None and Path(model).is_dir():
        return load_hf_config(model)
    from pagedserve.models.loading.gguf_loader import gguf_config, open_gguf
    from pagedserve.models.loading.loader import default_model_path

    path = Path(model) if model is not None else default_model_path()
    return gguf_config(open_gguf(path), path)


def make_lora(out_dir: str | Path, config: ModelConfig, rank: int = 8, alpha: float = 16.0, rslora: bool = False,
              targets: tuple[str, ...] = TARGET_MODULES, seed: int = 0, std: float = 0.05,
              zero_b: bool = False) -> Path:
    """The adapter directory, written: A and B ~ N(0, std) (B = 0 with zero_b) on every layer's `targets`."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for n in range(config.num_hidden_layers):
        for m in targets:
            block = "self_attn" if m in ATTENTION_MODULES else "mlp"
            o, i = module_shape(config, m)
            key = f"base_model.model.model.layers.{n}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, i)) * std).astype(np.float32)
            b = np.zeros((o, rank)) if zero_b else rng.standard_normal((o, rank)) * std
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "modules_to_save": None,
           "use_dora": False, "fan_in_fan_out": False, "base_model_name_or_path": config.name or None}
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--targets", default=",".join(TARGET_MODULES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.05)
    p.add_argument("--zero-b", action="store_true")
    a = p.parse_args()
    path = make_lora(a.out_dir, model_config(a.model), a.rank, a.alpha, a.rslora, tuple(a.targets.split(",")),
                     a.seed, a.std, a.zero_b)
    print(path)


if __name__ == "__main__":
    main()
