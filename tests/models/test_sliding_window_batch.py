"""A step's batch with KV cache groups (models/batch.py, models/device_batch.py): each group's block tables and
slot mapping, a layer's pair by its group, and the one-step upload carrying them (stand-in device module)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from pagedserve.cupy_kernels.backend import Backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.device_batch import to_device

BS = 4


class FakeDeviceArray(np.ndarray):
    """Looks like a CuPy array to cuda_ops.is_cupy_array (its type's module starts with 'cupy')."""

    __module__ = "cupy_stand_in"


def fake_gpu_backend(uploads: list) -> Backend:
    def asarray(a, dtype=None):
        uploads.append(np.asarray(a).copy())
        return np.array(a, dtype=dtype).view(FakeDeviceArray)

    return Backend("cupy", types.SimpleNamespace(asarray=asarray), np.dtype(np.float16))


def _chunks():
    # a: 10 computed + 2 new (global table [0, 1, 2, 3]; sliding [N=9, 5, 6, 7]); b: a 3-token prompt
    return [SeqChunk([1, 2], 10, [0, 1, 2, 3], group_block_tables=[[9, 5, 6, 7]]),
            SeqChunk([3, 4, 5], 0, [4], group_block_tables=[[8]])]


def test_each_group_has_its_tables_and_slots_and_a_layer_reads_its_own():
    batch = build_forward_batch(_chunks(), BS, layer_group=(1, 1, 0))
    np.testing.assert_array_equal(batch.slot_mapping, [2 * BS + 2, 2 * BS + 3, 4 * BS, 4 * BS + 1, 4 * BS + 2])
    np.testing.assert_array_equal(batch.group_slot_mappings[0], [6 * BS + 2, 6 * BS + 3, 8 * BS, 8 * BS + 1,
                                                                 8 * BS + 2])
    np.testing.assert_array_equal(batch.group_block_tables[0], [[9, 5, 6, 7], [8, 0, 0, 0]])
    tables, slots = batch.kv_tables(0)
    assert tables is batch.group_block_tables[0] and slots is batch.group_slot_mappings[0]
    assert batch.kv_tables(2) == (batch.block_tables, batch.slot_mapping)
    view = batch.for_layer(1)
    assert view.block_tables is batch.group_block_tables[0] and view.slot_mapping is batch.group_slot_mappings[0]
    assert view.seq_lens is batch.seq_lens and batch.for_layer(2) is batch and batch.group_of(1) == 1


def test_without_groups_every_layer_reads_the_one_table():
    batch = build_forward_batch([SeqChunk([1], 3, [2])], BS)
    assert batch.group_block_tables == () and batch.kv_tables(5) == (batch.block_tables, batch.slot_mapping)


@pytest.mark.parametrize("layer_group", [(), (0, 2), (-1,)])
def test_a_layer_group_that_does_not_fit_the_tables_is_refused(layer_group):
    with pytest.raises(ValueError, match="layer_group"):
        build_forward_batch(_chunks(), BS, layer_group=layer_group)


def test_sequences_must_carry_the_same_groups():
    chunks = [SeqChunk([1], 3, [2], group_block_tables=[[3]]), SeqChunk([1], 3, [4])]
    with pytest.raises(ValueError, match="same KV cache groups"):
        build_forward_batch(chunks, BS, layer_group=(0, 1))


def test_the_groups_go_up_with_the_step_checked_and_trimmed():
    uploads: list = []
    batch = build_forward_batch(_chunks(), BS, layer_group=(1, 0))
    dev = to_device(batch, fake_gpu_backend(uploads), BS, 10)
    assert len(uploads) == 4  # the two packed buffers, the groups' slots, the groups' tables
    np.testing.assert_array_equal(dev.group_block_tables[0], batch.group_block_tables[0][:, :3])  # 12 tokens: 3
    np.testing.assert_array_equal(dev.group_slot_mappings[0], batch.group_slot_mappings[0])
    assert dev.layer_group == (1, 0)
    bad = build_forward_batch(_chunks(), BS, layer_group=(1, 0))
    bad.group_block_tables[0][0, 2] = 99  # a block id outside the pool of 10
    with pytest.raises(IndexError):
        to_device(bad, fake_gpu_backend([]), BS, 10)
