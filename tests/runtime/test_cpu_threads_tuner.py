"""cpu_threads="auto" (runtime/engine/cpu_threads_tuner.py): probes, switches and backs off by measured step cost.

A fake clock makes each step cost what the test says for the thread count it ran at, so the decisions
are checked exactly; one engine test runs the real thing on the tiny model.
"""

from __future__ import annotations

import pytest

from pagedserve.cupy_kernels.host import blas_threads as bt
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.cpu_threads_tuner import CpuThreadsTuner, candidate_counts


class Host:
    """A fake host: seconds per token at each thread count, changeable mid-run."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.threads, self.applied = cost, 0.0, None, []

    def apply(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def clock(self) -> float:
        return self.now

    def run(self, tuner: CpuThreadsTuner, steps: int, tokens: int = 64) -> list[int]:
        ran = []
        for _ in range(steps):
            tuner.before_step()
            ran.append(self.threads)
            self.now += self.cost[self.threads] * tokens
            tuner.after_step(tokens)
        return ran


def make(host: Host, max_threads: int = 2, **kw) -> CpuThreadsTuner:
    return CpuThreadsTuner(max_threads, host.apply, clock=host.clock, **kw)


def test_candidates_are_all_half_and_one():
    assert candidate_counts(1) == (1,)
    assert candidate_counts(2) == (2, 1)
    assert candidate_counts(16) == (16, 8, 1)
    with pytest.raises(ValueError):
        candidate_counts(0)


def test_a_quiet_host_keeps_all_threads_and_probes_less_and_less():
    host = Host({2: 1.0, 1: 1.8})
    tuner = make(host, probe_steps=4, min_interval=32, max_interval=256)
    ran = host.run(tuner, 2000)
    assert tuner.current == 2 and tuner.switches == 0
    assert tuner.interval == 256
    probes = ran.count(1)
    # Intervals 32, 64, 128, then 256 each: 4 probes to reach the cap, one per 256 steps after it.
    assert 4 * 4 <= probes <= 4 * (4 + 2000 // 256)
    assert probes / len(ran) < 0.02


def test_a_busy_neighbour_moves_it_to_one_thread_and_back_when_it_leaves():
    host = Host({2: 1.0, 1: 1.8})
    tuner = make(host, probe_steps=4, min_interval=32, max_interval=256)
    host.run(tuner, 100)
    assert tuner.current == 2
    host.cost = {2: 6.0, 1: 2.0}  # two threads collapse beside a busy process
    host.run(tuner, 300)  # the next probe (within max_interval steps) finds one thread 3x cheaper
    assert tuner.current == 1 and tuner.switches == 1
    host.cost = {2: 1.0, 1: 1.8}  # the neighbour is gone
    host.run(tuner, 300)
    assert tuner.current == 2 and tuner.switches == 2


def test_a_small_difference_is_not_a_switch():
    host = Host({2: 1.0, 1: 0.95})  # 5% better: within the 10% margin (noise)
    tuner = make(host, probe_steps=4, min_interval=8, max_interval=64)
    host.run(tuner, 500)
    assert tuner.current == 2 and tuner.switches == 0


def test_the_library_is_called_only_on_a_change_and_empty_steps_are_ignored():
    host = Host({2: 1.0, 1: 2.0})
    tuner = make(host, probe_steps=2, min_interval=4, max_interval=8)
    host.run(tuner, 4)
    assert host.applied == [2]
    tuner.before_step()
    tuner.after_step(0)  # nothing batched: not a sample
    assert tuner._since_probe == 4


def test_one_core_has_nothing_to_tune():
    host = Host({1: 1.0})
    tuner = make(host, max_threads=1, min_interval=4, max_interval=8)
    assert host.run(tuner, 50) == [1] * 50


@pytest.mark.parametrize("kw", [dict(probe_steps=0), dict(min_interval=2, probe_steps=4), dict(margin=1.0),
                                dict(max_interval=8, min_interval=16)])
def test_bad_tuner_settings_raise(kw):
    with pytest.raises(ValueError):
        CpuThreadsTuner(2, lambda n: None, **kw)


def test_config_accepts_auto_and_refuses_other_words_and_tensor_parallel():
    assert EngineConfig(cpu_threads="auto").cpu_threads == "auto"
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        EngineConfig(cpu_threads="fast")
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        EngineConfig(cpu_threads="auto", tensor_parallel_size=2)


@pytest.mark.skipif(bt.blas_threads() is None, reason="numpy's BLAS is not an OpenBLAS found here")
def test_the_engine_runs_the_tuner_and_reports_its_count(data_dir):
    from pagedserve.runtime.llm import LLM
    from pagedserve.runtime.sampling_params import SamplingParams

    before = bt.blas_threads()
    try:
        llm = LLM(str(data_dir / "tiny-llama"), device="cpu", cpu_threads="auto", kv_cache_memory_bytes=8 << 20)
        engine = llm.engine
        tuner = engine.threads_tuner
        assert tuner is not None and tuner.candidates[0] == bt.STARTED_BLAS_THREADS
        tuner.min_interval = tuner.interval = tuner.probe_steps  # probe at once
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 24
        assert tuner._since_probe + len(tuner._probe_costs) > 0  # steps were recorded
        assert engine.cpu_threads == tuner.current in tuner.candidates
    finally:
        bt.set_cpu_threads(before)
