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
"""

from __future__ import annotations

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


def _bin(confidence: float) -> int:
    return bisect_right(BIN_EDGES, confidence)


def _prior(index: int) -> float:
    low = BIN_EDGES[index - 1] if index > 0 else 0.0
    high = BIN_EDGES[index] if index < len(BIN_EDGES) else 1.0
    return (1 + (low + high) / 2) / 2


class ConfidenceCalibration:
    """Acceptance of drafts by the drafter's confidence, learned from verifications (see module)."""

    def __init__(self):
        bins = len(BIN_EDGES) + 1
        self._accepted = [[PRIOR_WEIGHT * _prior(i), PRIOR_WEIGHT] for i in range(bins)]
        self._next = [[PRIOR_WEIGHT * _prior(i), PRIOR_WEIGHT] for i in range(bins)]
        self.observations = 0  # drafts revealed to this object (not carried over)
        self.carried = 0.0  # drafts the tables carried from an earlier call hold beyond the prior

    @property
    def calibrated(self) -> bool:
        """Whether enough drafts were revealed (here or carried) for its curves to be the pair's own
        rather than the prior's: `CALIBRATED_OBSERVATIONS`."""
        return self.observations + self.carried >= CALIBRATED_OBSERVATIONS

    @staticmethod
    def _rate(table: list, confidence: float) -> float:
        successes, trials = table[_bin(confidence)]
        return successes / trials

    def acceptance(self, confidence: float) -> float:
        return self._rate(self._accepted, confidence)

    def next_acceptance(self, confidence: float) -> float:
        return self._rate(self._next, confidence)

    def drawn_acceptance(self, spread: Sequence[float]) -> tuple[float, float]:
        """For a draft not drawn yet, whose confidence falls in bin b with probability ``spread[b]``
        (the mass of its distribution in that bin: sampling draws an unsure token from a flat
        distribution as often as the mass says, not its top): P(it is accepted), and P(the draft
        after it is accepted | it was), each the bins' rates averaged over the draw."""
        total = sum(spread)
        if total <= 0:
            raise ValueError(f"a draw's spread over the confidence bins holds no mass: {list(spread)}")
        accepted = [successes / trials for successes, trials in self._accepted]
        after = [successes / trials for successes, trials in self._next]
        first = sum(mass * accepted[index] for index, mass in enumerate(spread))
        both = sum(mass * accepted[index] * after[index] for index, mass in enumerate(spread))
        return first / total, both / first

    def survival(self, confidences: Sequence[float]) -> float:
        """P(every draft of a round with these confidences is accepted)."""
        value = 1.0
        for confidence in confidences:
            value *= self.acceptance(confidence)
        return value

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A verification accepted the first ``accepted`` of drafts with these ``confidences``:
        tokens 0..accepted are revealed (the accepted ones, then the first rejected one)."""
        self.observations += len(confidences[: accepted + 1])
        for index, confidence in enumerate(confidences[: accepted + 1]):
            cell = self._accepted[_bin(confidence)]
            cell[0] += float(index < accepted)
            cell[1] += 1.0
        for index in range(min(accepted, len(confidences) - 1)):  # token index accepted, index + 1 revealed
            cell = self._next[_bin(confidences[index])]
            cell[0] += float(index + 1 < accepted)
            cell[1] += 1.0


class _Remembered:
    """The latest calibration of each (proposing model, verifying model) pair, weakly held (a drafter
    may propose to two levels: a middle one and, when that one sits out, the target)."""

    def __init__(self):
        self._tables = ModelMemory()  # (proposer, verifier) -> (accepted, next) tables

    def start(self, proposer, verifier, within: tuple = ()) -> ConfidenceCalibration:
        """A calibration for a new call: what the last call of this pair learned (capped), else the prior."""
        calibration = ConfidenceCalibration()
        tables = self._tables.get((proposer, verifier, *within))
        if tables is not None:
            for mine, theirs in zip((calibration._accepted, calibration._next), tables):
                for cell, (successes, trials) in zip(mine, theirs):
                    scale = min(1.0, CARRIED_WEIGHT / trials) if trials else 1.0
                    cell[0], cell[1] = successes * scale, trials * scale
            calibration.carried = sum(max(trials - PRIOR_WEIGHT, 0.0) for _, trials in calibration._accepted)
        return calibration

    def keep(self, proposer, verifier, calibration: ConfidenceCalibration, within: tuple = ()) -> None:
        """What ``calibration`` learned, for the pair's next call."""
        tables = ([list(cell) for cell in calibration._accepted], [list(cell) for cell in calibration._next])
        self._tables.put((proposer, verifier, *within), tables)


remembered = _Remembered()
