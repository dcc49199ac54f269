"""Back-off for a batch as a whole: speculate only while the batch's rounds beat plain batched decoding.

Rows of a batch share every forward, so whether speculation pays is a property of the batch, not
of a row: a round's target forward is as wide as its longest proposal and the drafter steps while
any row drafts, so a row's schedule, which prices its own tokens as an even share
(`hf_polybasic.chain.BatchShare`), cannot see what the batch pays. And plain batched decoding is a
stronger baseline than one row decoding alone: n rows cost a memory-bound machine about one step,
while verifying n rows of k tokens each makes a forward of n k tokens, which can be compute-bound.

Before the first round it prices the batch with the cost curves: if not even a generous acceptance
(`UPFRONT_ACCEPTANCE` per token) makes any proposal length beat plain batched decoding by
`UPFRONT_MARGIN`, the batch starts sat out (the drafter is then never even prefilled), as a single
row does when not even perfect acceptance could pay. Otherwise a `BatchGate` times what the batch
actually gets, by the clock, against plain batched decoding timed in the same call: the batch
starts with `PLAIN_FIRST_ROUNDS` plain rounds, timed, then proposes at most `BLIND_LENGTH` tokens
per row, each round judged alone, until a round with proposals has beaten the plain ones; from
then on it judges windows of `WINDOW` rounds and the rows' schedules pick their lengths. A losing
round or window sits the whole batch out (`BackOff`: a stretch of plain rounds that doubles while
the probes after it still lose). The rate to beat is never read off a curve: a curve is one row's
forward measured at another moment, and a batch's forward over n rows' contexts costs what it costs
now (on the 2-core EPYC a curve point off by a third let 4- and 8-row batches speculate at 0.68x).
When rows are done and leave, the batch is a smaller one: it is priced and timed afresh (a forward
of fewer rows stays memory-bound for more tokens each, so drafting may pay where it did not).
Every row's schedule of the level under the target consults it (`CostAwareSchedule.length`).

Lossless like every schedule: it only decides, from past timings, whether the next round proposes.
"""

from __future__ import annotations

from ..costs.curve import interpolate_cost
from ..costs.estimate import CostEstimate
from .backoff import MAX_BACKOFF_ROUNDS, BackOff
from .rates import decayed, expected_tokens

# rounds with proposals over which the batch's rate is judged, and the share of plain batched
# decoding's rate they must reach to go on
WINDOW = 3
MARGIN = 0.95
# the up-front check: acceptance per proposed token it assumes, the gain over plain it asks for, and
# the longest proposal it considers
UPFRONT_ACCEPTANCE = 0.8
UPFRONT_MARGIN = 1.1
UPFRONT_LENGTHS = 8
# a batch decodes plainly for this many rounds (after the prefill) to time what it must beat
PLAIN_FIRST_ROUNDS = 2
# ... and its rows propose at most this many tokens per round until a round with proposals has
# beaten the plain ones (each such round is judged alone)
BLIND_LENGTH = 2


class BatchGate:
    """Whether the rows of a batch propose this round (see the module docstring).

    Args:
        rows: the batch's rows.
        target_costs: the target's forward cost, ``seconds(k)`` for k tokens scored
            (`hf_polybasic.costs.CostEstimate`), for the up-front check; None (no curve:
            ``measure_costs=False`` and none stored): no up-front check.
        step_costs: the proposing level's own forward cost, ``seconds(k)`` (its model's curve; None
            for a `Drafter`, whose proposals are priced as free): with ``target_costs``, the up-front check.
    """

    def __init__(self, rows: int, target_costs: CostEstimate | None = None, step_costs: CostEstimate | None = None):
        self.target_costs, self.step_costs = target_costs, step_costs
        self.rows = rows
        self.backoff = BackOff()
        self._start()
        self.rounds = 0
        self.window_tokens = self.window_seconds = 0.0
        self.window_rounds = 0
        self.plain_seconds = self.plain_rounds = 0.0  # decayed: seconds per row of a plain round, rounds

    @property
    def paused(self) -> bool:
        return self.backoff.paused

    def observe_round(self, tokens: int, seconds: float, rows: int) -> None:
        """The batch's last round: its ``rows`` live rows emitted ``tokens`` tokens in ``seconds``."""
        self.rounds += 1
        if rows != self.rows:  # a smaller batch from now on: this round was the larger one's
            self._rows_left(rows)
            return
        if self.rounds == 1:  # it holds the prompts' prefill
            return
        if self.backoff.paused:
            self.plain_seconds = decayed(self.plain_seconds, seconds / max(rows, 1))
            self.plain_rounds = decayed(self.plain_rounds, 1.0)
            self.backoff.sit_out()
            return
        self.window_tokens += tokens
        self.window_seconds += seconds
        self.window_rounds += 1
        if self.window_rounds < self.window:
            return
        rate = self.window_tokens / max(self.window_seconds, 1e-12)
        self.window_tokens = self.window_seconds = 0.0
        self.window_rounds = 0
        plain = self.plain_rate()
        if plain is None or rate >= MARGIN * plain:
            self.backoff.reset()
            if plain is not None:  # proposing was seen to pay: the rows' schedules decide their lengths
                self.window, self.cap = WINDOW, None
        else:
            self.backoff.pause()

    def _rows_left(self, rows: int) -> None:
        """Rows that were done left the batch: it is a smaller batch now, which may pay where the larger
        one did not (a forward of fewer rows stays memory-bound for more tokens each). What was timed
        for the larger batch is dropped; it is priced and timed afresh (`_start`)."""
        self.rows = rows
        self.window_tokens = self.window_seconds = 0.0
        self.window_rounds = 0
        self.plain_seconds = self.plain_rounds = 0.0
        paused_rounds = self.backoff.paused_rounds
        self.backoff = BackOff()
        self.backoff.paused_rounds = paused_rounds
        self._start()

    def _start(self) -> None:
        """Sit out for good where the curves say no proposal can pay; else time `PLAIN_FIRST_ROUNDS`
        plain rounds, then judge single rounds of at most `BLIND_LENGTH` tokens per row."""
        self.window, self.cap = 1, BLIND_LENGTH
        if self.target_costs is not None and not proposing_can_pay(self.rows, self.target_costs, self.step_costs):
            self.backoff.pause(MAX_BACKOFF_ROUNDS)
        else:
            self.backoff.pause(PLAIN_FIRST_ROUNDS)

    def plain_rate(self) -> float | None:
        """Tokens per second of plain batched decoding with the batch's live rows, timed in this
        call's plain rounds since rows last left (their decayed seconds per row); None before one."""
        if self.plain_rounds:
            return self.plain_rounds / self.plain_seconds
        return None


def proposing_can_pay(rows: int, target_costs: CostEstimate, step_costs: CostEstimate | None = None) -> bool:
    """Whether some proposal length k pays for ``rows`` rows sharing each forward, priced on the
    curves: rows E(k) / (k s(rows) + T(rows (k + 1))) > `UPFRONT_MARGIN` rows / T(rows), with E(k)
    the expected tokens at `UPFRONT_ACCEPTANCE` per token and s the proposing level's step.

    The curves are read point by point (`interpolate_cost`), not through the schedule's straight
    line: what decides here is where a forward stops costing about one step (memory-bound: a batch
    of rows for the price of one) and starts growing with its tokens (compute-bound), which a
    straight line through all points blurs."""
    plain = rows / max(_interpolated(target_costs, rows), 1e-12)
    step = 0.0 if step_costs is None else _interpolated(step_costs, rows)
    return any(
        rows * expected_tokens(UPFRONT_ACCEPTANCE, k) / (k * step + _interpolated(target_costs, rows * (k + 1)))
        > UPFRONT_MARGIN * plain
        for k in range(1, UPFRONT_LENGTHS + 1)
    )


def _interpolated(costs: CostEstimate, tokens: int) -> float:
    """T(tokens) from a `CostEstimate`'s points as this call sees them."""
    return interpolate_cost(costs.snapshot(), tokens)
