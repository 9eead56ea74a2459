"""The host emulation fails where the device would (issue 59): each model shown catching its fault.

A kernel source is mutated the way a real bug would be, built for the host emulation, and run twice: with the
hazard models off (ps_set_hazards(0): cp.async lands at once, static __shared__ carried over between CTAs, the
emulation before issue 59) it passes - the fault was invisible - and with them on (the default every host test
runs with) it fails.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpu_helpers
from pagedserve.cupy_kernels.cuda import attention as cuda_attention, launch as cuda_launch, modules as cuda_modules
from prefill_checks import PREFILL_SPECS, as_float32, check_prefill, prefill_case

_spec = importlib.util.spec_from_file_location("pagedserve_host_emulation_helpers_faults",
                                               Path(__file__).with_name("test_kernels_on_host.py"))
_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_host.GXX is None, reason="g++ not found (host emulation)")]


@dataclass(frozen=True)
class Mutant:
    """A module whose source has one line changed; built under the real module's name."""

    base: cuda_modules.KernelModule
    old: str
    new: str

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def preludes(self) -> tuple[str, ...]:
        return self.base.preludes

    @property
    def name_expressions(self) -> tuple[str, ...]:
        return self.base.name_expressions

    def source(self) -> str:
        text = self.base.source()
        assert text.count(self.old) == 1, f"the mutation's line is not (once) in {self.base.source_file}: {self.old}"
        return text.replace(self.old, self.new)


def _fresh_tables(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "0")
    monkeypatch.setattr(cuda_modules, "_modules", {})
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_launch, "_dummies", {})


def _run_both_ways(monkeypatch, module_name: str, lib, check) -> tuple[BaseException | None, BaseException | None]:
    """check() with the hazard models off, then on: the exception each raised (None: it passed)."""
    monkeypatch.setitem(sys.modules, "cupy", _host.fake_cupy({module_name: lib}))
    outcomes = []
    for hazards in (0, 1):
        lib.ps_set_hazards(hazards)
        _fresh_tables(monkeypatch)
        try:
            with np.errstate(all="ignore"):
                check()
            outcomes.append(None)
        except AssertionError as e:
            outcomes.append(e)
    lib.ps_set_hazards(1)
    return outcomes[0], outcomes[1]


def _prefill_check(kind: str = "f16", dim: int = 64):
    def check():
        rng = np.random.default_rng(3)
        (q, k, v, qsl, lens, tables), floats = prefill_case(rng, PREFILL_SPECS, kind, 2, 2, dim, 16)
        out = cuda_attention.prefill_attention(_host._dev(q), _host._dev(k), _host._dev(v), qsl, lens, tables,
                                               dim ** -0.5)
        check_prefill(as_float32(out.get(), kind), floats, qsl, lens, tables, dim ** -0.5, kind, what="mutant")
    return check


def test_a_cp_async_wait_that_lets_v_still_be_in_flight_fails(tmp_path, monkeypatch):
    """prefill_attention.cu waits for group 1 (this tile's V) before P @ V; wait<2> lets V still be in flight. The
    old emulation (copies at once) passed it; the cp.async model lands V only at its wait_group, so the kernel reads
    the in-flight tile's poison (NaN) and fails its reference check."""
    name = cuda_modules.attention_module_name("prefill_attention", "f16", 64)
    mutant = Mutant(cuda_modules.MODULES[name], "cp_async_wait<1>();  // this tile's V has landed",
                    "cp_async_wait<2>();  // this tile's V has landed")
    lib = _host.load(_host._build(mutant, tmp_path))
    off, on = _run_both_ways(monkeypatch, name, lib, _prefill_check())
    assert off is None, f"without the cp.async model the mutant should pass (the fault was invisible): {off}"
    assert on is not None, "the cp.async model did not catch a wait_group that lets V still be in flight"


def test_the_unmutated_prefill_kernel_passes_with_the_hazard_models_on(tmp_path, monkeypatch):
    name = cuda_modules.attention_module_name("prefill_attention", "f16", 64)
    lib = _host.load(_host._build(cuda_modules.MODULES[name], tmp_path))
    off, on = _run_both_ways(monkeypatch, name, lib, _prefill_check())
    assert off is None and on is None, (off, on)


def test_a_static_shared_value_a_cta_never_writes_fails(tmp_path, monkeypatch):
    """paged_attention.cu sets every row's oldest key (lo_s) in every CTA; the mutant sets it only with a sliding
    window. The old emulation passed it (a C++ static starts at zero and keeps it); poisoned per CTA, a run without
    a window reads garbage bounds and fails."""
    name = cuda_modules.attention_module_name("paged_attention", "f16", 64)
    mutant = Mutant(cuda_modules.MODULES[name],
                    "lo_s[r] = sliding_window > 0 ? max(0, first_pos + qi - sliding_window + 1) : 0;",
                    "if (sliding_window > 0) lo_s[r] = max(0, first_pos + qi - sliding_window + 1);")
    lib = _host.load(_host._build(mutant, tmp_path))
    assert lib.ps_static_shared_count() > 0  # the loader found the kernels' static shared arrays

    def check():
        rng = np.random.default_rng(5)
        gpu_helpers.check_paged_attention(rng, (("decode", [(1, 1), (17, 1), (40, 1), (513, 1)]),), 1, 64, 16, 1,
                                          "mutant")
    off, on = _run_both_ways(monkeypatch, name, lib, check)
    assert off is None, f"without poisoning the mutant should pass (the fault was invisible): {off}"
    assert on is not None, "poisoned static shared memory did not catch a value the CTA never wrote"


# ---------------------------------------------------------------------------------------------
# The capture fake: the real decode forward inside a "capture" that fails as the device's would
# ---------------------------------------------------------------------------------------------

libs, emulated = _host.libs, _host.emulated  # the host emulation's fixtures (every module built once here)


def _capture_tiny_llama(capturer):
    """DecodeGraphs over tiny-llama's CUDA model on the emulation, every (size, width) captured with `capturer`."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.runtime.worker.decode_graphs import DecodeGraphs

    _, gpu = gpu_helpers.model_pair("tiny-llama")
    kv = allocate_kv_caches(gpu.config, 64, gpu_helpers.BS, get_backend("cuda"))
    graphs = DecodeGraphs(gpu, kv, (1, 2), 1024 // gpu_helpers.BS, capturer)
    return gpu, graphs, graphs.capture_all()


class _MutatedOps:
    """The op table, every op as it is unless a subclass mutates it."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)


class _ReadsBack(_MutatedOps):
    """The op table with one mutation: add_rms_norm checks its output on the host (a per-step activation guard)."""

    def add_rms_norm(self, *args, **kwargs):
        out = self._ops.add_rms_norm(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if bool((first > 60000).any()):  # a host read of a device value: a sync every step, refused by a capture
            raise OverflowError("float16 overflow")
        return out


class _AllocatesItsOutput(_MutatedOps):
    """The op table with one mutation: add_rms_norm drops the workspace's `out` and allocates its output."""

    def add_rms_norm(self, x, residual, weight, eps, out=None):
        return self._ops.add_rms_norm(x, residual, weight, eps)


class _MultipliesOnTheDevice(_MutatedOps):
    """The op table with one mutation: the SiLU-gated MLP as CuPy array code (gate_up's GEMM into the workspace, then
    silu(gate) * up as expressions), as a family's activation written with xp would be."""

    def linear_silu_and_mul(self, x, weight_t, quant=None, out=None, workspace=None):
        gate_up = self._ops.linear(x, weight_t, out=workspace.take("gate_up", (x.shape[0], weight_t.shape[1]),
                                                                   x.dtype))
        inter = weight_t.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return gate / (1 + np.exp(-gate)) * up


def test_the_captured_decode_forward_makes_no_host_sync_copy_read_allocation_or_expression(emulated):
    """The real forward (tiny-llama, every captured size and width) inside the strict fake: no host sync, no copy
    either way, no host read of a device value, no CuPy pool allocation, no CuPy array expression (each op writes
    into the decode graphs' workspace, models/workspace.py). Before that workspace the same forward made 34-38
    allocations and 10 expressions a capture (run with -s: the counts are printed)."""
    capturer = _host.StrictCapturer()
    _, graphs, ok = _capture_tiny_llama(capturer)
    assert ok, graphs.disabled_reason
    assert capturer.counts and len(capturer.counts) == capturer.events.count("capture") == 4
    assert [c["what"] for c in capturer.counts] == [[]] * 4
    print("per capture: allocations", [c["allocations"] for c in capturer.counts],
          "expressions", [c["expressions"] for c in capturer.counts])


def _old_and_strict(monkeypatch, mutant) -> tuple[_host.StrictCapturer, Any]:
    """The mutant op table captured with the counting fake (strict=False: it must capture) and the strict one (the
    reason its capture failed)."""
    from dataclasses import replace

    _, gpu = gpu_helpers.model_pair("tiny-llama")
    monkeypatch.setattr(gpu, "backend", replace(gpu.backend, ops=mutant(gpu.backend.ops)))
    old = _host.StrictCapturer(strict=False)
    _, graphs, ok = _capture_tiny_llama(old)
    assert ok, f"the counting fake should have captured the mutant (the fault was invisible to it): " \
               f"{graphs.disabled_reason}"
    _, graphs, ok = _capture_tiny_llama(_host.StrictCapturer())
    assert not ok
    return old, graphs.disabled_reason


def test_an_op_that_allocates_inside_the_captured_forward_fails_the_capture(emulated, monkeypatch):
    """add_rms_norm allocating its output (the workspace's `out` dropped): the counting fake counted the allocations
    and captured; the strict fake fails the capture naming the allocation and the line that made it."""
    old, reason = _old_and_strict(monkeypatch, _AllocatesItsOutput)
    assert all(c["allocations"] > 0 and c["expressions"] == 0 for c in old.counts), old.counts
    assert "allocations inside a stream capture: cupy.empty at ops.py:" in reason, reason


def test_an_array_expression_inside_the_captured_forward_fails_the_capture(emulated, monkeypatch):
    """silu(gate) * up as CuPy expressions: the counting fake counted them and captured; the strict fake fails the
    capture at the first one, naming it and its line."""
    old, reason = _old_and_strict(monkeypatch, _MultipliesOnTheDevice)
    assert all(c["expressions"] > 0 for c in old.counts), old.counts
    assert "expressions inside a stream capture: negative.__call__ at test_emulator_faults.py:" in reason, reason


def test_a_host_read_inside_the_captured_forward_fails_the_capture(emulated, monkeypatch):
    """The capture fake's mutation test: an op that reads its output back on the host. The old fake (a capture is
    a call) captured it; the strict fake fails the capture, and DecodeGraphs falls back to eager with the reason."""
    from dataclasses import replace

    _, gpu = gpu_helpers.model_pair("tiny-llama")
    monkeypatch.setattr(gpu, "backend", replace(gpu.backend, ops=_ReadsBack(gpu.backend.ops)))
    _, graphs, ok = _capture_tiny_llama(_host.RecordingCapturer())
    assert ok, "the old fake should have captured the mutant (the fault was invisible to it)"
    _, graphs, ok = _capture_tiny_llama(_host.StrictCapturer(strict=False))  # (the check's `>` is an expression)
    assert not ok and "host read of a device value" in str(graphs.disabled_reason), graphs.disabled_reason


def test_decode_graphs_with_adapters_capture_cleanly_and_replay_the_eager_step(emulated, tmp_path):
    """A CUDA model with LoRA slots (lora.cu through the op table) captured inside the strict fake: no host sync,
    copy or host read in the captured forward with its LoRA kernels; an adapter copied into a slot after the
    capture, then mixed decode steps (two adapters and the base, padded to a captured size) replay the eager
    step's logits, which differ from the base's."""
    from lora_helpers import make_lora
    from pagedserve.cupy_kernels.backend import get_backend, to_host
    from pagedserve.models import lora as model_lora
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.models.loading.peft import load_peft_adapter
    from pagedserve.runtime.worker.decode_graphs import DecodeGraphs

    _, gpu = gpu_helpers.model_pair("tiny-llama")
    cfg = gpu.config
    adapters = [load_peft_adapter(make_lora(tmp_path / f"a{k}", cfg, rank=8, std=0.15, seed=k, **t), cfg)
                for k, t in enumerate([{}, {"targets": ("q_proj", "v_proj")}])]
    model_lora.attach(gpu, {}, max_loras=3, max_lora_rank=8)
    gpu.lora.set(0, adapters[0])
    kv_eager, kv_graph = (allocate_kv_caches(cfg, 16, gpu_helpers.BS, get_backend("cuda")) for _ in range(2))
    capturer = _host.StrictCapturer()
    graphs = DecodeGraphs(gpu, kv_graph, (2, 4), 1024 // gpu_helpers.BS, capturer)
    assert graphs.capture_all(), graphs.disabled_reason
    fatal = [w for c in capturer.counts for w in c["what"] if not w.startswith(("allocations", "expressions"))]
    assert fatal == []
    gpu.lora.set(2, adapters[1])
    rng = np.random.default_rng(4)
    lens, tables, slots = [9, 21, 14], [[0, 1], [2, 3], [4, 5]], [0, -1, 2]
    prompt = build_forward_batch([SeqChunk(rng.integers(0, cfg.vocab_size, n).tolist(), 0, t, lora_slot=s)
                                  for n, t, s in zip(lens, tables, slots)], gpu_helpers.BS)
    for kv in (kv_eager, kv_graph):
        gpu.forward(prompt, kv)
    batch = build_forward_batch([SeqChunk([5 + i], n, t, lora_slot=s)
                                 for i, (n, t, s) in enumerate(zip(lens, tables, slots))], gpu_helpers.BS)
    want = to_host(gpu.forward(batch, kv_eager))
    got = to_host(graphs.run(batch))
    np.testing.assert_array_equal(got, want)  # the same kernels on the same rows
    base = to_host(gpu.forward(replace(batch, lora_slots=None), kv_eager))
    for row in (0, 2):  # the adapters' rows moved well past the comparisons' tolerance (0.02 of the max logit)
        assert np.abs(want[row] - base[row]).max() > 0.02 * np.abs(base).max()
    np.testing.assert_array_equal(want[1], base[1])  # the base row: untouched by the adapters' kernels
    assert graphs.num_replays == 1
