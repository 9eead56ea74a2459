"""Structured outputs on the GPU path (every test is marked `gpu`; they skip without a device): the CuPy
bitmask application against the numpy one, and guided generation end to end on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny-llama"


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [70, 49152])
def test_cupy_bitmask_equals_numpy(vocab):
    import cupy

    from pagedserve.runtime.sample.sampling_ops import apply_token_bitmask

    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    rows = np.array([5, 0, 3])
    bits = rng.integers(-(2**31), 2**31, size=(3, (vocab + 31) // 32)).astype(np.int32)
    want = apply_token_bitmask(logits, rows, bits)
    got = apply_token_bitmask(cupy.asarray(logits), rows, bits, xp=cupy)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.gpu
def test_guided_generation_on_the_gpu():
    from pagedserve.runtime import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(str(TINY), device="cuda", seed=0, enable_cuda_graphs=True)
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    outs = llm.generate([[5, 6, 7], [5, 9]], [
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=date)),  # noqa: E501
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),  # noqa: E501
    ], use_tqdm=False)
    assert all(re.fullmatch(date, c.text) and c.finish_reason == "stop" for c in outs[0].outputs)
    assert outs[1].outputs[0].text in ("yes", "no")
    assert llm.engine.kv_manager.usage().num_used_blocks == 0
