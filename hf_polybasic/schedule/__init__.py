"""How many tokens a level proposes per round: K for the bottom drafter, mu for an intermediate.

A schedule belongs to a proposing level (the child). The child asks `length` before each round
(0: propose nothing, the parent decodes alone) and, if it drafts token by token
(`stops_per_token`), `keep_drafting` after each token; it reports what its proposal cost
(`observe_proposal`) and, through `Level.verified`, what the parent made of it
(`observe_verification`). One class per policy, built by `make_schedule` (each row's, for a
whole chain: `RowSchedules`, in `factory`):

* ``"constant"`` (`ConstantSchedule`): always the configured length (the paper's static K and mu);
* ``"heuristic"`` (`HeuristicSchedule`): transformers' rule, +2 after a proposal accepted whole,
  -1 otherwise;
* ``"cost_aware"`` (`CostAwareSchedule`, the default): a model level proposes as long as its
  confidence and the machine's measured costs say one more token pays, a `Drafter` as many tokens
  as its acceptance pays for, and a level backs off to plain decoding where proposing cannot pay
  (see `hf_polybasic.schedule.cost_aware`).

The pure math (expected tokens, the best length, the acceptance estimate) is in `rates`, the
confidence-to-acceptance curves in `calibration`, the pause / probe states in `backoff`, and the
back-off of a batch as a whole (its rows share every forward, so whether proposing pays is decided
for all of them, by the clock) in `batch_gate`, and whether a middle level takes part at all (Theorem
3.2 on measured costs and acceptance), or the drafter below it (Lemma 3.1), in `shape_gate`.

Why every schedule is lossless: the length is chosen from the past only (acceptance counts,
timings, the tokens already drafted, which are all kept, and whether a round proposes at all, which
is decided from the drafter's distribution at its first position, not from the token drawn from it),
never by a sampled token's value (argmax drafts, a function of the text so far, may be withheld once
drafting stops: `proposal_size`), and verification of each proposed token is exact whatever the
length (a length of 0 is plain decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..config import SCHEDULES
from .backoff import FIRST_BACKOFF_ROUNDS, MAX_BACKOFF_ROUNDS, PROBE_ROUNDS, BackOff
from .batch_gate import BatchGate
from .calibration import ConfidenceCalibration
from .cost_aware import RESET_MARGIN, SAFETY_MARGIN, SAFETY_ROUNDS, WARMUP_ROUNDS, CostAwareSchedule
from .factory import RowSchedules, make_schedule
from .fixed import ConstantSchedule, HeuristicSchedule
from .rates import DECAY, acceptance_rate_estimate, best_length, expected_tokens, worth_more, worth_one_more
from .shape_gate import ShapeGate


class Schedule(Protocol):
    """What a proposing level asks of its schedule (see the module docstring)."""

    stops_per_token: bool
    paused_rounds: int
    uncalibrated_answers: int  # `keep_drafting` answers given before its calibration had evidence

    def length(self) -> int: ...

    def fixed_length(self) -> int:
        """`length` where the level cannot stop its proposal token by token (drafting on the device)."""
        ...

    def keep_drafting(self, confidence: float) -> bool: ...

    def closed_at(self, confidence: float) -> None:
        """The round's last draft, of this confidence, filled its block (no `keep_drafting` to ask)."""
        ...

    def first_draft_pays(self, top: float | Sequence[float]) -> bool:
        """Whether a round that stops by confidence proposes at all, from its first position's
        distribution (not the drawn token): greedy, its largest probability; sampling, its mass in
        each confidence bin (`calibration.BIN_EDGES`)."""
        ...

    def next_draft_pays(self, spread: Sequence[float]) -> bool:
        """Whether a sampled round that has kept drafts proposes the one at its next position, from that
        position's mass in each confidence bin (not the drawn token)."""
        ...

    def proposal_size(self, drafted: int) -> int:
        """How many of a round's ``drafted`` argmax drafts to propose, once drafting has stopped."""
        ...

    def observe_proposal(self, num_tokens: int, seconds: float) -> None: ...

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None: ...


__all__ = [
    "DECAY",
    "FIRST_BACKOFF_ROUNDS",
    "MAX_BACKOFF_ROUNDS",
    "PROBE_ROUNDS",
    "RESET_MARGIN",
    "SAFETY_MARGIN",
    "SAFETY_ROUNDS",
    "SCHEDULES",
    "WARMUP_ROUNDS",
    "BackOff",
    "BatchGate",
    "ConfidenceCalibration",
    "ConstantSchedule",
    "CostAwareSchedule",
    "HeuristicSchedule",
    "RowSchedules",
    "Schedule",
    "ShapeGate",
    "acceptance_rate_estimate",
    "best_length",
    "expected_tokens",
    "make_schedule",
    "worth_more",
    "worth_one_more",
]
