"""Back-off for a batch as a whole: speculate only while the batch's rounds beat plain batched decoding.

Rows of a batch share every forward, so whether speculation pays is a property of the batch, not
of a row: a round's target forward is as wide as its longest proposal and the drafter steps while
any row drafts, so a row's schedule, which prices its own tokens as an even share
(`hf_polybasic.chain.BatchShare`), cannot see what the batch pays. And plain batched decoding is a
stronger baseline than one row decoding alone: n rows cost a memory-bound machine about one step,
while verifying n rows of k tokens each makes a forward of n k tokens, which can be compute-bound.

Before the first round it prices the batch with the cost curves (without a curve for the target it
starts with a few plain rounds instead, to time what speculation must beat): if not even a generous acceptance
(`UPFRONT_ACCEPTANCE` per token) makes any proposal length beat plain batched decoding by
`UPFRONT_MARGIN`, the batch starts sat out (the drafter is then never even prefilled), as a single
row does when not even perfect acceptance could pay. Then a `BatchGate` times what the batch actually gets, by the clock: the tokens all rows emit per second
in rounds with proposals, against the same in rounds without (plain batched decoding, measured in
the same call; until a plain round is seen, the target's cost curve for a forward of one token per
row). After `WINDOW` rounds with proposals it either lets them go on or sits the whole batch out
(`BackOff`: a stretch of plain rounds that doubles while the windows after it still lose). When
rows are done and leave, the batch is a smaller one: the curves decide afresh (a forward of fewer
rows stays memory-bound for more tokens each, so drafting may pay where it did not). Every row's
schedule of the level under the target consults it (`CostAwareSchedule.length`).

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
# without a cost curve for the target, the batch decodes plainly for this many rounds (after the
# prefill) to time what it must beat
PLAIN_FIRST_ROUNDS = 2
# ... and its rows propose at most this many tokens per round until a round with proposals has
# beaten the plain ones (each such round is judged alone)
BLIND_LENGTH = 2


class BatchGate:
    """Whether the rows of a batch propose this round (see the module docstring).

    Args:
        rows: the batch's rows.
        target_costs: the target's forward cost, ``seconds(k)`` for k tokens scored
            (`hf_polybasic.costs.CostEstimate`), to price plain batched rounds before one is timed;
            None (no curve: ``measure_costs=False`` and none stored): the batch starts with
            `PLAIN_FIRST_ROUNDS` plain rounds, timed, so that its windows have a rate to beat, and
            its rows propose at most `BLIND_LENGTH` tokens, each such round judged alone, until
            proposing has been seen to pay (``cap``).
        step_costs: the proposing level's own forward cost, ``seconds(k)`` (its model's curve; None
            for a `Drafter`, whose proposals are priced as free): with ``target_costs``, the up-front check.
    """

    def __init__(self, rows: int, target_costs: CostEstimate | None = None, step_costs: CostEstimate | None = None):
        self.target_costs, self.step_costs = target_costs, step_costs
        self.rows = rows
        self.backoff = BackOff()
        # without a curve nothing prices a round before it is timed: plain rounds first, then single
        # rounds of short proposals, until one window shows that proposing pays
        self.window = WINDOW if target_costs is not None else 1
        self.cap: int | None = None if target_costs is not None else BLIND_LENGTH
        if target_costs is None:
            self.backoff.pause(PLAIN_FIRST_ROUNDS)
        elif not proposing_can_pay(rows, target_costs, step_costs):
            self.backoff.pause(MAX_BACKOFF_ROUNDS)
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
        if rows != self.rows:
            self._rows_left(rows)
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
        plain = self.plain_rate(rows)
        if plain is None or rate >= MARGIN * plain:
            self.backoff.reset()
            if plain is not None:  # proposing was seen to pay: the rows' schedules decide their lengths
                self.window, self.cap = WINDOW, None
        else:
            self.backoff.pause()

    def _rows_left(self, rows: int) -> None:
        """Rows that were done left the batch: it is a smaller batch now, which may pay where the larger
        one did not (a forward of fewer rows stays memory-bound for more tokens each). What was timed
        for the larger batch is dropped, and the curves decide afresh where there are curves."""
        self.rows = rows
        self.window_tokens = self.window_seconds = 0.0
        self.window_rounds = 0
        self.plain_seconds = self.plain_rounds = 0.0
        if self.target_costs is None:
            return
        paused_rounds = self.backoff.paused_rounds
        self.backoff = BackOff()
        self.backoff.paused_rounds = paused_rounds
        if not proposing_can_pay(rows, self.target_costs, self.step_costs):
            self.backoff.pause(MAX_BACKOFF_ROUNDS)

    def plain_rate(self, rows: int) -> float | None:
        """Tokens per second of plain batched decoding with ``rows`` live rows: timed in this call's
        plain rounds (their seconds per row), else priced by the target's curve (one token per row);
        None if neither is known."""
        if self.plain_rounds:
            return self.plain_rounds / self.plain_seconds
        if self.target_costs is not None:
            return rows / max(_interpolated(self.target_costs, rows), 1e-12)
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
