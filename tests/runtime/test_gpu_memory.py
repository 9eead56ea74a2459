"""runtime/worker/gpu_memory.py on the CPU: the KV sizing arithmetic with made-up numbers, the profile batches,
and the profile orchestration run against the numpy model with a stand-in for CuPy's memory calls."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from pagedserve.cupy_kernels.backend import Backend
from pagedserve.cupy_kernels.kernel_set import numpy_kernels
from pagedserve.models.device_batch import unpack_batch
from pagedserve.models.kv_cache import kv_bytes_per_block
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.runtime.worker import gpu_memory
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.worker.cuda_graphs import graph_pool_reserve
from pagedserve.runtime.worker.gpu_memory import DeviceMemory, array_bytes, decode_profile_batch, graph_static_bytes, model_weight_bytes, profile_chunks, size_kv_cache  # noqa: E501

from model_factory import random_model

GIB = 1 << 30


def _sizing(**kw):
    args = dict(total_bytes=80 * GIB, gpu_memory_utilization=0.9, weights_bytes=16 * GIB, other_live_bytes=GIB // 4,
                pool_cached_bytes=GIB // 4, non_pool_bytes=GIB // 2, activation_peak_bytes=3 * GIB,
                cuda_graph_bytes=GIB, bytes_per_block=2 * 1024 * 1024)
    args.update(kw)
    return size_kv_cache(**args)


def test_kv_budget_is_utilization_times_total_minus_everything_else():
    s = _sizing()
    budget = int(80 * GIB * 0.9)
    assert s.kv_cache_bytes == budget - (16 * GIB + GIB // 4 + GIB // 4 + GIB // 2 + 3 * GIB + GIB)
    assert s.num_blocks == s.kv_cache_bytes // (2 * 1024 * 1024) == 51 * 512
    assert s.num_blocks * s.bytes_per_block <= s.kv_cache_bytes < (s.num_blocks + 1) * s.bytes_per_block
    # every reserved byte moves the pool one for one
    assert _sizing(activation_peak_bytes=3 * GIB + 4 * 1024 * 1024).num_blocks == s.num_blocks - 2
    assert _sizing(cuda_graph_bytes=0).num_blocks == s.num_blocks + 512
    fields = s.log_fields()
    assert fields["num_blocks"] == s.num_blocks and fields["weights_gib"] == 16.0
    assert fields["kv_cache_gib"] == round(s.kv_cache_bytes / GIB, 3) and "bytes_per_block" in fields


def test_no_room_is_a_precise_error():
    with pytest.raises(ValueError) as e:
        _sizing(gpu_memory_utilization=0.25)
    msg = str(e.value)
    assert "gpu_memory_utilization=0.25" in msg and "80.00 GiB" in msg and "weights 16.00 GiB" in msg
    assert "activation_peak 3.00 GiB" in msg and "max_num_batched_tokens" in msg
    with pytest.raises(ValueError, match="less than one block"):
        _sizing(total_bytes=21 * GIB, gpu_memory_utilization=1.0)


@pytest.mark.parametrize("tokens,seqs,max_len", [(2048, 256, 8192), (8192, 1, 2048), (100, 256, 4096),
                                                 (37, 5, 8), (16, 16, 16)])
def test_profile_chunks_fill_the_token_budget(tokens, seqs, max_len):
    chunks, num_blocks = profile_chunks(tokens, seqs, max_len, 16)
    lens = [len(c.token_ids) for c in chunks]
    assert sum(lens) == tokens and max(lens) - min(lens) <= 1 and max(lens) <= max_len
    assert len(chunks) == max(min(seqs, tokens), -(-tokens // max_len))
    blocks = [b for c in chunks for b in c.block_table]
    assert sorted(blocks) == list(range(num_blocks))
    assert all(len(c.block_table) == -(-len(c.token_ids) // 16) for c in chunks)


def test_decode_profile_batch_has_max_model_len_wide_tables():
    batch = unpack_batch(*decode_profile_batch(5, 1000, 16))
    assert batch.block_tables.shape == (5, 63) and (batch.slot_mapping == -1).all()
    # one pair of buffers for the largest size and width, shared by every graph, and the logits
    assert graph_static_bytes([1, 4], 63, 100) == (4 * 4 * 8 + (9 + 4 * 63) * 4) + 4 * 100 * 4


def test_weight_bytes_count_views_once():
    a = np.zeros((10, 4), np.float32)
    assert array_bytes([a, a.T, a[2:], None, np.zeros(3, np.float16)]) == 160 + 6
    for arch in ("llama", "qwen2"):  # qwen2 here: tied embeddings (lm_head is the embedding's view) and biases
        cfg, weights = random_model(arch)
        model = LlamaForCausalLM(cfg, weights, get_backend("cpu", "numpy"))  # [in, out] arrays, as on a GPU
        expected = sum(w.nbytes for w in weights.values())
        assert model_weight_bytes(model) == expected


class _FakeCuda:
    """What profile_kv_cache touches of cupy.cuda / cupy, over numpy, with scripted pool sizes."""

    def __init__(self, scratch_bytes: int) -> None:
        self.calls: list[str] = []
        fake = self

        class Pool:
            def malloc(self, size):
                raise AssertionError("numpy arrays never reach the allocator")

            def total_bytes(self):
                return scratch_bytes

            def free_all_blocks(self):
                fake.calls.append("scratch.free_all_blocks")

        @contextlib.contextmanager
        def using_allocator(alloc):
            fake.calls.append("using_allocator")
            yield

        self.Device = lambda: types.SimpleNamespace(synchronize=lambda: self.calls.append("sync"))
        self.MemoryPool = Pool
        self.using_allocator = using_allocator


def test_profile_runs_the_forwards_and_sampler_and_does_the_arithmetic(monkeypatch):
    cfg, weights = random_model(layers=2, vocab=97)
    cuda = _FakeCuda(scratch_bytes=5_000)
    default_pool = types.SimpleNamespace(free_all_blocks=lambda: cuda.calls.append("pool.free_all_blocks"))
    xp = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("_")})
    xp.cuda, xp.get_default_memory_pool = cuda, lambda: default_pool
    model = LlamaForCausalLM(cfg, weights, get_backend("cpu", "numpy"))  # weights as [in, out] arrays, as on a GPU
    model.backend = Backend("cupy", xp, np.dtype(np.float32), numpy_kernels())  # the GPU path, on numpy arrays
    forwards = []
    real_forward = model.forward
    model.forward = lambda batch, kv: forwards.append((batch.num_tokens, batch.block_tables.shape)) or real_forward(batch, kv)  # noqa: E501
    w = model_weight_bytes(model)
    readings = iter([
        DeviceMemory(free_bytes=70 * GIB, total_bytes=80 * GIB, pool_used_bytes=w + 100, pool_total_bytes=w + 1000),
        DeviceMemory(free_bytes=67 * GIB, total_bytes=80 * GIB, pool_used_bytes=w + 100, pool_total_bytes=w + 1000 + 3 * GIB),  # noqa: E501
        DeviceMemory(free_bytes=70 * GIB, total_bytes=80 * GIB, pool_used_bytes=w + 50, pool_total_bytes=w + 250),
    ])
    monkeypatch.setattr(gpu_memory, "read_device_memory", lambda cp: next(readings))
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, max_model_len=200, gpu_memory_utilization=0.5,
                          cuda_graph_batch_sizes=(1, 2, 4))
    per_block = kv_bytes_per_block(cfg, 16, 4)
    s = gpu_memory.profile_kv_cache(model, config, 200, 16, per_block)
    # the mixed prefill (96 tokens over 8 sequences), the decode at max_num_seqs and at the largest graph
    # size, both with tables as wide as max_model_len needs (13 blocks)
    assert forwards == [(96, (8, 1)), (8, (8, 13)), (4, (4, 13))]
    assert cuda.calls.count("using_allocator") == 1 and "scratch.free_all_blocks" in cuda.calls
    assert s.activation_peak_bytes == 3 * GIB
    assert s.cuda_graph_bytes == graph_pool_reserve(5_000) + graph_static_bytes((1, 2, 4), 13, 97)
    assert s.weights_bytes == w and s.other_live_bytes == 50 and s.pool_cached_bytes == 200
    assert s.non_pool_bytes == 10 * GIB - (w + 250)
    assert s.kv_cache_bytes == 40 * GIB - (10 * GIB + 3 * GIB + s.cuda_graph_bytes)
    assert s.num_blocks == s.kv_cache_bytes // per_block


def test_profile_failures_say_what_was_profiled(monkeypatch):
    cfg, weights = random_model(layers=1)
    xp = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("_")})
    xp.cuda = _FakeCuda(0)
    xp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    model = LlamaForCausalLM(cfg, weights, get_backend("cpu", "numpy"))
    model.backend = Backend("cupy", xp, np.dtype(np.float32), numpy_kernels())

    def boom(batch, kv):
        raise MemoryError("Out of memory allocating 1,024 bytes")

    model.forward = boom
    monkeypatch.setattr(gpu_memory, "read_device_memory", lambda cp: DeviceMemory(1, 2, 0, 0))
    with pytest.raises(RuntimeError, match=r"GPU profile run \(max_num_batched_tokens=64, 8 sequences.*"
                                           r"MemoryError: Out of memory"):
        gpu_memory.profile_kv_cache(model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=8), 128, 16, 1024)
