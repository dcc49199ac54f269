"""Which shape of the chain pays: a middle level takes part only while Theorem 3.2 says it does,
and the drafter below it only while the middle level drafting alone is not faster.

A chain target > middle > drafter pays over target > drafter only when the middle level agrees with
the target closely and costs little for what it adds (Theorem 3.2); whether it does depends on the
machine (each model's T(k)) and on the text (acceptance), so it is measured during the call. A
`ShapeGate` belongs to the intermediate level right above a model drafter:

* the call starts with the level **in**, for `IN_ROUNDS` verifications of the level above;
* then the drafter proposes straight to the level above for `OUT_ROUNDS` rounds: the level is
  **bypassed** (its model neither verifies nor runs; its cache catches up when it is back);
* where the chain allows it (``drops``), the middle level's model then drafts on its own, token by
  token, straight to the level above for `OUT_ROUNDS` rounds: the drafter is **dropped** (it neither
  drafts nor runs; its cache catches up when it is back), which is two-model speculative decoding
  with the middle model as the drafter;
* with the shapes measured (acceptance lengths L_i of the level above verifying the drafter,
  L_{i-new} verifying the middle level's blocks, L_new of the middle level verifying the drafter,
  the blocks each verifies, the drafter's forwards per verification) Theorem 3.2 with the measured
  T(k) of the models (`theory.insertion_test_with_curves`) decides the shape of the next stretch
  of rounds between those two; the dropped shape replaces the theorem's pick when Lemma 3.1, with the
  same T(k) and each shape's own counts read as L_i = N / F_i (tokens emitted per forward of each
  model, `theory.polybasic_time_per_token_with_curves`), gives it fewer seconds per token. After a
  stretch the shape measured longest ago is probed for `PROBE_ROUNDS` and the verdict taken again;
  a stretch doubles (up to `MAX_STRETCH`) while the verdict holds.

The bypassed shape is neither measured nor probed while the in rounds rule it out (`ruled_out`): the
level above accepts the drafter's drafts at most as often as the middle level does plus the rate at
which it rejects the middle level's own (the triangle inequality), and at that acceptance, with the
drafter's best length and no catch-up, it would still be `FAR_BEHIND` the fastest measured shape.

A round in which a proposal was ended (or drafted on) by a schedule whose confidence calibration had
too little evidence (`calibration.ConfidenceCalibration.calibrated`: the prior's stop, not the
pair's) is left out of the sums, and a measuring phase runs up to `EXTRA_ROUNDS` rounds longer to
make up for such rounds (unless they already put its shape `FAR_BEHIND` another): a verdict rests on
the shapes as their calibrated schedules run them (a shape that has no calibrated round is judged on
the rounds it ran, `evidence`, rather than on none).

The measurements are decayed sums (recent rounds weigh more: the text changes within a call), and
they outlive the call: a later call of the same three models (`remembered`) starts from them, in the
shape of the last verdict, and probes the others after a first stretch; a call that ended before the
first verdict leaves its measuring phase to the next call (`ShapeGate.keep`), so calls shorter than
the first measurements share one measuring, paid once, not at every call. Lossless: the level above
verifies whatever it is handed; a bypassed round is two-level speculative decoding with the same
drafter, a dropped one with the middle model drafting (each reporting the distribution its drafts
were drawn from).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from ..config import MAX_DRAFT_TOKENS
from ..theory import insertion_test_with_curves, polybasic_time_per_token_with_curves
from .memory import ModelMemory
from .rates import decayed, expected_tokens

# verifications of the level above with the middle level in before the first probe without it, the
# rounds of the first measurement of each other shape, of later probes, and the stretches a verdict holds
IN_ROUNDS = 4
OUT_ROUNDS = 3
PROBE_ROUNDS = 2
FIRST_STRETCH = 12
MAX_STRETCH = 96
# rounds a measuring phase may add for rounds left out (a proposal cut by an uncalibrated stop),
# unless even those rounds put its shape this many times behind the best measured one (calibrated
# rounds would not make it win: measuring it longer only costs); and the bypassed shape is not
# measured at all where even its best is this far behind (`ShapeGate.ruled_out`)
EXTRA_ROUNDS = 6
FAR_BEHIND = 1.5
# where Theorem 3.2 picks the drafter proposing straight to the level above, the drafter is dropped
# only where the middle level alone saves this share of that shape's seconds per token (and taken
# back only where that shape saves as much): the few rounds a probe measures of a sloppy drafter swing
# its estimate by a fifth (three rounds without an accepted draft are a coin toss at a quarter's
# first-token acceptance), and where the shapes are that close the user's drafter goes first. Against
# the middle level in, whose blocks the level above judges as it would the middle level's drafts, the
# fewer seconds per token decide
DROP_MARGIN = 0.25

# bisection steps of `_acceptance` (its error: 2^-steps)
ACCEPTANCE_STEPS = 30

# the shapes: the middle level in; bypassed (the drafter proposes to the level above); the drafter
# dropped (the middle level drafts on its own to the level above)
IN, BYPASSED, DROPPED = "in", "bypassed", "dropped"


@dataclass
class ShapeSums:
    """Decayed sums of one shape's rounds (each a verification of the level above)."""

    rounds: float = 0.0
    emitted: float = 0.0  # tokens the level above emitted (accepted + its own)
    drafted: float = 0.0  # tokens it verified
    middle_verifications: float = 0.0
    middle_emitted: float = 0.0
    middle_drafted: float = 0.0
    drafter_forwards: float = 0.0  # forwards of the model that drafted (the middle one, dropped)

    def add(self, rows: int, emitted: int, drafted: int, drafter_forwards: int,
            middle: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.rounds = decayed(self.rounds, rows)
        self.emitted = decayed(self.emitted, emitted)
        self.drafted = decayed(self.drafted, drafted)
        self.drafter_forwards = decayed(self.drafter_forwards, drafter_forwards)
        verifications, middle_emitted, middle_drafted = middle
        self.middle_verifications = decayed(self.middle_verifications, verifications)
        self.middle_emitted = decayed(self.middle_emitted, middle_emitted)
        self.middle_drafted = decayed(self.middle_drafted, middle_drafted)


def _acceptance(length: float, block: float) -> float:
    """The per-token acceptance a at which a verification of ``block`` > 0 drafts emits ``length``
    tokens on average, 1 + a + ... + a^block (a truncated geometric variable, read at a real block)."""
    if length >= block + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(ACCEPTANCE_STEPS):
        rate = (low + high) / 2
        if (1 - rate ** (block + 1)) / (1 - rate) < length:
            low = rate
        else:
            high = rate
    return high


class _Memory:
    """What a gate learned, by its three models (weakly held), for the next call of the same chain."""

    def __init__(self):
        self._states = ModelMemory()  # (middle, above, below) -> state

    def get(self, models: tuple) -> dict | None:
        above, middle, below = models
        return self._states.get((middle, above, below))

    def put(self, models: tuple, state: dict) -> None:
        above, middle, below = models
        self._states.put((middle, above, below), state)


remembered = _Memory()


class ShapeGate:
    """The shape of the chain around a middle level this round (see the module docstring).

    Args:
        costs: ``(above, middle, drafter)``, each ``seconds(k)`` for a forward scoring k tokens (the
            call's cost estimates, `hf_polybasic.costs.CostEstimate`).
        models: ``(above, middle, drafter)``, the key of what the gate learned for later calls.
        drops: the chain can drop the drafter (the middle level drafts on its own): three shapes.

    Attributes:
        shape: `IN`, `BYPASSED` or `DROPPED`, this round's.
        bypassed_rounds: rounds the middle level sat out; dropped_rounds: rounds the drafter did.
        probe_rounds: per shape, its rounds while the gate measured it (not run on a verdict).
        verdict: the latest `theory.CurveInsertionVerdict` (None before the first).
        times: per measured shape, Lemma 3.1's seconds per token at the latest verdict.
        decisions: how many times the theorem was asked.
    """

    def __init__(self, costs: tuple[Callable[[float], float], Callable[[float], float], Callable[[float], float]],
                 models: tuple | None = None, drops: bool = False):
        self.costs, self.models = costs, models
        self.shapes = (IN, BYPASSED, DROPPED) if drops else (IN, BYPASSED)
        self.sums = {shape: ShapeSums() for shape in self.shapes}
        self.uncalibrated = {shape: ShapeSums() for shape in self.shapes}  # rounds left out, for `evidence`
        self.shape = IN
        self._left = IN_ROUNDS  # rounds of the current phase still to go
        self._probing = True  # the current phase measures a shape before a verdict
        self._extended = 0  # rounds the current phase added for rounds left out
        self._stretch = FIRST_STRETCH
        self._previous: str | None = None  # the verdict before the latest
        self._visited = {IN}  # shapes measured in this call
        self._last = dict.fromkeys(self.shapes, -1)  # the round each shape last ran in
        self._round = 0
        known = None if models is None else remembered.get(models)
        phase = None if known is None else known.get("measuring", known.get("shape"))
        if phase in self.shapes:  # a later call of the same three models (`_remember`)
            for name in ("sums", "uncalibrated"):
                getattr(self, name).update({s: copy.copy(sums) for s, sums in known[name].items() if s in self.shapes})
            self._round = known["round"]
            self._last.update({s: last for s, last in known["last"].items() if s in self._last})
            if "measuring" in known:  # its calls so far ended before the first verdict: go on measuring
                self.shape, self._left, self._extended = phase, known["left"], known["extended"]
                self._visited = {s for s in known["visited"] if s in self.shapes}
            else:  # the last verdict's shape, for a first stretch
                self._previous = phase
                self.shape, self._left, self._probing = phase, FIRST_STRETCH, False
                self._visited = {s for s in self.shapes if self.sums[s].rounds > 0} | {phase}
        self.bypassed_rounds = self.dropped_rounds = 0
        self.probe_rounds = dict.fromkeys(self.shapes, 0)
        self.verdict = None
        self.times: dict[str, float] = {}
        self.decisions = 0

    # the two shapes of today's gate by their old names (a middle level in or bypassed)
    @property
    def bypassed(self) -> bool:
        return self.shape == BYPASSED

    @property
    def dropped(self) -> bool:
        """Whether the drafter is dropped this round (the middle level drafts on its own)."""
        return self.shape == DROPPED

    def observe(self, rows: int, emitted: int, drafted: int, drafter_forwards: int,
                middle: tuple[int, int, int] = (0, 0, 0), uncalibrated: bool = False) -> None:
        """One verification by the level above in the current shape, of ``rows`` rows: the tokens it
        emitted and verified, the forwards of the model that drafted for it (the drafter; dropped: the
        middle one), (in) the middle level's verifications, emitted and verified tokens for it, and
        whether a schedule whose calibration had too little evidence set where a proposal of the
        round ended (then the round is not counted). Moves to the next phase when this one is over."""
        self._round += 1
        self._last[self.shape] = self._round
        if self.shape == BYPASSED:
            self.bypassed_rounds += 1
        elif self.shape == DROPPED:
            self.dropped_rounds += 1
        if self._probing:
            self.probe_rounds[self.shape] += 1
        # rounds where the middle level proposed nothing tell nothing about it (in)
        counted = self.shape != IN or middle[0] > 0
        if counted and not uncalibrated:
            self.sums[self.shape].add(rows, emitted, drafted, drafter_forwards,
                                      middle if self.shape == IN else (0, 0, 0))
        elif counted:
            self.uncalibrated[self.shape].add(rows, emitted, drafted, drafter_forwards,
                                              middle if self.shape == IN else (0, 0, 0))
            if self._probing and self._extended < EXTRA_ROUNDS and not self._far_behind():
                self._extended += 1  # a measuring phase makes up for the round it could not count
                return
        self._left -= 1
        if self._left > 0:
            return
        self._extended = 0
        if not self._probing:  # a stretch is over: probe the shape measured longest ago
            stalest = self._stalest()
            if stalest is not None:
                self._enter(stalest, PROBE_ROUNDS, probing=True)
                return
        else:
            unmeasured = [shape for shape in self.shapes if shape not in self._visited and not self.ruled_out(shape)]
            if unmeasured:  # the first measurements: each shape once
                self._enter(unmeasured[0], OUT_ROUNDS, probing=True)
                return
        shape = self.decide()
        self._stretch = min(2 * self._stretch, MAX_STRETCH) if shape == self._previous else FIRST_STRETCH
        self._previous = shape
        self._remember(shape=shape)
        self._enter(shape, self._stretch, probing=False)

    def keep(self) -> None:
        """At the end of a call that ended before the gate's first verdict (none this call, none
        remembered): remember how far its first measurements got, so that the next call of the same
        chain goes on from there instead of measuring every shape again (a call shorter than the
        measuring would otherwise never reach a verdict). After a verdict, what `observe` remembered
        at it stands."""
        if self._previous is None:
            self._remember(measuring=self.shape, left=self._left, extended=self._extended, visited=sorted(self._visited))

    def _remember(self, **phase) -> None:
        """Keep the measurements, when each shape last ran, and ``phase`` (the verdict's ``shape``, or
        where the first measuring got to) for a later call of the same three models."""
        if self.models is not None:
            remembered.put(self.models, {"sums": {s: copy.copy(sums) for s, sums in self.sums.items()},
                                         "uncalibrated": {s: copy.copy(sums) for s, sums in self.uncalibrated.items()},
                                         "round": self._round, "last": dict(self._last), **phase})

    def evidence(self, shape: str) -> ShapeSums:
        """A shape's sums for a verdict: its calibrated rounds, or where it has none, the rounds left
        out (a shape is never judged on no rounds when it ran)."""
        sums = self.sums[shape]
        return sums if sums.rounds > 0 else self.uncalibrated[shape]

    def _enter(self, shape: str, rounds: int, probing: bool) -> None:
        self.shape, self._left, self._probing = shape, rounds, probing
        self._visited.add(shape)

    def _far_behind(self) -> bool:
        """Whether this shape's rounds so far (counted or not) put it `FAR_BEHIND` the best other shape."""
        mine = self.seconds_per_token(self.shape)
        others = [t for shape in self.shapes
                  if shape != self.shape and (t := self.seconds_per_token(shape)) is not None]
        return mine is not None and bool(others) and mine > FAR_BEHIND * min(others)

    def _stalest(self) -> str | None:
        """The shape other than this one that ran longest ago (never measured first), of those not
        `ruled_out`; None when every other is."""
        others = [shape for shape in self.shapes if shape != self.shape and not self.ruled_out(shape)]
        return min(others, key=lambda shape: (self.sums[shape].rounds > 0, self._last[shape]), default=None)

    def ruled_out(self, shape: str) -> bool:
        """Whether a probe of ``shape`` cannot pay: it is the bypassed shape, and even at its best
        (`bypassed_at_best`) it is `FAR_BEHIND` the fastest measured shape."""
        if shape != BYPASSED:
            return False
        best = self.bypassed_at_best()
        others = [t for other in self.shapes
                  if other != BYPASSED and (t := self.seconds_per_token(other)) is not None]
        return best is not None and bool(others) and best > FAR_BEHIND * min(others)

    def bypassed_at_best(self) -> float | None:
        """The bypassed shape's seconds per token at its best, from the in shape's rounds (None before
        any drafts of both): at the most acceptance of the drafter's drafts by the level above they
        allow, at the drafter's best length (0: the level above decoding alone), each draft one
        forward T(1), no catch-up. Per position that acceptance is at most the middle level's of them
        plus the rate at which the level above rejects the middle level's own (acceptance is 1 - TV,
        and TV obeys the triangle inequality; greedy: a draft the level above takes and the middle
        level does not marks a token of the middle level the level above rejects); each rate is read
        from mean lengths and blocks as a truncated geometric variable's (`_acceptance`)."""
        inside = self.evidence(IN)
        if inside.drafted == 0 or inside.middle_drafted == 0:
            return None
        drafter_rate = _acceptance(inside.middle_emitted / inside.middle_verifications,
                                   inside.middle_drafted / inside.middle_verifications)
        middle_rate = _acceptance(inside.emitted / inside.rounds, inside.drafted / inside.rounds)
        rate = min(1.0, drafter_rate + 1 - middle_rate)
        above, _, drafter = self.costs
        return min((length * drafter(1) + above(length + 1)) / expected_tokens(rate, length)
                   for length in range(MAX_DRAFT_TOKENS + 1))

    def decide(self) -> str:
        """The shape of the next stretch: in or bypassed by Theorem 3.2 (`middle_pays`), then the
        dropped shape instead where Lemma 3.1 gives it fewer seconds per token (`seconds_per_token`;
        against the bypassed shape, by `DROP_MARGIN` both ways)."""
        shape = IN if self.middle_pays() else BYPASSED
        self.times = {s: t for s in self.shapes if (t := self.seconds_per_token(s)) is not None}
        if DROPPED in self.times:
            alone, chained = self.times[DROPPED], self.times.get(shape, float("inf"))
            # against the drafter proposing straight to the level above (its few probe rounds are noisy),
            # the shape of the last verdict stays unless the other saves DROP_MARGIN
            margin = DROP_MARGIN if shape == BYPASSED else 0.0
            if (alone < (1 - margin) * chained if self._previous != DROPPED
                    else not chained < (1 - margin) * alone):
                shape = DROPPED
        return shape

    def seconds_per_token(self, shape: str) -> float | None:
        """Lemma 3.1 with the measured T(k) on a shape's decayed sums, each L_i read as N / F_i
        (tokens the level above emitted per forward of each model: exact when the curves are); None
        when the shape was not measured."""
        sums = self.evidence(shape)
        above, middle, drafter = self.costs
        if sums.rounds == 0 or sums.emitted == 0:
            return None
        if shape == IN:
            if sums.middle_verifications == 0:
                return None
            return polybasic_time_per_token_with_curves(
                (above, middle, drafter), (sums.emitted / sums.rounds, sums.emitted / sums.middle_verifications),
                (sums.drafted / sums.rounds, sums.middle_drafted / sums.middle_verifications),
                sums.drafter_forwards / sums.middle_verifications)
        below = drafter if shape == BYPASSED else middle
        return polybasic_time_per_token_with_curves(
            (above, below), (sums.emitted / sums.rounds,), (sums.drafted / sums.rounds,),
            sums.drafter_forwards / sums.rounds)

    def middle_pays(self) -> bool:
        """Theorem 3.2 with the measured T(k): does the middle level shorten the time per token? No
        when it never proposed (no evidence that it pays); yes when the bypassed shape was never
        measured."""
        self.decisions += 1
        inside, outside = self.evidence(IN), self.evidence(BYPASSED)
        if inside.rounds == 0 or inside.middle_verifications == 0:
            return False
        if outside.rounds == 0:
            return True
        above, middle, drafter = self.costs
        verifications_in = inside.middle_verifications
        beta = (inside.drafter_forwards + outside.drafter_forwards) / (verifications_in + outside.rounds)
        self.verdict = insertion_test_with_curves(
            t_i=above, t_new=middle, t_next=drafter,
            l_i=outside.emitted / outside.rounds, l_i_new=inside.emitted / inside.rounds,
            l_new=inside.middle_emitted / verifications_in, beta=beta,
            block_i=outside.drafted / outside.rounds, block_i_new=inside.drafted / inside.rounds,
            block_new=inside.middle_drafted / verifications_in,
        )
        return self.verdict.helps

    def describe_drop(self) -> str:
        """Why the drafter sat out, in words, for the statistics and the warning."""
        alone = self.times.get(DROPPED)
        with_it = {shape: self.times[shape] for shape in (IN, BYPASSED) if shape in self.times}
        if alone is None or not with_it:
            return "the middle level drafted on its own"
        best = min(with_it, key=with_it.get)
        chain = "through the middle level" if best == IN else "straight to the level above"
        return (f"Lemma 3.1 with the measured T(k): the middle level drafting on its own costs {1e3 * alone:.3g} "
                f"ms per token, the drafter proposing {chain} {1e3 * with_it[best]:.3g} ms")

    def describe(self) -> str:
        """The latest verdict in words, for the statistics and the warning."""
        v = self.verdict
        if v is None:
            return "it never proposed a block, so nothing showed that it pays"
        return (f"Theorem 3.2 with the measured T(k): running it costs {1e3 * v.new_cost_per_token:.3g} ms per token "
                f"and saves {1e3 * (v.upper_saving_per_token + v.lower_saving_per_token):.3g} ms per token above and "
                f"below it")
