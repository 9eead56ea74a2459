"""The op table: chosen once per backend, complete, and the CUDA one refuses host arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedserve.cupy_kernels import kernel_set
from pagedserve.cupy_kernels.backend import get_backend, to_host
from pagedserve.runtime.config import EngineConfig


def test_every_set_has_every_op():
    for ks in (kernel_set.numpy_kernels(), kernel_set.cuda_kernels()):
        assert [f.name for f in dataclasses.fields(ks)][1:] == list(kernel_set.OP_NAMES)
        assert all(callable(getattr(ks, op)) for op in kernel_set.OP_NAMES)


def test_pack_weight_takes_a_host_weight_at_load_in_every_set():
    """pack_weight runs on the checkpoint's host array before anything is uploaded, so even the CUDA set
    takes it (and keeps [in, out] arrays: None); the numba set packs float32 panels."""
    w = np.ones((40, 8), np.float32)
    assert kernel_set.cuda_kernels().pack_weight(w) is None
    assert kernel_set.numpy_kernels().pack_weight(w) is None
    assert kernel_set.numba_kernels().pack_weight(w).shape == (8, 40)


def test_pack_weight_takes_row_parts():
    """A fused weight's parts (qkv, gate_up): the numba set packs their rows in turn; the others keep arrays."""
    parts = [np.full((32, 8), 1, np.float32), np.full((8, 8), 2, np.float32)]
    assert kernel_set.cuda_kernels().pack_weight(parts) is None
    assert kernel_set.numpy_kernels().pack_weight(parts) is None
    packed = kernel_set.numba_kernels().pack_weight(parts)
    assert packed.shape == (8, 40) and packed.panels[1, 0, :8].tolist() == [2.0] * 8


def test_a_backend_whose_warm_up_is_finished_later_is_the_same_set():
    """The worker asks for the numba set before its attention kernels are ready (finish_warm_up=False) and
    finishes the warm-up after loading the model: the same table, and finishing again does nothing."""
    from pagedserve.cupy_kernels.backend import finish_warm_up

    early = get_backend("cpu", "numba", finish_warm_up=False)
    assert early.ops is kernel_set.numba_kernels()
    finish_warm_up(early)
    finish_warm_up(get_backend("cpu", "numpy"))  # nothing to finish
    assert kernel_set._finished.is_set() and not kernel_set._compile_child


def test_cpu_choice():
    assert get_backend("cpu", "numpy").ops is kernel_set.numpy_kernels()
    assert get_backend("cpu").ops is kernel_set.numba_kernels()  # "auto": numba, installed with the package
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
