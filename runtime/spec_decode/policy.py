"""SpecPolicy: whether a decoding sequence speculates on the next step, and with how many drafts.

A verify step of a sequence with d drafts emits 1 + (accepted drafts) tokens and makes the step's
forward d rows larger. It pays when the tokens it is expected to add exceed what the extra rows cost,
and both sides are measured, not assumed:

Cost (StepCosts). The time of every step made only of decodes and verifies (its forward and sampling:
this process's CPU time on the CPU backend, wall time on a GPU) is recorded by its number of rows M
(an exponential moving average per M). What a step of M rows costs against one of B rows is then
T(M) / T(B): the measured figures where there are some, the nearest measured M scaled by
a prior shape where not (`CPU_PRIOR`, `GPU_PRIOR`). On this project's CPU backend one OpenBLAS thread
runs a 1-row matmul as a GEMV and 2+ rows as a GEMM that repacks the weights, so a single stream's
verify step costs ~2.7-3.6 decode steps whatever d is up to ~12; on a GPU, or once a batch already
has many rows, the same drafts cost little more than the rows they add.

Gain (acceptance). Drafts are modelled as accepted one after another with probability a each, so d
drafts are expected to add a + a^2 + ... + a^d tokens. a is estimated per sequence from decayed counts
of drafts accepted / drafts tried (a draft is tried when every draft before it was accepted), shrunk
toward an engine-wide estimate of the same kind (so a new sequence starts from what this engine has
seen, e.g. that lookups fail on chat), which itself starts from a prior of `PRIOR_ACCEPTANCE`.
N-gram drafts are also checked without being verified ("shadow" proposals): when a sequence does not
speculate, its lookup's proposal is kept and compared with the tokens it then generates, which is
exactly what verification would have accepted (greedy: equal tokens; sampling: a one-hot draft x is
accepted with probability p(x), the chance the sampled token is x). So n-gram acceptance is learned
for free while speculation is off and it switches back on as soon as the sequence starts copying
again, without paying for failed probes. A draft model's proposals cost compute, so a sequence that
stopped drafting probes again after `probe_interval` steps times what a probe costs in decode steps
beyond the one it replaces (at least 1x), doubling the wait after each probe that accepts nothing (up
to 8x): failed probes take at most about 1/probe_interval of the time. No probe is made where even
drafts that were all accepted could not pay for their step and drafting.

First evidence (CPU, n-gram and suffix): a sequence verifies drafts only once at least one of its own
proposals was checked (unverified, as above): a chat sequence whose lookups fail never pays for a verify
step to find out, and a copying one starts speculating a token or two later.

Decision per step (choose). Given B decoding sequences, each candidate's d and expected gain g, the
candidates are taken best gain-per-row first and the engine keeps the prefix that maximises expected
tokens per second, (B + sum g) / (T(B + sum d) + drafting), none if speculating nothing is best;
drafting is 0 for n-gram and, for a draft model, its measured time per draft step times the longest d. For one stream
this is "speculate iff 1 + g > T(1 + d) / T(1)".

Adaptive k. Each sequence's k starts at num_speculative_tokens, doubles (up to
max_num_speculative_tokens) after a verify step that accepted every draft, and halves (not below
num_speculative_tokens) after one that rejected some: long copied runs take few verify steps.

`min_acceptance_rate` (a number) replaces the cost rule by a fixed threshold on a; 0 speculates always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PRIOR_ACCEPTANCE = 0.7  # an engine's acceptance before it has seen a draft checked
PRIOR_WEIGHT = 2.0  # how many drafts' worth of evidence a prior counts for (engine's and sequence's)
SEQ_DECAY = 0.85  # per draft tried: a sequence remembers its last ~7 drafts
ENGINE_DECAY = 0.98  # per draft tried: the engine remembers its last ~50
COST_EMA_WEIGHT = 0.25  # weight of the newest step time in its row count's average
UNTIMED_DRAFT_STEP = 0.5  # a draft model's step before it is timed, in 1-row target steps
MAX_PROBE_BACKOFF = 3  # a draft-model probe waits probe_interval * 2^backoff steps, backoff <= 3

# Prior shape of the step time against its rows M, in units of a 1-row step: 1 + jump [M > 1] + slope (M - 1).
# CPU: one OpenBLAS thread, SmolLM2-135M shapes: measured 2.5x at M=2, 2.9x at M=5, 3.4x at M=13.
CPU_PRIOR = (1.4, 0.08)
GPU_PRIOR = (0.05, 0.01)


class StepCosts:
    """Measured time of decode/verify steps by their number of rows, with a prior shape where unmeasured."""

    def __init__(self, prior: tuple[float, float]) -> None:
        self.jump, self.slope = prior
        self.seconds: dict[int, float] = {}

    def shape(self, rows: int) -> float:
        return 1.0 + (self.jump if rows > 1 else 0.0) + self.slope * (rows - 1)

    def seed(self, seconds: dict[int, float]) -> None:
        """Start from figures measured before the first step (calibration.py); steps then move them as usual."""
        self.seconds.update({int(m): float(s) for m, s in seconds.items() if s > 0})

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            self.seconds[rows] = seconds
        else:  # a stall (another process took the core) moves the average by a bounded step only
            self.seconds[rows] = old + COST_EMA_WEIGHT * (min(seconds, 3.0 * old) - old)

    def estimate(self, rows: int) -> float:
        """Seconds of a step of `rows` rows (in units of the prior when nothing is measured yet)."""
        got = self.seconds.get(rows)
        if got is not None:
            return got
        if not self.seconds:
            return self.shape(rows)
        near = min(self.seconds, key=lambda m: (abs(m - rows), m))
        return self.seconds[near] * self.shape(rows) / self.shape(near)

    def ratio(self, rows: int, base_rows: int) -> float:
        return self.estimate(rows) / self.estimate(base_rows)


@dataclass
class Acceptance:
    """Decayed counts of drafts accepted and drafts tried."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, accepted: int, tried: int, decay: float) -> None:
        keep = decay ** tried
        self.accepted = self.accepted * keep + accepted
        self.tried = self.tried * keep + tried

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)


@dataclass
class SeqPolicy:
    """A sequence's record: its acceptance, its k, its pending shadow proposal, its probe clock."""

    k: int
    acceptance: Acceptance
    shadow: list[int] | None = None  # drafts proposed but not verified, checked against what comes
    shadow_at: int = 0  # the sequence's length when the shadow was proposed
    shadow_counted: int = 0  # drafts of the shadow already counted (checked, accepted or not)
    steps_off: int = 0  # eligible steps without drafts since the last verify (draft-model probes)
    backoff: int = 0
    probing: bool = False


@dataclass
class Candidate:
    key: object  # the caller's handle (a Request)
    record: SeqPolicy
    num_drafts: int


def expected_gain(a: float, d: int) -> float:
    """Drafts expected to be accepted out of d, each accepted with probability a once the ones before were."""
    return sum(a ** i for i in range(1, d + 1))


def accepted_prefix(drafts: Sequence[int], actual: Sequence[int]) -> int:
    n = 0
    for x, y in zip(drafts, actual):
        if x != y:
            break
        n += 1
    return n


class SpecPolicy:
    def __init__(self, num_speculative_tokens: int, max_num_speculative_tokens: int, probe_interval: int,
                 min_acceptance_rate: float | None, gpu: bool, shadow: bool) -> None:
        self.k0 = num_speculative_tokens
        self.k_max = max(max_num_speculative_tokens, num_speculative_tokens)
        self.probe_interval = probe_interval
        self.min_acceptance_rate = min_acceptance_rate
        self.shadow = shadow  # proposals are free to make (n-gram): check them without verifying
        self.gpu = gpu
        self.costs = StepCosts(GPU_PRIOR if gpu else CPU_PRIOR)
        self.engine = Acceptance()
        self.draft_step_seconds: float | None = None  # a draft model's time per draft token step (batched)
        self.num_shadow_checked = 0  # shadow drafts checked against the generated tokens (statistics)

    def new_record(self) -> SeqPolicy:
        return SeqPolicy(self.k0, Acceptance())

    # -- what was learned ----------------------------------------------------------------------

    def acceptance_rate(self, record: SeqPolicy) -> float:
        return record.acceptance.rate(self.engine.rate(PRIOR_ACCEPTANCE))

    def _learn(self, record: SeqPolicy, accepted: int, tried: int) -> None:
        if tried > 0:
            record.acceptance.add(accepted, tried, SEQ_DECAY)
            self.engine.add(accepted, tried, ENGINE_DECAY)

    def catch_up(self, record: SeqPolicy, tokens: Sequence[int]) -> None:
        """Check the pending shadow proposal against the tokens generated since (the whole sequence given)."""
        if record.shadow is None:
            return
        actual = tokens[record.shadow_at : record.shadow_at + len(record.shadow)]
        n = accepted_prefix(record.shadow, actual)
        done = n < len(actual) or len(actual) == len(record.shadow)  # a mismatch, or every draft came true
        checked = n + (1 if n < len(actual) else 0)
        seen = record.shadow_counted  # each draft counts once, as the tokens come in one step at a time
        if checked > seen:
            self._learn(record, max(0, n - seen), checked - seen)
            self.num_shadow_checked += checked - seen
            record.shadow_counted = checked
        if done:
            record.shadow = None

    def set_shadow(self, record: SeqPolicy, drafts: Sequence[int], length: int) -> None:
        if self.shadow and record.shadow is None and len(drafts) > 0:
            record.shadow, record.shadow_at, record.shadow_counted = list(drafts), length, 0

    def observe_verify(self, record: SeqPolicy, num_drafts: int, num_accepted: int) -> None:
        """A verify step of num_drafts drafts accepted num_accepted: learn, and grow or shrink k."""
        self._learn(record, num_accepted, num_accepted + (1 if num_accepted < num_drafts else 0))
        if num_accepted == num_drafts:
            if num_drafts >= record.k:
                record.k = min(self.k_max, 2 * record.k)
        else:
            record.k = max(self.k0, record.k // 2)
        if record.probing:
            record.backoff = min(MAX_PROBE_BACKOFF, record.backoff + 1) if num_accepted == 0 else 0
        elif num_accepted > 0:
            record.backoff = 0
        record.probing = False
        record.steps_off = 0

    def observe_step(self, num_rows: int, seconds: float) -> None:
        self.costs.observe(num_rows, seconds)

    def observe_drafting(self, num_steps: int, seconds: float) -> None:
        """A draft model ran num_steps decode steps (for all the chosen sequences at once) in `seconds`."""
        if num_steps > 0:
            per_step = seconds / num_steps
            old = self.draft_step_seconds
            self.draft_step_seconds = per_step if old is None else old + COST_EMA_WEIGHT * (per_step - old)

    def _drafting(self, num_steps: int) -> float:
        """What drafting num_steps tokens adds to a step, in the unit of self.costs. N-gram lookups: 0.
        A draft model not yet timed is assumed to cost half a 1-row target step per draft step (its first
        run also prefills the prompt in the draft): tried after a probe wait where that could pay."""
        if self.shadow:
            return 0.0
        if self.draft_step_seconds is None or not self.costs.seconds:
            return num_steps * UNTIMED_DRAFT_STEP * self.costs.estimate(1)
        return self.draft_step_seconds * num_steps

    # -- the decision ----------------------------------------------------------------------------

    def choose(self, candidates: Sequence[Candidate], num_decoding: int) -> list[Candidate]:
        """The candidates that should verify their drafts on the next step (num_decoding: the step's decodes)."""
        if not candidates:
            return []
        if self.min_acceptance_rate is not None:
            return [c for c in candidates if self.acceptance_rate(c.record) >= self.min_acceptance_rate
                    or self._probe_due(c, base=max(1, num_decoding))]
        base = max(1, num_decoding)
        if self.shadow and not self.gpu:
            # Lookups are free to check unverified: on a CPU, where a failed verify step costs real time, a
            # sequence pays for one only after its own proposals have been checked at least once.
            candidates = [c for c in candidates if c.record.acceptance.tried > 0]
        scored = []
        for c in candidates:
            gain = expected_gain(self.acceptance_rate(c.record), c.num_drafts)
            scored.append((gain / c.num_drafts, gain, c))
        scored.sort(key=lambda t: -t[0])
        t_base = self.costs.estimate(base)
        best, best_n = base / t_base, 0
        rows, gain, longest = base, 0.0, 0
        for n, (_, g, c) in enumerate(scored, 1):
            rows += c.num_drafts
            gain += g
            longest = max(longest, c.num_drafts)  # a draft model runs as many steps as the longest proposal
            rate = (base + gain) / (self.costs.estimate(rows) + self._drafting(longest))
            if rate > best:
                best, best_n = rate, n
        chosen = [c for _, _, c in scored[:best_n]]
        if not self.shadow:  # a draft model's sequences that have not drafted for long probe anyway
            chosen += [c for _, _, c in scored[best_n:] if self._probe_due(c, base)]
        return chosen

    def _probe_due(self, c: Candidate, base: int = 1) -> bool:
        """A draft-model sequence off for long tries again; the wait is stretched by what a try costs (in
        decode steps beyond the one it replaces), so failed tries take at most ~1/probe_interval of the time."""
        if self.shadow:
            return False
        record = c.record
        ratio = (self.costs.estimate(base + c.num_drafts) + self._drafting(c.num_drafts)) / self.costs.estimate(base)
        if (base + c.num_drafts) / ratio <= base:
            return False  # a try cannot pay even if every draft were accepted: nothing to find out
        if record.steps_off + 1 >= (self.probe_interval << record.backoff) * max(1.0, ratio - 1):
            record.probing = True
            return True
        return False

    def declined(self, record: SeqPolicy) -> None:
        """The sequence was eligible but will not speculate this step."""
        record.steps_off += 1
