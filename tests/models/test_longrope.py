"""LongRoPE's factor choice (models/rope.py): a token at position p of a sequence whose prompt has P tokens takes the
long factors iff max(P, p + 1) > M, M = original_max_position_embeddings (64 in tiny-phi3); the batch carries P to
the device. The chunked 120-token prompt against transformers is test_goldens.py's; the engine's chunking and
prefix cache are tests/runtime/test_longrope_engine.py's."""

from __future__ import annotations

import types
from dataclasses import replace

import numpy as np
import pytest

from pagedserve.cupy_kernels.backend import Backend, get_backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.config import config_from_hf_dict
from pagedserve.models.device_batch import pack_batch, to_device, unpack_batch
from pagedserve.models.loading.loader import load_model
from pagedserve.models.rope import RotaryEmbedding, longrope_threshold

BLOCK = 16


@pytest.fixture(scope="module")
def phi3(data_dir):
    return load_model(data_dir / "tiny-phi3").config


def _expected(rope, positions, long_rows):
    f = np.float32(rope.attention_factor)
    short = np.cos(np.outer(positions, rope.inv_freq)) * f
    long = np.cos(np.outer(positions, rope.long_inv_freq)) * f
    return np.where(np.asarray(long_rows)[:, None], long, short)


def test_threshold_is_the_pretraining_length_of_a_longrope_model_only(phi3):
    assert longrope_threshold(phi3) == 64
    plain = config_from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                 "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    assert longrope_threshold(plain) is None


def test_each_token_takes_the_factors_of_max_prompt_length_and_position(phi3):
    """A long prompt's chunk ending within M (positions 10..14 of 120) takes the long factors; a short prompt's
    decodes take the short ones up to position 63 and the long ones from 64 on; a verify step across M (60..65)
    switches inside the step, as the tokens one at a time would."""
    rope = RotaryEmbedding(phi3, get_backend("cpu", "numpy"))
    chunks = [SeqChunk([5] * 5, 10, list(range(8)), prompt_len=120),
              SeqChunk([5], 63, list(range(8)), prompt_len=40),
              SeqChunk([5], 64, list(range(8)), prompt_len=40),
              SeqChunk([5] * 6, 60, list(range(8)), prompt_len=50),
              SeqChunk([5] * 3, 3, list(range(8)), prompt_len=6)]
    batch = build_forward_batch(chunks, BLOCK)
    assert batch.prompt_lens.tolist() == [120, 40, 40, 50, 6]
    long_rows = [True] * 5 + [False, True] + [False] * 4 + [True] * 2 + [False] * 3
    cos, sin = rope.cos_sin(batch)
    np.testing.assert_allclose(cos, _expected(rope, batch.positions, long_rows), rtol=1e-6)
    assert sin.shape == cos.shape
    # the rows told apart are far apart: a wrong choice would fail the check above
    assert not np.allclose(_expected(rope, batch.positions, [True] * 16),
                           _expected(rope, batch.positions, [False] * 16), rtol=1e-3)


def test_without_prompt_lengths_seq_len_stands_in(phi3):
    """A batch without prompt lengths (decode graphs, profile batches) chooses by seq_len, as before: a chunk of a
    long prompt ending within M takes the short factors there. A chunk naming none among others gets its seq_len."""
    rope = RotaryEmbedding(phi3, get_backend("cpu", "numpy"))
    chunks = [SeqChunk([5] * 5, 10, list(range(8))), SeqChunk([5] * 3, 62, list(range(8)))]
    batch = build_forward_batch(chunks, BLOCK)
    assert batch.prompt_lens is None
    cos, _ = rope.cos_sin(batch)
    np.testing.assert_allclose(cos, _expected(rope, batch.positions, [False] * 5 + [True] * 3), rtol=1e-6)
    mixed = build_forward_batch([chunks[0], SeqChunk([5] * 3, 62, list(range(8)), prompt_len=70)], BLOCK)
    assert mixed.prompt_lens.tolist() == [15, 70]
    with pytest.raises(ValueError, match="prompt_len must be at least 1"):
        build_forward_batch([SeqChunk([5], 0, [0], prompt_len=0)], BLOCK)


def test_prompt_lengths_travel_in_the_packed_metadata():
    chunks = [SeqChunk([5] * 5, 10, list(range(3)), prompt_len=120), SeqChunk([7], 20, [4, 5], prompt_len=9)]
    batch = build_forward_batch(chunks, BLOCK)
    i64, i32, layout = pack_batch(batch, 3)
    got = unpack_batch(i64, i32, layout)
    assert got.prompt_lens.tolist() == [120, 9]
    assert got.block_tables.tolist() == batch.block_tables.tolist()
    plain = build_forward_batch([SeqChunk([5] * 5, 10, list(range(3)))], BLOCK)
    i64, i32, layout = pack_batch(plain, 1)
    assert unpack_batch(i64, i32, layout).prompt_lens is None and i32.size == layout.i32_size == 2 + 1 + 1


class _DeviceArray(np.ndarray):
    """Looks like a CuPy array to cuda_ops.is_cupy_array (its type's module starts with 'cupy')."""

    __module__ = "cupy_stand_in"


def test_to_device_uploads_the_prompt_lengths_in_the_int32_buffer(phi3):
    """On a GPU backend (a stand-in CuPy whose arrays are numpy) the prompt lengths come up in the int32 buffer:
    still two uploads, and the device batch gives the host batch's cos/sin."""
    uploads = []

    def asarray(a, dtype=None):
        uploads.append(np.asarray(a).copy())
        return np.array(a, dtype=dtype).view(_DeviceArray)

    backend = Backend("cupy", types.SimpleNamespace(asarray=asarray), np.dtype(np.float16))
    chunks = [SeqChunk([5] * 5, 10, list(range(3)), prompt_len=120), SeqChunk([7], 20, [4, 5], prompt_len=9)]
    batch = build_forward_batch(chunks, BLOCK)
    dev = to_device(batch, backend, BLOCK, 8, vocab_size=10)
    assert [u.dtype for u in uploads] == [np.int64, np.int32]
    assert isinstance(dev.prompt_lens, _DeviceArray) and dev.prompt_lens.tolist() == [120, 9]
    assert uploads[1][-2:].tolist() == [120, 9]
    rope = RotaryEmbedding(phi3, get_backend("cpu", "numpy"))
    np.testing.assert_array_equal(rope.cos_sin(dev)[0], rope.cos_sin(batch)[0])
    with pytest.raises(ValueError, match=r"prompt_lens has shape \(1,\), expected \(2,\)"):
        to_device(replace(batch, prompt_lens=np.array([3], dtype=np.int32)), backend, BLOCK, 8)
