"""Making schedules: one level's (`make_schedule`), and each row's for the levels of one call's chain
(`RowSchedules`, what `hf_polybasic.decoding.build.build_chain` asks for)."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import SCHEDULES
from . import calibration as calibrations
from .batch_gate import BatchGate
from .calibration import ConfidenceCalibration
from .cost_aware import CostAwareSchedule
from .fixed import ConstantSchedule, HeuristicSchedule


def make_schedule(
    kind: str, initial: int, maximum: int, per_token: bool = False, verifier_costs=None,
    step_seconds: float | None = None, static_check: bool = True, gate: BatchGate | None = None,
    calibration: ConfidenceCalibration | None = None,
) -> ConstantSchedule | HeuristicSchedule | CostAwareSchedule:
    """The schedule of one level: ``kind`` is one of `SCHEDULES`; ``initial`` the configured K or
    mu, ``maximum`` the longest proposal a varying schedule makes; ``per_token``: the level proposes
    token by token with confidences (a model level). ``verifier_costs`` / ``step_seconds`` /
    ``static_check`` / ``gate`` / ``calibration``: see `CostAwareSchedule`."""
    if kind == "constant":
        return ConstantSchedule(initial)
    if kind == "heuristic":
        return HeuristicSchedule(initial, maximum)
    if kind == "cost_aware":
        return CostAwareSchedule(initial, maximum, per_token, verifier_costs, step_seconds, static_check, gate,
                                 calibration)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")


class RowSchedules:
    """Makes ``{row: Schedule}`` for the levels of one call's chain: every row of the call gets its own
    schedule of the call's ``kind`` (one of `hf_polybasic.config.SCHEDULES`); the level right under
    the target shares the batch's ``gate``. Under the cost-aware schedule a model level's rows start
    their confidence calibration from what the last call of the same two models learned
    (`calibration.remembered`), and `keep_learned` keeps what this call's rows learned for the next."""

    def __init__(self, kind: str, rows: Sequence[int], gate: BatchGate | None = None):
        self.kind, self.rows, self.gate = kind, list(rows), gate
        self._learned: list[tuple] = []  # (proposing model, verifying model, within, its rows' schedules)

    def for_level(self, initial: int, maximum: int, verifier_costs, under_target: bool, per_token: bool = True,
                  step_seconds: float | None = None, static_check: bool = True, pair: tuple | None = None,
                  within: tuple = (), sampled: bool = False) -> dict:
        """Each row's schedule of one level (see `make_schedule` for ``initial``, ``maximum``,
        ``per_token``, ``verifier_costs``, ``step_seconds``, ``static_check``). ``pair``: the
        (proposing, verifying) models whose calibration carries over between calls, and ``within``
        the models that key it further; None for a `Drafter`, which has none. ``sampled``: the
        verifying level accepts by speculative sampling (its calibration is learned and kept apart
        from greedy calls', `ConfidenceCalibration`)."""
        calibrated = pair is not None and self.kind == "cost_aware"
        made = {
            row: make_schedule(self.kind, initial, maximum, per_token=per_token, verifier_costs=verifier_costs,
                               step_seconds=step_seconds, static_check=static_check,
                               gate=self.gate if under_target else None,
                               calibration=calibrations.remembered.start(*pair, within, sampled) if calibrated else None)
            for row in self.rows
        }
        if calibrated:
            self._learned.append((*pair, within, made))
        return made

    def keep_learned(self) -> None:
        """For each calibrated level, what its most taught row learned, for the next call of its models."""
        for proposer, verifier, within, schedules in self._learned:
            taught = max(schedules.values(), key=lambda schedule: schedule.calibration.observations)
            calibrations.remembered.keep(proposer, verifier, taught.calibration, within)
