"""How often the level above accepts a drafted token, given the drafter's own confidence in it.

A drafter knows its probability of each token it drafts (its *confidence*); the level above
accepts confident drafts more often (for Qwen2.5-Coder 0.5B drafting for the 1.5B, greedy: about
0.47 at confidence 0.3, 0.78 at 0.7 and all of them above 0.9; docs: *Speed on your machine*).
`ConfidenceCalibration` learns two curves per call, by confidence bin, from what verifications
reveal (a draft's fate is known up to and including the first rejected token):

* `acceptance(c)`: P(a draft of confidence c is accepted | every draft before it was);
* `next_acceptance(c)`: P(the *next* draft is accepted | this one, of confidence c, was): the
  predictor of a token not drafted yet (confidence runs in streaks: after a confident token the
  next one is accepted more often, 0.93 against 0.65 after an unsure one in the same data).

Before evidence each bin holds `PRIOR_WEIGHT` pseudo-observations of (1 + c) / 2: drafts of a
model that shares the target's tokenizer tend to be accepted more often than their own
confidence says (the verifier only has to agree on the argmax). A call of a few dozen rounds learns
little past that prior, so what a call learned carries over to the next call of the same two models
(`remembered`, at most `CARRIED_WEIGHT` observations per bin): a drafter that is right more often
than it is sure (a small model's flat distributions, an early exit) is not cut short call after call.

Greedy and sampled calls learn apart (`sampled`): greedy, a draft is accepted where the verifier's
argmax agrees; sampled, with the verifier's probability of the drawn token over the drafter's, which
falls with the verifier's entropy on the text, so the same confidence is accepted less often on prose
than on code, and one answer's rates mislead the next. A sampled calibration therefore also follows
its call's text as a whole: both curves move down together by one `shift` on the logit scale, fitted
to this call's revealed drafts against the curves' rates (a penalised logistic fit, `SHIFT_PENALTY`),
so a text that agrees less than the carried rates moves every bin within a few rounds instead of one
bin at a time (Qwen2.5-Coder 0.5B for the 1.5B, sampled prose: 14 first drafts accepted where the
carried curves predicted 19). Only down: an optimistic curve drafts rounds that lose to plain
decoding, a pessimistic one only forgoes some of the gain, and its bins learn the rest as they fill.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Sequence

from .memory import ModelMemory

# confidence bins (upper edges); the last is [0.99, 1]
BIN_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)
PRIOR_WEIGHT = 2.0
# what a call learned weighs at most this many observations per bin at the start of the next call of
# the same pair of models (`remembered`): enough to start from, little enough to follow a new text
CARRIED_WEIGHT = 24.0
# drafts revealed (in this call or carried from the last one) before a calibration is trusted to end
# or extend a proposal: before that, where a proposal stops is the prior's choice, not the pair's
CALIBRATED_OBSERVATIONS = 6
# the penalty on a sampled call's `shift` (a Gaussian prior on it, in the units of the logistic fit's
# curvature: each revealed draft adds p (1 - p), about 0.2 near an acceptance of 0.7): 2.0 is about
# ten drafts' worth, so a handful of surprises cannot move the curves far
SHIFT_PENALTY = 2.0
# a bin's rate is kept this far off 0 and 1 before its logit is taken
RATE_BOUND = 1e-3


def _bin(confidence: float) -> int:
    return bisect_right(BIN_EDGES, confidence)


def _prior(index: int) -> float:
    low = BIN_EDGES[index - 1] if index > 0 else 0.0
    high = BIN_EDGES[index] if index < len(BIN_EDGES) else 1.0
    return (1 + (low + high) / 2) / 2


def _shifted(rate: float, shift: float) -> float:
    """``rate`` moved by ``shift`` on the logit scale."""
    if shift == 0.0:
        return rate
    rate = min(max(rate, RATE_BOUND), 1 - RATE_BOUND)
    return 1 / (1 + math.exp(-(math.log(rate / (1 - rate)) + shift)))


class ConfidenceCalibration:
    """Acceptance of drafts by the drafter's confidence, learned from verifications (see module).
    ``sampled``: the verifier accepts by speculative sampling (the curves then also follow the call's
    text, `shift`)."""

    def __init__(self, sampled: bool = False):
        bins = len(BIN_EDGES) + 1
        self.sampled = sampled
        self._accepted = [[PRIOR_WEIGHT * _prior(i), PRIOR_WEIGHT] for i in range(bins)]
        self._next = [[PRIOR_WEIGHT * _prior(i), PRIOR_WEIGHT] for i in range(bins)]
        self.observations = 0  # drafts revealed to this object (not carried over)
        self.carried = 0.0  # drafts the tables carried from an earlier call hold beyond the prior
        # this call's revealed drafts per cell of each table, [accepted, trials]; the curves' shift (<= 0)
        self._seen = ([[0.0, 0.0] for _ in range(bins)], [[0.0, 0.0] for _ in range(bins)])
        self.shift = 0.0

    @property
    def calibrated(self) -> bool:
        """Whether enough drafts were revealed (here or carried) for its curves to be the pair's own
        rather than the prior's: `CALIBRATED_OBSERVATIONS`."""
        return self.observations + self.carried >= CALIBRATED_OBSERVATIONS

    def _rate(self, cell: list) -> float:
        """A bin's rate, moved by the call's `shift`."""
        successes, trials = cell
        return _shifted(successes / trials, self.shift)

    def acceptance(self, confidence: float) -> float:
        return self._rate(self._accepted[_bin(confidence)])

    def next_acceptance(self, confidence: float) -> float:
        return self._rate(self._next[_bin(confidence)])

    def unshifted(self) -> ConfidenceCalibration:
        """These curves as the bins hold them, without this call's `shift` (a copy that shares the
        bins: read it, never `observe` into it)."""
        view = copy.copy(self)
        view.shift = 0.0
        return view

    def drawn_acceptance(self, spread: Sequence[float]) -> tuple[float, float]:
        """For a draft not drawn yet, whose confidence falls in bin b with probability ``spread[b]``
        (the mass of its distribution in that bin: sampling draws an unsure token from a flat
        distribution as often as the mass says, not its top): P(it is accepted), and P(the draft
        after it is accepted | it was), each the bins' rates averaged over the draw."""
        total = sum(spread)
        if total <= 0:
            raise ValueError(f"a draw's spread over the confidence bins holds no mass: {list(spread)}")
        accepted, after = [self._rate(cell) for cell in self._accepted], [self._rate(cell) for cell in self._next]
        first = sum(mass * accepted[index] for index, mass in enumerate(spread))
        both = sum(mass * accepted[index] * after[index] for index, mass in enumerate(spread))
        return first / total, both / first

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A verification accepted the first ``accepted`` of drafts with these ``confidences``:
        tokens 0..accepted are revealed (the accepted ones, then the first rejected one)."""
        self.observations += len(confidences[: accepted + 1])
        revealed = [(0, confidence, index < accepted) for index, confidence in enumerate(confidences[: accepted + 1])]
        revealed += [(1, confidences[index], index + 1 < accepted)  # token index accepted, index + 1 revealed
                     for index in range(min(accepted, len(confidences) - 1))]
        for table, confidence, kept in revealed:
            for cell in ((self._accepted, self._next)[table][_bin(confidence)], self._seen[table][_bin(confidence)]):
                cell[0] += float(kept)
                cell[1] += 1.0
        if self.sampled and revealed:
            self.shift = min(self._fitted_shift(), 0.0)

    def _fitted_shift(self) -> float:
        """The logit shift b that maximises this call's revealed drafts' likelihood under the bins' rates
        moved by b, less `SHIFT_PENALTY` b^2 / 2 (concave: Newton's method from the last fit)."""
        cells = [(math.log(rate / (1 - rate)), successes, trials)
                 for table, seen in zip((self._accepted, self._next), self._seen)
                 for (total, weight), (successes, trials) in zip(table, seen) if trials
                 for rate in [min(max(total / weight, RATE_BOUND), 1 - RATE_BOUND)]]
        shift = self.shift
        for _ in range(20):
            gradient, curvature = -SHIFT_PENALTY * shift, SHIFT_PENALTY
            for logit, successes, trials in cells:
                p = 1 / (1 + math.exp(-(logit + shift)))
                gradient += successes - trials * p
                curvature += trials * p * (1 - p)
            step = gradient / curvature
            shift += step
            if abs(step) < 1e-9:
                break
        return shift


class _Remembered:
    """The latest calibration of each (proposing model, verifying model) pair and mode (greedy or
    sampled), weakly held (a drafter may propose to two levels: a middle one and, when that one sits
    out, the target)."""

    def __init__(self):
        self._tables = ModelMemory()  # (proposer, verifier, *within) -> {sampled: (accepted, next) tables}

    def start(self, proposer, verifier, within: tuple = (), sampled: bool = False) -> ConfidenceCalibration:
        """A calibration for a new call: what the last call of this pair in this mode learned (capped),
        else the prior."""
        calibration = ConfidenceCalibration(sampled)
        tables = (self._tables.get((proposer, verifier, *within)) or {}).get(sampled)
        if tables is not None:
            for mine, theirs in zip((calibration._accepted, calibration._next), tables):
                for cell, (successes, trials) in zip(mine, theirs):
                    scale = min(1.0, CARRIED_WEIGHT / trials) if trials else 1.0
                    cell[0], cell[1] = successes * scale, trials * scale
            calibration.carried = sum(max(trials - PRIOR_WEIGHT, 0.0) for _, trials in calibration._accepted)
        return calibration

    def keep(self, proposer, verifier, calibration: ConfidenceCalibration, within: tuple = ()) -> None:
        """What ``calibration`` learned, for the pair's next call in its mode (the other mode's is kept)."""
        key = (proposer, verifier, *within)
        modes = dict(self._tables.get(key) or {})
        modes[calibration.sampled] = ([list(cell) for cell in calibration._accepted],
                                      [list(cell) for cell in calibration._next])
        self._tables.put(key, modes)


remembered = _Remembered()
