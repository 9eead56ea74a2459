"""launch.py: the words packed in compiled code (pack_into) are the ones launch.pack makes, run_parts runs every
item once, and the kernels a start compiles have no prange of their own besides the shared one."""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from pagedserve.cupy_kernels import numba_cpu  # noqa: E402
from pagedserve.cupy_kernels.numba_cpu import launch  # noqa: E402
from pagedserve.cupy_kernels.numba_cpu.setup import JIT_EXACT, apply_threads  # noqa: E402


@numba.njit(**JIT_EXACT)
def _packed(parts):
    words = np.empty(launch.words_for(parts), dtype=np.int64)
    launch.pack_into(words, parts)
    return words


def test_pack_into_writes_the_words_pack_makes():
    rng = np.random.default_rng(0)
    weight = rng.integers(-5, 5, (7, 3), dtype=np.int8)
    weight.flags.writeable = False  # a model's weights are read-only
    parts = (rng.standard_normal((4, 5)).astype(np.float32), weight, np.zeros((2, 3, 4), np.float32), 1e-6,
             np.float32(0.25), 17, -3, True, False)
    np.testing.assert_array_equal(_packed(parts), launch.pack(*parts))


def test_pack_into_refuses_an_array_that_is_not_c_contiguous():
    with pytest.raises(numba.core.errors.TypingError):
        _packed((np.zeros((4, 6), np.float32)[:, ::2],))


def _fill(item, words):
    out, scale = launch.array1(words, 0, np.float64), launch.float_at(words, 2)
    src = launch.array2(words, 3, np.int64)
    out[item] += scale * item + src[item % src.shape[0], words[6]]


_FILL = numba.njit(**JIT_EXACT)(_fill)


@pytest.mark.parametrize("parallel,serial", [(False, False), (True, False), (True, True)])
def test_run_parts_runs_each_item_once(parallel, serial):
    out, src = np.zeros(37), np.arange(12, dtype=np.int64).reshape(4, 3)
    apply_threads(parallel=parallel)
    launch.run_parts(launch.item_address(_FILL), 37, (out, 0.5, src, 2), serial=serial)
    items = np.arange(37)
    np.testing.assert_array_equal(out, 0.5 * items + src[items % 4, 2])


def test_the_kernels_have_no_prange_of_their_own():
    """Each prange compiles as a parallel function of its own (0.2-1 s of a first start); the kernels a start
    compiles run as launch.py's items instead. The two left are compiled only when used: apply_rotary (the model
    calls rotary_and_cache) and the opt-in int8 activations' kernel (PAGEDSERVE_CPU_ACT_QUANT=q8)."""
    parallel = set()
    for info in pkgutil.iter_modules(numba_cpu.__path__):
        module = importlib.import_module(f"{numba_cpu.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher) and value.targetoptions.get("parallel"):
                parallel.add(f"{info.name}.{name}")
    assert parallel == {"launch._LAUNCH", "ops._ROTARY", "quant_int8._matmul"}


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba runs one thread here")
def test_a_few_rows_run_serially_and_leave_numbas_thread_count_alone(monkeypatch):
    """A one-request decode step alternates the GGUF matmuls (all threads) with one-row norms, SiLU, rotary and
    attention: each change of numba's thread count costs ~1.4 us, eight a layer. The small kernels run on the
    calling thread without setting it, and a row's bits are the ones it gets among enough rows to share."""
    from pagedserve.cupy_kernels.numba_cpu import ops as numba_ops
    from pagedserve.cupy_kernels.reference import ops as reference_ops

    rng = np.random.default_rng(1)
    x, residual = (rng.standard_normal((1, 64)).astype(np.float32) for _ in range(2))
    weight, gate_up = rng.standard_normal(64).astype(np.float32), rng.standard_normal((1, 128)).astype(np.float32)
    heads, kv_heads, head_dim = 3, 1, 8
    qkv = rng.standard_normal((1, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    cos, sin = (rng.standard_normal((1, head_dim // 2)).astype(np.float32) for _ in range(2))
    caches = [np.zeros((4, 16, kv_heads, head_dim), np.float32) for _ in range(2)]
    from pagedserve.cupy_kernels.host import blas_threads

    monkeypatch.setattr(blas_threads, "_cpu_threads", None)  # numba's whole pool, whatever a test before set
    apply_threads(parallel=True)
    threads = numba.get_num_threads()
    assert threads >= 2
    normed = numba_ops.rms_norm(x, weight, 1e-6)
    added, _ = numba_ops.add_rms_norm(x, residual.copy(), weight, 1e-6)
    silu = numba_ops.silu_and_mul(gate_up)
    q = numba_ops.rotary_and_cache(qkv, heads, kv_heads, cos, sin, *caches, np.array([5]))
    from pagedserve.cupy_kernels.numba_cpu import attention as numba_attention

    metadata = (np.array([0, 1]), np.array([6]), np.zeros((1, 1), np.int32))  # one decode: 6 keys in block 0
    plan = numba_attention.plan_attention(q.shape, caches[0].shape, *metadata)
    attended = numba_attention.paged_attention(q, *caches, *metadata, 0.5, plan=plan)
    assert numba.get_num_threads() == threads
    np.testing.assert_array_equal(numba_attention.paged_attention(q, *caches, *metadata, 0.5), attended)
    many = np.repeat(x, numba_ops.NORM_PARALLEL_MIN_ROWS, axis=0)  # enough rows for the threads
    np.testing.assert_array_equal(numba_ops.rms_norm(many, weight, 1e-6)[:1], normed)
    gates = np.repeat(gate_up, numba_ops.SILU_PARALLEL_MIN_ROWS, axis=0)
    np.testing.assert_array_equal(numba_ops.silu_and_mul(gates)[:1], silu)
    np.testing.assert_allclose(normed, reference_ops.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(added, reference_ops.rms_norm(x + residual, weight, 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(silu, reference_ops.silu_and_mul(gate_up), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(caches[1][0, 5, 0], qkv[0, (heads + kv_heads) * head_dim:])
    assert q.shape == (1, heads, head_dim)
