"""The op table: chosen once per backend, complete, and the CUDA one refuses host arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from code_paths import run_as

from pagedserve.cupy_kernels import kernel_set
from pagedserve.cupy_kernels.backend import get_backend, to_host
from pagedserve.runtime.config import EngineConfig


def test_every_set_has_every_op():
    """The fields: the set's name, every op in forward order, then the settings that are not ops."""
    for ks in (kernel_set.numpy_kernels(), kernel_set.cuda_kernels()):
        names = [f.name for f in dataclasses.fields(ks)]
        ops = len(kernel_set.OP_NAMES)
        assert names[0] == "name" and names[1:1 + ops] == list(kernel_set.OP_NAMES)
        assert names[1 + ops:] == ["attention_cost", "argmax_rows", "linear_add", "linear_rotary_cache", "lora_shrink",
                                   "lora_expand", "kv_cache_dtypes"]
        assert all(callable(getattr(ks, op)) for op in kernel_set.OP_NAMES)
        assert ks.argmax_rows is None  # the sampler's array module's argmax
        assert ks.linear_add is None  # the model adds in add_rms_norm
        assert ks.linear_rotary_cache is None  # the model calls linear, then rotary_and_cache


def test_the_numba_set_adds_in_its_gemm():
    """linear_add: residual += x @ W in place (the reference's bits up to the order of the matmul's sums)."""
    from pagedserve.cupy_kernels.reference import ops

    ks = kernel_set.numba_kernels()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16), dtype=np.float32)
    x, residual = rng.standard_normal((5, 16), dtype=np.float32), rng.standard_normal((5, 64), dtype=np.float32)
    expected = ops.linear_add(x, w.T, residual.copy())
    got = residual.copy()
    assert ks.linear_add(x, ks.pack_weight(w), got) is got
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_numba_set_has_its_own_argmax_rows():
    logits = np.array([[0.0, 2.0, 2.0, -1.0], [np.nan, 1.0, np.nan, 0.0]], np.float32)
    np.testing.assert_array_equal(kernel_set.numba_kernels().argmax_rows(logits), [1, 0])


def test_pack_weight_takes_a_host_weight_at_load_in_every_set():
    """pack_weight runs on the checkpoint's host array before anything is uploaded, so even the CUDA set
    takes it (and keeps [in, out] arrays: None); the numba set packs float32 panels."""
    w = np.ones((40, 8), np.float32)
    assert kernel_set.cuda_kernels().pack_weight(w) is None
    assert kernel_set.numpy_kernels().pack_weight(w) is None
    assert kernel_set.numba_kernels().pack_weight(w).shape == (8, 40)


def test_pack_weight_takes_row_parts():
    """A fused weight's parts (qkv, gate_up): the numba set packs their rows in turn; the others keep arrays."""
    from pagedserve.cupy_kernels.numba_cpu.gemm import PANEL  # 32 columns on AVX-512 code, 16 on AVX2 and baseline

    parts = [np.full((PANEL, 8), 1, np.float32), np.full((8, 8), 2, np.float32)]
    assert kernel_set.cuda_kernels().pack_weight(parts) is None
    assert kernel_set.numpy_kernels().pack_weight(parts) is None
    packed = kernel_set.numba_kernels().pack_weight(parts)
    assert packed.shape == (8, PANEL + 8)
    assert packed.panels[0, 0].tolist() == [1.0] * PANEL  # the first part fills the first panel
    assert packed.panels[1, 0].tolist() == [2.0] * 8 + [0.0] * (PANEL - 8)  # the second starts the next one


def test_a_backend_whose_warm_up_is_finished_later_is_the_same_set():
    """The worker asks for the numba set before its attention kernels are ready (finish_warm_up=False) and
    finishes the warm-up after loading the model: the same table, and finishing again does nothing."""
    from pagedserve.cupy_kernels.backend import finish_warm_up

    early = get_backend("cpu", "numba", finish_warm_up=False)
    assert early.ops is kernel_set.numba_kernels()
    finish_warm_up(early)
    finish_warm_up(get_backend("cpu", "numpy"))  # nothing to finish
    assert kernel_set._finished.is_set() and not kernel_set._compile_child


def test_start_warm_up_begins_the_cpu_sets_compiles_and_leaves_gpus_alone(monkeypatch):
    """What `pagedserve serve` calls first: the numba set's compiles start (get_backend's first half), for
    device cpu, or auto without a GPU; nothing for cuda, for auto with a GPU, or for an unknown device."""
    from pagedserve.cupy_kernels import backend

    calls = []
    monkeypatch.setattr(backend, "cpu_kernels", lambda choice, finish: calls.append((choice, finish)))
    monkeypatch.setattr(backend, "cuda_available", lambda: False)
    backend.start_warm_up("cpu", "numba")
    backend.start_warm_up("auto", "auto")
    backend.start_warm_up("cuda", "numba")
    backend.start_warm_up("tpu", "numba")
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    backend.start_warm_up("auto", "numba")
    assert calls == [("numba", False), ("auto", False)]


def test_cpu_choice():
    assert get_backend("cpu", "numpy").ops is kernel_set.numpy_kernels()
    # "auto": numba, installed with the package, but for baseline x86-64 code (see the refusal test below)
    auto = kernel_set.numpy_kernels() if kernel_set.numba_code_path() == "baseline" else kernel_set.numba_kernels()
    assert get_backend("cpu").ops is auto
    assert get_backend("cpu", "numba").ops is kernel_set.numba_kernels()
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        get_backend("cpu", "fast")
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(cpu_kernels="fast")


@pytest.mark.parametrize("op,args", [
    ("linear", (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))),
    ("silu_and_mul", (np.ones((2, 4), np.float32),)),
    ("rope_cos_sin", (np.ones(4), np.arange(3))),
    ("paged_attention", (np.ones((1, 2, 64), np.float32),) + (None,) * 6),
    ("copy_blocks", ([(np.zeros((2, 16, 1, 64)), np.zeros((2, 16, 1, 64)))], [(0, 1)])),
])
def test_cuda_table_refuses_host_arrays(op, args):
    with pytest.raises(TypeError, match=f"{op}: the CUDA backend got a host array"):
        getattr(kernel_set.cuda_kernels(), op)(*args)


def test_to_host():
    a = np.arange(3)
    assert to_host(a) is a

    class Device:
        def get(self):
            return np.array([7])

    assert to_host(Device()).tolist() == [7]


def test_auto_without_numba_is_the_reference(monkeypatch):
    monkeypatch.setattr(kernel_set.importlib.util, "find_spec", lambda name: None)
    assert kernel_set.cpu_kernels("auto") is kernel_set.numpy_kernels()
    with pytest.raises(ValueError, match="numba is not installed"):
        kernel_set.cpu_kernels("numba")


@pytest.mark.parametrize("path", ["avx512", "avx2", "baseline"])
def test_the_code_path_is_read_back_from_what_numba_emits(path, tmp_path):
    """numba_setup.CODE_PATH is what LLVM emits for numba's target (compiling needs no CPU that runs the code,
    so every path is checked on any x86-64 host), and the kernels' variants follow it."""
    proc = run_as(path, "from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup, gemm as numba_gemm, "
                        "attention_ir as numba_attention_ir\n"
                        "print(numba_setup.CODE_PATH, numba_gemm.PANEL, numba_attention_ir.LANES)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    wide = path == "avx512"
    assert proc.stdout.split()[-3:] == [path, "32" if wide else "16", "16" if wide else "8"]


REFUSAL_CHECK = """
from pagedserve.cupy_kernels import kernel_set
print("auto:", kernel_set.cpu_kernels("auto", finish_warm_up=False).name)
print("numba:", kernel_set.cpu_kernels("numba", finish_warm_up=False).name)
"""


@pytest.mark.parametrize("path", ["avx2", "baseline"])
def test_auto_refuses_numba_on_baseline_code_with_the_reason(path, tmp_path):
    """Baseline x86-64 code (no AVX2/FMA) runs the numba kernels right but slowly (an FMA is a libm call):
    "auto" takes the numpy set there and logs why; asked for by name, the numba set is still given."""
    proc = run_as(path, REFUSAL_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr
    refused = path == "baseline"
    assert ("auto: numpy" if refused else "auto: numba") in proc.stdout and "numba: numba" in proc.stdout
    assert ("kernel_set.numba_refused" in proc.stdout) == refused
    if refused:
        assert "baseline x86-64" in proc.stdout and "AVX2" in proc.stdout
