"""Back-off for a batch as a whole: speculate only while the batch's rounds beat plain batched decoding.

Rows of a batch share every forward, so whether speculation pays is a property of the batch, not
of a row: a round's target forward is as wide as its longest proposal and the drafter steps while
any row drafts, so a row's schedule, which prices its own tokens as an even share
(`hf_polybasic.decoding.round.BatchShare`), cannot see what the batch pays. And plain batched decoding is a
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

The first proposing round also makes the drafter read every row's prompt (its prefill: on the 2-core
EPYC about 940 tokens through the 0.5B for 8 rows, 12 % of a call). So before that round the gate
prices it (`prefill_pays`): the drafter's prefill as the target's, timed in the batch's first
round, times the two models' cost ratio at their widest measured forward; then with the plain rounds
just timed and the curves scaled to them, that prefill plus the best the remaining budget could take
with proposals (at `UPFRONT_ACCEPTANCE`) must beat plain decoding of the rest; where it cannot, the
batch never proposes and the drafter is never prefilled.

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
        self.prefill_tokens: int | None = None  # what the drafter reads before its first proposal (`budget`)
        self.prefill_seconds: float | None = None  # the batch's first round: the target's prefill
        self.tokens_left: float | None = None  # new tokens a row may still generate
        self.proposed = False  # a round with proposals ran (the drafter holds the rows' prompts)

    def budget(self, prompt_tokens: int, new_tokens: int) -> None:
        """The tokens of every row's prompt (what the drafter prefills before its first proposal) and
        the new tokens a row may generate: the gate prices that prefill against what proposing could
        still save (`prefill_pays`)."""
        self.prefill_tokens, self.tokens_left = prompt_tokens, float(new_tokens)
    @property
    def paused(self) -> bool:
        return self.backoff.paused

    def observe_round(self, tokens: int, seconds: float, rows: int) -> None:
        """The batch's last round: its ``rows`` live rows emitted ``tokens`` tokens in ``seconds``."""
        self.rounds += 1
        if self.tokens_left is not None:
            self.tokens_left -= tokens / max(rows, 1)
        if rows != self.rows:  # a smaller batch from now on: this round was the larger one's
            self._rows_left(rows)
            return
        if self.rounds == 1:  # it holds the prompts' prefill
            self.prefill_seconds = seconds
            return
        if self.backoff.paused:
            self.plain_seconds = decayed(self.plain_seconds, seconds / max(rows, 1))
            self.plain_rounds = decayed(self.plain_rounds, 1.0)
            if self.backoff.sit_out() and not self.proposed and not self.prefill_pays():
                self.backoff.pause(MAX_BACKOFF_ROUNDS)  # proposing could not repay the drafter's prefill
            return
        self.proposed = True
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

    def prefill_pays(self) -> bool:
        """Whether the drafter's prefill of every row's prompt (the target's, timed in the first round,
        times the models' cost ratio) plus the rest of the budget decoded with the best proposals (at
        `UPFRONT_ACCEPTANCE`, priced on the curves scaled to the plain rounds just timed) beats
        decoding the rest plainly. True where it cannot be priced (no curves, no budget, no plain or
        prefill round timed yet)."""
        if None in (self.target_costs, self.step_costs, self.prefill_seconds, self.tokens_left) or not self.plain_rounds:
            return True
        rows = self.rows
        plain_round = self.plain_seconds / self.plain_rounds * rows
        scale = plain_round / max(_interpolated(self.target_costs, rows), 1e-12)  # the curves at today's speed
        left = max(self.tokens_left, 0.0)
        step = _interpolated(self.step_costs, rows)
        proposing = min(
            left / expected_tokens(UPFRONT_ACCEPTANCE, k) * (k * step + _interpolated(self.target_costs, rows * (k + 1)))
            for k in range(1, UPFRONT_LENGTHS + 1)
        )
        widest = max(self.step_costs.snapshot())  # the most compute-bound forward measured: a prefill's regime
        prefill = self.prefill_seconds * _interpolated(self.step_costs, widest) / _interpolated(self.target_costs, widest)
        return prefill + scale * proposing < left * plain_round

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
