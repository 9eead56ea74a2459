"""`cpu_threads="auto"`: the CPU backend's thread count (numpy's BLAS and numba's loops) chosen from measured
step cost, and chosen again as the load of the host changes.

Why: OpenBLAS's threads wait for each other by spinning. On a quiet 2-core VM two threads run the M = 64
matmuls of a decode step about 1.8x faster than one; beside one busy process the same matmuls ran at 47
GFLOP/s with two threads and 164 with one, because each call waits for a partner the
kernel has descheduled. A sidecar's neighbours come and go, so no fixed count is right for it.

How: steps run at the current count. Every `interval` steps the next `probe_steps` steps run at another
candidate count (all cores, half, one). A step's cost is its wall time per batched token (decode rows and
prefill tokens alike); the probe's median cost is compared with the median of the `probe_steps` steps just
before it, whose batches are nearly the same (continuous batching changes a batch a little per step). A
probe at least `margin` cheaper becomes the current count; a losing probe doubles the interval, up to
`max_interval`. So the first probes come early (after 8, 16, 32 steps: a host that is busy at start is
found within a dozen steps), a change of load later is followed within max_interval steps, and on a
steady host probing costs about probe_steps / max_interval of the steps (each probe step at the slower
count: on the test VM 1.3-3x a step's time).
Opt-in, because results may depend on the count in the last bits: the numba kernels are thread-count
invariant (tested), but OpenBLAS's kernels need not be (on the test VM the SkylakeX kernel gave the same
bits with 1 and 2 threads, the Haswell kernel did not for 17+ rows), so a run under "auto" is not
bit-reproducible from one run to the next.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable


def candidate_counts(max_threads: int) -> tuple[int, ...]:
    """All cores, half of them, one: most first, no repeats."""
    if max_threads < 1:
        raise ValueError(f"max_threads must be >= 1, got {max_threads}")
    return tuple(sorted({max_threads, max(1, max_threads // 2), 1}, reverse=True))


class CpuThreadsTuner:
    def __init__(self, max_threads: int, apply: Callable[[int], None], probe_steps: int = 4,
                 min_interval: int = 8, max_interval: int = 1024, margin: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter,
                 on_switch: Callable[[int, int, float, float], None] | None = None) -> None:
        """`apply(n)` sets the process's thread count; `on_switch(old, new, old_cost, new_cost)` is told of
        each change (seconds per token, medians of the two windows compared)."""
        if probe_steps < 1 or min_interval < probe_steps or max_interval < min_interval or not 0 <= margin < 1:
            raise ValueError("CpuThreadsTuner: need 1 <= probe_steps <= min_interval <= max_interval and "
                             "0 <= margin < 1")
        self.candidates = candidate_counts(max_threads)
        self.apply, self.clock, self.on_switch = apply, clock, on_switch
        self.probe_steps, self.min_interval, self.max_interval, self.margin = (probe_steps, min_interval,
                                                                               max_interval, margin)
        self.current = self.candidates[0]
        self.interval = min_interval
        self._recent: deque[float] = deque(maxlen=probe_steps)  # costs of the last steps at `current`
        self._since_probe = 0
        self._probe: int | None = None  # the count being probed, while a probe runs
        self._probe_costs: list[float] = []
        self._next_candidate = 1  # round robin over the other candidates
        self._applied: int | None = None
        self.switches = 0  # times the current count changed (for stats and tests)
        self._started = 0.0

    @property
    def threads(self) -> int:
        """The count the next step runs at."""
        return self._probe if self._probe is not None else self.current

    def before_step(self) -> None:
        """Set the thread count for the step about to run (a call into the BLAS library only on a change)."""
        if self._applied != self.threads:
            self.apply(self.threads)
            self._applied = self.threads
        self._started = self.clock()

    def after_step(self, num_tokens: int) -> None:
        """Record the step just run (its batched tokens; the time since before_step)."""
        if num_tokens <= 0:
            return
        cost = (self.clock() - self._started) / num_tokens
        if self._probe is not None:
            self._probe_costs.append(cost)
            if len(self._probe_costs) >= self.probe_steps:
                self._end_probe()
            return
        self._recent.append(cost)
        self._since_probe += 1
        if len(self.candidates) > 1 and self._since_probe >= self.interval and len(self._recent) == self.probe_steps:
            others = [c for c in self.candidates if c != self.current]
            self._probe = others[self._next_candidate % len(others)]
            self._next_candidate += 1
            self._probe_costs = []

    def _end_probe(self) -> None:
        probe, baseline = statistics.median(self._probe_costs), statistics.median(self._recent)
        if probe < (1.0 - self.margin) * baseline:
            if self.on_switch is not None:
                self.on_switch(self.current, self._probe, baseline, probe)
            self.current = self._probe
            self.switches += 1
            self._recent.clear()
        else:
            self.interval = min(2 * self.interval, self.max_interval)
        self._probe, self._since_probe = None, 0
