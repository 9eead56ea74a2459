"""The NCCL path of tensor parallelism (cupy_kernels/collectives.py, NcclCommunicator).

On a machine without a GPU only the import check runs; the `gpu` tests run under scripts/gpu_check.sh
(its tensor-parallel section), the two-rank one only where the device has at least 2 GPUs. They take
no fixtures, so the bare GPU machine's mini runner can run them too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pagedserve.cupy_kernels import collectives

TINY = str(Path(__file__).resolve().parents[1] / "data" / "tiny-llama")


def test_the_nccl_path_imports_and_needs_cupy_only_when_used():
    assert {"all_reduce", "gather", "abort", "close"} <= set(dir(collectives.NcclCommunicator))
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(ImportError):
            collectives.NcclCommunicator(b"", 0, 1)
        with pytest.raises(ImportError):
            collectives.nccl_unique_id()


def _nccl_or_skip():
    import cupy

    try:
        from cupy.cuda import nccl
    except ImportError as e:
        pytest.skip(f"this CuPy has no NCCL ({e})")
    if not getattr(nccl, "available", True):
        pytest.skip("this CuPy was built without NCCL")
    return cupy


@pytest.mark.gpu
def test_nccl_single_rank_all_reduce_and_gather_are_the_identity():
    cp = _nccl_or_skip()
    comm = collectives.NcclCommunicator(collectives.nccl_unique_id(), 0, 1)
    try:
        for dtype in (cp.float16, cp.float32):
            x = cp.arange(24, dtype=dtype).reshape(4, 6) / 7
            np.testing.assert_array_equal(cp.asnumpy(comm.all_reduce(x)), cp.asnumpy(x))
            np.testing.assert_array_equal(cp.asnumpy(comm.gather(x, axis=-1)), cp.asnumpy(x))
    finally:
        comm.close()


@pytest.mark.gpu
def test_tp2_on_two_gpus_gives_the_tp1_greedy_tokens():
    cp = _nccl_or_skip()
    count = cp.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip(f"tensor parallelism on GPUs needs >= 2 devices; this machine has {count}")
    from pagedserve.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45, 90, 45]]
    with LLM(TINY, device="cuda", num_kv_blocks=64, seed=0) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(TINY, device="cuda", num_kv_blocks=64, seed=0, tensor_parallel_size=2) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    assert got == ref
