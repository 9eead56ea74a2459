"""Greedy tokens with adapters equal transformers + peft's (goldens by scripts/make_lora_goldens.py): ranks 8 and
16, rsLoRA on and off, all seven projections and q/v only, on the tiny Llama, Qwen3 and Gemma 3; every adapter and
the base mixed in one batch."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import drain, make_engine, tiny_loaded
from lora_helpers import DATA
from pagedserve.runtime.lora import LoRARequest
from pagedserve.runtime.sampling_params import SamplingParams

SPECS = ("r8", "r16-rslora", "r8-qv-rslora", "r16-qv")


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_greedy_tokens_equal_peft(model, kernels):
    golden = np.load(DATA / "goldens" / f"lora_{model}.npz")
    num_tokens = len(golden["base_greedy_0"])
    engine = make_engine(tiny_loaded(model), enable_lora=True, max_loras=4, max_lora_rank=16, cpu_kernels=kernels)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    want = {}
    for k, spec in enumerate(SPECS):
        lora = LoRARequest(spec, k + 1, str(DATA / "loras" / f"{model}-{spec}"))
        engine.lora.register(lora)
        for i in range(2):
            engine.add_request(f"{spec}/{i}", golden[f"prompt_ids_{i}"].tolist(), params, lora_request=lora)
            want[f"{spec}/{i}"] = golden[f"{spec}_greedy_{i}"].tolist()
    for i in range(2):
        engine.add_request(f"base/{i}", golden[f"prompt_ids_{i}"].tolist(), params)
        want[f"base/{i}"] = golden[f"base_greedy_{i}"].tolist()
    out = drain(engine)
    assert {rid: o.outputs[0].token_ids for rid, o in out.items()} == want
