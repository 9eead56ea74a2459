"""The numba set's warm-up compiles every argument type the model passes, so no request compiles.

A type first seen during a request (a read-only weight, a contiguous key where the warm-up passed a
view) compiles then: seconds of one request's latency with an empty cache. Run in a fresh interpreter,
where the dispatchers hold only what the warm-up made (from the on-disk cache: fast after the first run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

SCRIPT = """
import sys
sys.path.insert(0, TESTS)
import numpy as np
import numba
from model_factory import random_model
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.cupy_kernels.numba_cpu import attention as numba_attention, ops as numba_ops
from pagedserve.cupy_kernels.numba_cpu import prefill as numba_prefill, quant as numba_quant
from pagedserve.cupy_kernels.numba_cpu import cache_write as numba_cache_write, gemm as numba_gemm
from pagedserve.cupy_kernels.numba_cpu import launch as numba_launch
from model_factory import write_gguf
from pagedserve.models.loading.gguf_loader import load_gguf_weights
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM

backend = get_backend("cpu", "numba")  # the warm-up runs here

def signatures():
    return {(m.__name__, name, sig) for m in (numba_ops, numba_attention, numba_prefill, numba_quant, numba_cache_write,
                                              numba_gemm, numba_launch)
            for name in dir(m)
            if isinstance(getattr(m, name), numba.core.registry.CPUDispatcher)
            for sig in getattr(m, name).signatures}

warm = signatures()
assert numba_prefill.takes_matmul_path(np.array([64]), np.array([1000])).all()  # the second step's route
# weights converted in memory, the weight cache's read-only maps, GGUF blocks of both kinds (numba_quant)
for read_only, qtype in ((False, None), (True, None), (False, "Q4_1"), (True, "Q8_0")):
    cfg, weights = random_model(layers=2, heads=6, kv_heads=2, head_dim=16, hidden=96)
    if qtype:
        write_gguf(GGUF, cfg, weights, qtype)
        cfg, weights = load_gguf_weights(GGUF)
    for w in weights.values():
        w.flags.writeable = not read_only
    model = LlamaForCausalLM(cfg, weights, backend)
    assert (model.quantized_matmuls > 0) == bool(qtype)
    kv = allocate_kv_caches(cfg, 64, 16, backend)
    steps = [[SeqChunk([t % 90 + 1 for t in range(299)], 0, list(range(19)), 1)],  # a whole prompt: the matmul path
             [SeqChunk([t % 90 + 1 for t in range(64)], 936, list(range(63)), 1)],  # deep in a context: matmul path
             [SeqChunk([5], 299, list(range(19)), 1)],                    # one decode (one row)
             [SeqChunk([7, 8, 9], 0, [20], 1), SeqChunk([6], 300, list(range(19)), 1)]]  # prefill + decode
    for chunks in steps:
        model.forward(build_forward_batch(chunks, 16), kv)
# a prefill of PARALLEL_MIN_TOKENS tokens whose qkv the fused GEMM does not take (a qkv bias): rotary_and_cache's
# prange over the threads (padding slots)
n = numba_cache_write.PARALLEL_MIN_TOKENS
ones = lambda *shape: np.ones(shape, dtype=np.float32)  # noqa: E731
backend.ops.rotary_and_cache(ones(n, 10 * 16), 6, 2, ones(n, 8), ones(n, 8), *kv[0], np.full(n, -1, dtype=np.int64))
new = signatures() - warm
print("NEW" if new else "NONE", sorted(str(s) for s in new))
"""


def test_a_forward_compiles_nothing_the_warm_up_did_not(tmp_path):
    tests = str(Path(__file__).resolve().parents[1])
    gguf_path = str(tmp_path / "m.gguf")
    proc = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\nGGUF = {gguf_path!r}\n" + SCRIPT],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "NONE []", proc.stdout[-3000:]


EMPTY_CACHE_START = """
import numpy as np
from pagedserve.cupy_kernels import kernel_set
from pagedserve.cupy_kernels.numba_cpu import attention as numba_attention
from pagedserve.cupy_kernels.reference import paged_attention
from pagedserve.cupy_kernels.backend import finish_warm_up, get_backend
from pagedserve.cupy_kernels.numba_cpu.setup import compile_aside
# The worker's way: the child compiles attention and the rotary GEMM's pairs while this process compiles the rest,
# then packs a weight (the model's load) before it waits for the child.
backend = get_backend("cpu", "numba", finish_warm_up=False)
assert not kernel_set._finished.is_set() and kernel_set._compile_child[0] is not None
assert backend.ops.pack_weight([np.ones((32, 8), np.float32), np.ones((32, 8), np.float32)]).shape == (8, 64)
finish_warm_up(backend)
finish_warm_up(backend)  # idempotent
assert kernel_set._finished.is_set() and not kernel_set._compile_child and backend.ops is kernel_set.numba_kernels()
ops = backend.ops
assert compile_aside(numba_attention._ATTENTION) is None  # the cache is now filled
rng = np.random.default_rng(0)
k = rng.standard_normal((8, 16, 2, 16)).astype(np.float32)
v = rng.standard_normal((8, 16, 2, 16)).astype(np.float32)
q = rng.standard_normal((5, 4, 16)).astype(np.float32)
args = (q, k, v, np.array([0, 4, 5]), np.array([40, 70]), np.array([[0, 1, 2, 3, 4], [5, 6, 7, 3, 2]], np.int32), 0.25)
np.testing.assert_allclose(ops.paged_attention(*args), paged_attention.paged_attention(*args), rtol=0, atol=1e-4)
print("OK")
"""


@pytest.mark.slow
def test_an_empty_cache_compiles_attention_aside_and_loads_it(tmp_path):
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", EMPTY_CACHE_START], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
    assert list(tmp_path.rglob("attention._attention_chunk-*.nbi"))
    assert list(tmp_path.rglob("prefill._gather_task-*.nbi"))
    assert list(tmp_path.rglob("gemm_rotary._pair_item-*.nbi"))
    assert list(tmp_path.rglob("launch._launch-*.nbi"))


def test_a_failed_child_only_costs_time(tmp_path, capsys):
    """finish_aside returns whatever the child did; the caller's warm_up then compiles in-process."""
    from types import SimpleNamespace

    from pagedserve.cupy_kernels.numba_cpu.setup import compile_aside, finish_aside

    fake = SimpleNamespace(_cache=SimpleNamespace(_cache_file=SimpleNamespace(_index_path=str(tmp_path / "none"))),
                           py_func=SimpleNamespace(__module__="pagedserve.no_such_module"))
    child = compile_aside(fake)
    assert child is not None
    finish_aside(child)  # logs numba.compile_aside_failed, raises nothing
    assert child.returncode != 0
    (tmp_path / "none").write_text("")
    assert compile_aside(fake) is None  # an index exists: nothing to do aside
    assert compile_aside(object()) is None  # a cache it cannot inspect


def test_compile_aside_takes_the_modules_without_a_cache_index(tmp_path, monkeypatch):
    """One child for every module whose marker kernel has no cache index yet, each module once."""
    from types import SimpleNamespace

    from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup

    def fake(index: str, module: str):
        return SimpleNamespace(_cache=SimpleNamespace(_cache_file=SimpleNamespace(_index_path=str(tmp_path / index))),
                               py_func=SimpleNamespace(__module__=module))

    started = []
    monkeypatch.setattr(numba_setup.subprocess, "Popen", lambda argv, **kw: started.append(argv) or "child")
    (tmp_path / "cached").write_text("")
    a, b, c = fake("a", "pkg.mod_a"), fake("cached", "pkg.mod_b"), fake("c", "pkg.mod_c")
    assert numba_setup.compile_aside(a, b, c, fake("a2", "pkg.mod_a")) == "child"
    assert started[-1][1:] == ["-c", "import pkg.mod_a as m; m.warm_up(); import pkg.mod_c as m; m.warm_up()"]
    assert numba_setup.compile_aside(b) is None and len(started) == 1  # everything cached: no child


def test_call_compiled_runs_a_kernel_by_address_and_propagates_its_errors():
    """A kernel calling another through call_compiled gets the callee's results and its exceptions (inside a
    prange numba wraps those in a SystemError, as for a direct call); the callee is compiled once, on its own."""
    import numpy as np

    from pagedserve.cupy_kernels.numba_cpu.setup import call_compiled, native_address, numba

    @numba.njit
    def part(i, x, out):
        if x[i] < 0:
            raise ValueError("negative input")
        out[i] = 2.0 * x[i] + i

    @numba.njit(parallel=True)
    def run_all(address, x, out):
        for i in numba.prange(x.shape[0]):
            call_compiled(address, (np.int64(i), x, out))

    x, out = np.arange(8, dtype=np.float64), np.zeros(8)
    address = native_address(part, (np.int64(0), x, out))
    run_all(address, x, out)
    np.testing.assert_array_equal(out, 2.0 * x + np.arange(8))
    assert len(part.signatures) == 1

    @numba.njit
    def run_serially(address, x, out):
        for i in range(x.shape[0]):
            call_compiled(address, (np.int64(i), x, out))

    x[3] = -1.0
    with pytest.raises(ValueError, match="negative input"):
        run_serially(address, x, out)
