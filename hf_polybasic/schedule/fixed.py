"""Schedules that do not look at costs: the paper's constant K and mu, and transformers' heuristic."""

from __future__ import annotations

from collections.abc import Sequence


class ConstantSchedule:
    """Always the configured length (the paper's static K and mu)."""

    stops_per_token = False
    paused_rounds = 0
    uncalibrated_answers = 0

    def __init__(self, length: int):
        self.current = length

    def length(self) -> int:
        return self.current

    def fixed_length(self) -> int:
        return self.length()

    def keep_drafting(self, confidence: float) -> bool:
        return True

    def closed_at(self, confidence: float) -> None:
        pass

    def first_draft_pays(self, top: float | Sequence[float]) -> bool:
        return True

    def next_draft_pays(self, spread: Sequence[float]) -> bool:
        return True

    def proposal_size(self, drafted: int) -> int:
        return drafted

    def observe_proposal(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        pass


class HeuristicSchedule(ConstantSchedule):
    """transformers' assisted-generation rule: +2 after a round whose proposal was accepted whole,
    -1 (down to 1) otherwise, within 1 .. ``maximum``."""

    def __init__(self, initial: int, maximum: int):
        super().__init__(initial)
        self.maximum = max(maximum, initial)

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        if num_drafted:
            whole = num_accepted == num_drafted
            self.current = min(self.maximum, self.current + 2) if whole else max(1, self.current - 1)
