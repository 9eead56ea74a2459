"""models/device_batch.py on the CPU: packing, trimming, host checks, and the one-upload-per-step path
(with a stand-in device array module that counts uploads)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cupy_kernels.backend import Backend, get_backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.device_batch import blocks_needed, check_batch, is_on_device, pack_batch, to_device, unpack_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM

from model_factory import random_model

BS = 16


class FakeDeviceArray(np.ndarray):
    """Looks like a CuPy array to cuda_ops.is_cupy_array (its type's module starts with 'cupy')."""

    __module__ = "cupy_stand_in"


def fake_gpu_backend(uploads: list) -> Backend:
    def asarray(a, dtype=None):
        uploads.append(np.asarray(a).copy())
        return np.array(a, dtype=dtype).view(FakeDeviceArray)

    return Backend("cupy", types.SimpleNamespace(asarray=asarray), np.dtype(np.float16))


def _batch(specs, wide=0):
    """specs: (num_computed, num_new) per sequence; fresh blocks, `wide` extra table entries each."""
    chunks, at = [], 0
    for i, (computed, new) in enumerate(specs):
        nb = -(-(computed + new) // BS) + wide
        chunks.append(SeqChunk(list(range(3 + i, 3 + i + new)), computed, list(range(at, at + nb)),
                               num_logits=int(i % 2 == 0)))
        at += nb
    return build_forward_batch(chunks, BS), at


def _assert_same(a, b):
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "logits_indices"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)


specs_st = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 20)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(specs_st, st.integers(0, 3))
def test_pack_unpack_round_trip_and_trim(specs, wide):
    batch, _ = _batch(specs, wide)
    need = blocks_needed(batch.seq_lens, BS)
    assert need == max(-(-(c + n) // BS) for c, n in specs)
    i64, i32, layout = pack_batch(batch, need)
    assert i64.dtype == np.int64 and i32.dtype == np.int32
    assert (i64.size, i32.size) == (layout.i64_size, layout.i32_size)
    got = unpack_batch(i64, i32, layout)
    assert got.block_tables.shape == (batch.num_seqs, need)
    np.testing.assert_array_equal(got.block_tables, batch.block_tables[:, :need])
    got.block_tables = batch.block_tables
    _assert_same(got, batch)
    # a layout wider than the tables zero-pads them (block 0 is a valid id the kernels never read)
    width = batch.block_tables.shape[1]
    wide_tables = unpack_batch(*pack_batch(batch, width + 2)).block_tables
    np.testing.assert_array_equal(wide_tables[:, :width], batch.block_tables)
    assert (wide_tables[:, width:] == 0).all()


def test_numpy_backend_and_device_batches_pass_through():
    batch, _ = _batch([(0, 5), (9, 1)])
    assert to_device(batch, get_backend("cpu"), BS, 100) is batch
    uploads = []
    dev = to_device(batch, fake_gpu_backend(uploads), BS, 100)
    assert is_on_device(dev) and len(uploads) == 2
    assert to_device(dev, fake_gpu_backend(uploads), BS, 100) is dev and len(uploads) == 2


def test_two_uploads_per_step_with_trimmed_tables():
    batch, num_blocks = _batch([(40, 1), (0, 7), (100, 1)], wide=5)
    uploads = []
    dev = to_device(batch, fake_gpu_backend(uploads), BS, num_blocks, vocab_size=50)
    assert [u.dtype for u in uploads] == [np.int64, np.int32]
    assert dev.block_tables.shape == (3, -(-101 // BS))  # the longest sequence's blocks, not the table's width
    assert all(isinstance(getattr(dev, f), FakeDeviceArray)
               for f in ("input_ids", "seq_lens", "block_tables", "logits_indices"))
    dev.block_tables = batch.block_tables
    _assert_same(dev, batch)


@pytest.mark.parametrize("mutate,error,match", [
    (lambda b: b.block_tables.__setitem__((1, 0), 99), IndexError, r"block id outside \[0, 99\)"),
    (lambda b: b.block_tables.__setitem__((0, 0), -2), IndexError, "block id"),
    (lambda b: b.slot_mapping.__setitem__(0, 99 * BS), IndexError, "slot outside"),
    (lambda b: b.slot_mapping.__setitem__(0, -3), IndexError, "slot outside"),
    (lambda b: b.input_ids.__setitem__(2, 1000), IndexError, r"token id outside \[0, 50\)"),
    (lambda b: b.logits_indices.__setitem__(0, 99), IndexError, "logits_indices"),
    (lambda b: b.seq_lens.__setitem__(1, 200), ValueError, "needs 13 blocks"),
    (lambda b: b.seq_lens.__setitem__(0, 1), ValueError, "more query tokens than its seq_len"),
    (lambda b: b.query_start_loc.__setitem__(2, 1), ValueError, "query_start_loc must be"),
])
def test_check_batch_names_the_problem(mutate, error, match):
    batch, _ = _batch([(3, 4), (20, 1)], wide=1)
    check_batch(batch, BS, 99, 50)
    mutate(batch)
    with pytest.raises(error, match=match):
        check_batch(batch, BS, 99, 50)
    with pytest.raises(error, match=match):
        to_device(batch, fake_gpu_backend([]), BS, 99, 50)


def test_forward_on_packed_trimmed_metadata_is_identical():
    """The model fed the unpacked views of trimmed, packed metadata (what the GPU sees) computes the
    very same logits and KV as with the host batch."""
    cfg, weights = random_model(layers=2)
    model = LlamaForCausalLM(cfg, weights)
    prompt, _ = _batch([(0, 20), (0, 3), (0, 33)], wide=3)
    kv_a = allocate_kv_caches(cfg, 64, BS, model.backend)
    kv_b = allocate_kv_caches(cfg, 64, BS, model.backend)
    ref = model.forward(prompt, kv_a)
    i64, i32, layout = pack_batch(prompt, blocks_needed(prompt.seq_lens, BS))
    got = model.forward(unpack_batch(i64, i32, layout), kv_b)
    np.testing.assert_array_equal(got, ref)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)


class _FakeEvent:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("wait")


class _FakeDeviceBuffer:
    def __init__(self, shape, dtype, log, pinned):
        self.host = np.zeros(shape, dtype)
        self.log = log
        self.pinned = pinned

    def set(self, arr, stream=None):
        assert stream is not None, "an async copy names its stream"
        # an async copy must come from pinned memory: the source is a view of a buffer the fake pinned
        assert any(np.shares_memory(arr, np.frombuffer(p, np.uint8)) for p in self.pinned), \
            "copied from pageable memory, not the pinned staging buffer"
        self.host[...] = arr
        self.log.append(("copy", arr.nbytes))


def _fake_cupy_with_pinned_memory(log):
    stream = types.SimpleNamespace(record=lambda: _FakeEvent(log))

    pinned = []

    def alloc_pinned_memory(n):
        log.append(("pin", n))
        pinned.append(bytearray(n))
        return pinned[-1]

    cuda = types.SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory, get_current_stream=lambda: stream,
                                 runtime=types.SimpleNamespace(getDevice=lambda: 0))
    return types.SimpleNamespace(cuda=cuda, empty=lambda shape, dtype: _FakeDeviceBuffer(shape, dtype, log, pinned))


def test_pinned_staging_copies_asynchronously_and_reuses_its_buffer_after_the_last_copy():
    from pagedserve.models.device_batch import PinnedStaging

    log = []
    staging = PinnedStaging(_fake_cupy_with_pinned_memory(log))
    a, b = np.arange(10, dtype=np.int64), np.arange(7, dtype=np.int32)
    dev_a, dev_b = staging.upload([(None, a), (None, b)])
    np.testing.assert_array_equal(dev_a.host, a)
    np.testing.assert_array_equal(dev_b.host, b)
    assert log == [("pin", 512), ("copy", 80), ("copy", 28)]
    log.clear()
    c = np.arange(3, dtype=np.int64)
    staging.upload([(dev_a, np.zeros(10, np.int64)), (None, c)])
    # waits for the previous copies before rewriting the pinned bytes; no new pinned allocation
    assert log[0] == "wait" and not any(isinstance(e, tuple) and e[0] == "pin" for e in log)
    assert not dev_a.host.any()
    staging.upload([(None, np.zeros(1000, np.int64))])  # larger than the buffer: a new one
    assert ("pin", 8192) in log
