"""Which shape of the chain pays: a middle level takes part only while Theorem 3.2 says it does.

A chain target > middle > drafter pays over target > drafter only when the middle level agrees with
the target closely and costs little for what it adds (Theorem 3.2); whether it does depends on the
machine (each model's T(k)) and on the text (acceptance), so it is measured during the call. A
`ShapeGate` belongs to the intermediate level right above a model drafter:

* the call starts with the level **in**, for `IN_ROUNDS` verifications of the level above;
* then the drafter proposes straight to the level above for `OUT_ROUNDS` rounds: the level is
  **bypassed** (its model neither verifies nor runs; its cache catches up when it is back);
* with both shapes measured (acceptance lengths L_i of the level above verifying the drafter,
  L_{i-new} verifying the middle level's blocks, L_new of the middle level verifying the drafter,
  the blocks each verifies, the drafter's forwards per verification) Theorem 3.2 with the measured
  T(k) of the models (`theory.insertion_test_with_curves`) decides the shape of the next stretch
  of rounds, after which the other shape is probed for `PROBE_ROUNDS` and the theorem asked again;
  a stretch doubles (up to `MAX_STRETCH`) while the verdict holds.

The measurements are decayed sums (recent rounds weigh more: the text changes within a call), and
they outlive the call: a later call of the same three models (`remembered`) starts from them, in the
shape of the last verdict, and probes the other after a first stretch, so the measuring rounds of
short calls are paid once, not at every call. Lossless: the level above verifies whatever it is handed, and a bypassed round is two-level
speculative decoding with the same drafter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from .memory import ModelMemory
from .rates import decayed

# verifications of the level above with the middle level in before the first probe without it, the
# rounds of that probe, of later probes, and the stretches a verdict holds
IN_ROUNDS = 4
OUT_ROUNDS = 3
PROBE_ROUNDS = 2
FIRST_STRETCH = 12
MAX_STRETCH = 96


@dataclass
class ShapeSums:
    """Decayed sums of one shape's rounds (each a verification of the level above)."""

    rounds: float = 0.0
    emitted: float = 0.0  # tokens the level above emitted (accepted + its own)
    drafted: float = 0.0  # tokens it verified
    middle_verifications: float = 0.0
    middle_emitted: float = 0.0
    middle_drafted: float = 0.0
    drafter_forwards: float = 0.0

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
    """Whether a middle level is bypassed this round (see the module docstring).

    Args:
        costs: ``(above, middle, drafter)``, each ``seconds(k)`` for a forward scoring k tokens (the
            call's cost estimates, `hf_polybasic.costs.CostEstimate`).

    Attributes:
        bypassed_rounds: rounds the level sat out.
        verdict: the latest `theory.CurveInsertionVerdict` (None before the first).
        decisions: how many times the theorem was asked.
    """

    def __init__(self, costs: tuple[Callable[[float], float], Callable[[float], float], Callable[[float], float]],
                 models: tuple | None = None):
        self.costs, self.models = costs, models
        self.inside, self.outside = ShapeSums(), ShapeSums()
        self.bypassed = False
        self._left = IN_ROUNDS  # rounds of the current phase still to go
        self._probing = True  # the current phase measures a shape before a verdict
        self._stretch = FIRST_STRETCH
        self._previous: bool | None = None  # the verdict before the latest
        known = None if models is None else remembered.get(models)
        if known is not None:  # a later call of the same chain: the last verdict's shape, for a first stretch
            self.inside, self.outside = copy.copy(known["inside"]), copy.copy(known["outside"])
            self._previous = known["pays"]
            self.bypassed, self._left, self._probing = not known["pays"], FIRST_STRETCH, False
        self.bypassed_rounds = 0
        self.verdict = None
        self.decisions = 0

    def observe(self, rows: int, emitted: int, drafted: int, drafter_forwards: int,
                middle: tuple[int, int, int] = (0, 0, 0)) -> None:
        """One verification by the level above in the current shape, of ``rows`` rows: the tokens it
        emitted and verified, the drafter's forwards for it, and (in) the middle level's
        verifications, emitted and verified tokens for it. Moves to the next phase when this one is over."""
        if self.bypassed:
            self.outside.add(rows, emitted, drafted, drafter_forwards)
            self.bypassed_rounds += 1
        elif middle[0] > 0:  # rounds where the middle level proposed nothing tell nothing about it
            self.inside.add(rows, emitted, drafted, drafter_forwards, middle)
        self._left -= 1
        if self._left > 0:
            return
        if not self._probing:  # a stretch is over: probe the other shape
            self.bypassed, self._left, self._probing = not self.bypassed, PROBE_ROUNDS, True
            return
        if self.outside.rounds == 0 and not self.bypassed:  # the first phase is over: measure without it
            self.bypassed, self._left = True, OUT_ROUNDS
            return
        pays = self.middle_pays()
        self._stretch = min(2 * self._stretch, MAX_STRETCH) if pays == self._previous else FIRST_STRETCH
        self._previous = pays
        if self.models is not None:
            remembered.put(self.models, {"inside": copy.copy(self.inside), "outside": copy.copy(self.outside),
                                         "pays": pays})
        self.bypassed, self._left, self._probing = not pays, self._stretch, False

    def middle_pays(self) -> bool:
        """Theorem 3.2 with the measured T(k): does the middle level shorten the time per token? No
        when it never proposed (no evidence that it pays); yes when the bypassed shape was never
        measured."""
        self.decisions += 1
        inside, outside = self.inside, self.outside
        if inside.rounds == 0 or inside.middle_verifications == 0:
            return False
        if outside.rounds == 0:
            return True
        from ..planning.theory import insertion_test_with_curves  # (the planning package imports the chain)

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

    def describe(self) -> str:
        """The latest verdict in words, for the statistics and the warning."""
        v = self.verdict
        if v is None:
            return "it never proposed a block, so nothing showed that it pays"
        return (f"Theorem 3.2 with the measured T(k): running it costs {1e3 * v.new_cost_per_token:.3g} ms per token "
                f"and saves {1e3 * (v.upper_saving_per_token + v.lower_saving_per_token):.3g} ms per token above and "
                f"below it")
