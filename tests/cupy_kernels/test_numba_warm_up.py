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
from pagedserve.cupy_kernels import numba_attention, numba_ops, numba_prefill
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM

backend = get_backend("cpu", "numba")  # the warm-up runs here

def signatures():
    return {(m.__name__, name, sig) for m in (numba_ops, numba_attention, numba_prefill) for name in dir(m)
            if isinstance(getattr(m, name), numba.core.registry.CPUDispatcher)
            for sig in getattr(m, name).signatures}

warm = signatures()
for read_only in (False, True):  # weights converted in memory, or the weight cache's read-only maps
    cfg, weights = random_model(layers=2, heads=6, kv_heads=2, head_dim=16, hidden=96)
    for w in weights.values():
        w.flags.writeable = not read_only
    model = LlamaForCausalLM(cfg, weights, backend)
    kv = allocate_kv_caches(cfg, 64, 16, backend)
    steps = [[SeqChunk([t % 90 + 1 for t in range(299)], 0, list(range(19)), 1)],  # long prompt: BLAS prefill path
             [SeqChunk([5], 299, list(range(19)), 1)],                    # one decode (one row)
             [SeqChunk([7, 8, 9], 0, [20], 1), SeqChunk([6], 300, list(range(19)), 1)]]  # prefill + decode
    for chunks in steps:
        model.forward(build_forward_batch(chunks, 16), kv)
new = signatures() - warm
print("NEW" if new else "NONE", sorted(str(s) for s in new))
"""


def test_a_forward_compiles_nothing_the_warm_up_did_not():
    tests = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "NONE []", proc.stdout[-3000:]
