"""Tensor-core prefill attention and bfloat16 paged attention on a real GPU (marked `gpu`: skipped without one).

The same checks as the host emulation's (tests/prefill_checks.py): numpy reference with the bound of rounding P
and the output, decode rows untouched by the prefill kernel, the flag's two-launch path giving the decode rows
bit for bit and the prefill rows within the bound. On a device these also prove what the emulation cannot: the
real mma.sync / ldmatrix fragment layouts, cvt.rn.bf16.f32, and the kernels under the GPU's scheduling. They
gate turning PAGEDSERVE_TC_PREFILL on by default (issue #45).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import cuda, import_cupy, to_host
from pagedserve.cupy_kernels.cuda import attention as cuda_attention
from prefill_checks import PREFILL_SPECS, as_float32, check_prefill, prefill_case

pytestmark = pytest.mark.gpu


def _sm() -> int:
    return cuda_attention._compute_capability()


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("dim,block_size,group,window", [(64, 16, 2, None), (128, 32, 4, None), (256, 16, 2, None),
                                                          (128, 16, 4, 100)])
def test_prefill_attention_tensor_cores_gpu(kind, dim, block_size, group, window):
    if _sm() < 80:
        pytest.skip("mma.sync m16n8k16 with bf16 needs sm_80+")
    cp = import_cupy()
    rng = np.random.default_rng(dim + group)
    specs = PREFILL_SPECS + [(1100, 1100)]  # 18 tiles of 64 rows
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, specs, kind, 2, group, dim, block_size)
    out = cp.full(q.shape, 0xFFFF, dtype=cp.uint16).view(q.dtype)  # NaN / all-ones bits: unwritten rows stay so
    cuda_attention.prefill_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), qsl, lens, tables, dim ** -0.5,
                                     sliding_window=window, out=out)
    got = to_host(out)
    rows = check_prefill(as_float32(got, kind), floats, qsl, lens, tables, dim ** -0.5, kind, window, f"gpu/{kind}")
    untouched = np.setdiff1d(np.arange(len(q)), rows)
    assert np.all(got[untouched].view(np.uint16) == 0xFFFF)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("dim", [128, 256])
def test_paged_attention_with_tensor_core_prefill_gpu(kind, dim, monkeypatch):
    """The flag off: every row within the bound (bf16 through the paged kernel; at head dim 256 its chunks take
    dynamic shared memory past 48 KB); on: decode rows the same bits, prefill rows within the bound, device
    metadata the same bits."""
    cp = import_cupy()
    rng = np.random.default_rng(5)
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, PREFILL_SPECS, kind, 2, 4, dim, 16)
    args = (cp.asarray(q), cp.asarray(k), cp.asarray(v))
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "0")
    off = to_host(cuda.paged_attention(*args, qsl, lens, tables, 0.1, sliding_window=300))
    check_prefill(as_float32(off, kind), floats, qsl, lens, tables, 0.1, kind, 300, "gpu/off", every_row=True)
    if _sm() < 80:
        pytest.skip("tensor-core prefill needs sm_80+")
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "1")
    on = to_host(cuda.paged_attention(*args, qsl, lens, tables, 0.1, sliding_window=300))
    rows = check_prefill(as_float32(on, kind), floats, qsl, lens, tables, 0.1, kind, 300, "gpu/on")
    decodes = np.setdiff1d(np.arange(len(q)), rows)
    np.testing.assert_array_equal(on[decodes], off[decodes])
    device = to_host(cuda.paged_attention(*args, cp.asarray(qsl), cp.asarray(lens), cp.asarray(tables), 0.1,
                                          sliding_window=300))
    np.testing.assert_array_equal(device, on)
