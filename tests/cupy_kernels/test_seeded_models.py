"""Seeded random-weight models of real shapes: CPU reference files, and the GPU against them."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import compare_logits

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REFERENCE_ENV = "PAGEDSERVE_GPU_REFERENCE"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


S = _load("pagedserve_seeded_models", "seeded_models.py")

# sha256 of tiny-seeded's weights. PCG64's raw stream and SeedSequence are fixed algorithms, so this
# holds on every numpy; if it ever changes, the two machines of the GPU check could disagree.
TINY_SEEDED_SHA256 = "04501192f84716fc777e9cd3e9fe3709c65ca657d74d566f7adc2f55a82ce837"


def test_generated_weights_are_the_same_bytes_every_time():
    spec = S.SPECS["tiny-seeded"]
    a, b = S.generate_weights(spec), S.generate_weights(spec)
    assert S.weights_digest(a) == S.weights_digest(b)
    if TINY_SEEDED_SHA256 is not None:
        assert S.weights_digest(a) == TINY_SEEDED_SHA256
    for name, w in a.items():
        assert w.dtype == np.float32 and np.isfinite(w).all(), name
        if name.endswith("proj.weight"):  # variance 1 / fan_in
            assert abs(float(w.var()) * w.shape[1] - 1) < 0.2, name
    other = S.SeededSpec("x", spec.config, spec.seed + 1, spec.prompt_lens)
    assert S.weights_digest(S.generate_weights(other)) != S.weights_digest(a)


def test_gpu_specs_have_the_real_layer_shapes():
    llama = S.SPECS["llama31-8b-shape-2l"].config
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.rope_scaling["rope_type"]) == (4096, 14336, 32, 8, 128, "llama3")
    qwen = S.SPECS["qwen25-7b-shape-1l"].config
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.attention_bias) == (3584, 18944, 28, 4, True)


def test_reference_round_trip_and_check(tmp_path):
    assert S.main(["--write", str(tmp_path), "--check", str(tmp_path), "--specs", "tiny-seeded"]) == 0
    logits, digest = S.read_reference(tmp_path, "tiny-seeded")
    spec = S.SPECS["tiny-seeded"]
    assert logits.shape == (2 * len(spec.prompt_lens), spec.config.vocab_size) and logits.dtype == np.float32
    assert digest == S.weights_digest(S.generate_weights(spec))
    np.savez_compressed(S.reference_path(tmp_path, "tiny-seeded"), logits=logits + 1.0,
                        weights_sha256=np.array(digest), format=np.array(S.REFERENCE_FORMAT))
    assert S.main(["--check", str(tmp_path), "--specs", "tiny-seeded"]) == 1


def reference_dir() -> Path:
    return Path(os.environ.get(REFERENCE_ENV) or ROOT / ".gpu_check" / "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("name", S.GPU_SPECS)
def test_seeded_model_on_gpu_matches_the_cpu_reference(name):
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.llama import LlamaForCausalLM

    path = S.reference_path(reference_dir(), name)
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/gpu_check.sh --prepare on the CPU machine and carry "
                    ".gpu_check/reference along")
    ref, digest = S.read_reference(reference_dir(), name)
    spec = S.SPECS[name]
    weights = S.generate_weights(spec)
    assert S.weights_digest(weights) == digest, "the weights generated here differ from the CPU machine's"
    got = S.run_model(spec, LlamaForCausalLM(spec.config, weights, get_backend("cuda")))
    del weights
    compare_logits(got, ref, f"seeded/{name}")
