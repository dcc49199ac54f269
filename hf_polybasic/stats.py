"""Per-call statistics, one `LevelStats` per model of the chain: data, not log lines.

Counting convention (the EAGLE / Spec-Bench convention, called tau there): the **acceptance
length** of one verification is the number of tokens the verifier emits from it, i.e. the accepted
draft tokens **plus** the one token it adds itself (recovered or bonus), so it is >= 1. L_i is its
mean over the verifications of model M_i. `acceptance_rate` is accepted / drafted, without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from .timing import DEFAULT_CLOCK, Clock, Span, timed


@dataclass
class LevelStats:
    """What one model of the chain did during a `generate` call.

    Attributes:
        name: "M1" for the target, "M2", ... down the chain, with the model class.
        role: "target", "intermediate" or "drafter".
        forward_passes: F_i, forward calls of this model.
        seconds: wall time spent in this level's own work (its forwards, logits processing and
            verification), excluding the levels below it.
        verifications: rounds in which this model verified a draft from the level below
            (0 for the drafter).
        drafted: tokens this level received from the level below to verify.
        accepted: of those, how many it accepted.
        acceptance_lengths: per verification, the tokens it emitted: accepted + 1, and 1 more where an
            alternative hit (see module docstring).
        proposed: tokens this level handed up to the level above (0 for the target).
        withheld: tokens this level drafted and did not hand up: by argmax, where verifying fewer paid
            more (`hf_polybasic.schedule.CostAwareSchedule.proposal_size`); sampling, at a position whose
            distribution said proposing it did not pay (`CostAwareSchedule.next_draft_pays`).
        paused_rounds: rounds in which this level proposed nothing because, by the cost-aware
            schedule's measurements, the level above decoding alone was faster (back-off).
        forward_costs: this model's forward cost on this machine as the cost-aware schedule saw it
            at the end of the call, ``{k: seconds}`` for k tokens scored (None for other schedules).
        runner: how this model's forwards ran: "dynamic" (a `DynamicCache`), "static" or "static,
            compiled" (`hf_polybasic.runners.static`), "static, compile failed" (compiled forwards of
            the model failed in this call or an earlier one: uncompiled since, `hf_polybasic.runners.fallback`);
            "transformers" for a target that transformers' assisted loop ran (`hf_polybasic.assisted_generate`);
            "" for a `Drafter`.
        forward_widths: on a static runner, ``{padded width: decoding forwards}`` (each width is one
            shape, one compiled graph; prompt prefills not counted); empty otherwise.
        bypassed_rounds: rounds of the level above in which this intermediate level sat out and the
            level below proposed straight to it (`hf_polybasic.schedule.ShapeGate`).
        dropped_rounds: rounds of the level two above in which this drafter sat out and the
            intermediate level above it drafted on its own, straight to that level
            (`hf_polybasic.schedule.ShapeGate`).
        device_rounds: of its verifications, those decided on the device, many per read (an
            intermediate level over a model drafter where reads wait for the device:
            `hf_polybasic.decoding.device_blocks`).
        sat_out: why it sat out (bypassed or dropped) beyond measuring the chain without it (Theorem
            3.2's or Lemma 3.1's numbers), or "".
        insertion_saving: Theorem 3.2's latest verdict on this intermediate level, from the call's
            measured costs and acceptance: the seconds per token inserting it saves (negative: what
            it costs); None before a verdict.
        alternative_rounds: of its verifications, those that also scored the drafter's next-best tokens
            beside its drafts (greedy: `hf_polybasic.decoding.alternatives`).
        alternative_hits: of those, the rounds whose own token was one of them, so they emitted one
            token more (counted in ``acceptance_lengths`` and L_i, not in ``accepted``).
    """

    name: str
    role: str
    forward_passes: int = 0
    seconds: float = 0.0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    proposed: int = 0
    withheld: int = 0
    paused_rounds: int = 0
    forward_costs: dict[int, float] | None = None
    runner: str = ""
    forward_widths: dict[int, int] = field(default_factory=dict)
    bypassed_rounds: int = 0
    dropped_rounds: int = 0
    device_rounds: int = 0
    sat_out: str = ""
    insertion_saving: float | None = None
    alternative_rounds: int = 0
    alternative_hits: int = 0

    @contextmanager
    def timed(self, clock: Clock = DEFAULT_CLOCK) -> Iterator[Span]:
        """Time this level's own work: the block's seconds are added to `seconds` (and left in the
        span for the schedule)."""
        with timed(clock) as span:
            yield span
        self.seconds += span.seconds

    def record_verification(self, num_drafted: int, num_accepted: int) -> None:
        self.verifications += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.acceptance_lengths.append(num_accepted + 1)

    @property
    def mean_acceptance_length(self) -> float | None:
        """L_i: mean tokens emitted per verification (accepted + 1, + 1 where an alternative hit); None if
        it never verified."""
        if not self.verifications:
            return None
        return (self.accepted + self.verifications + self.alternative_hits) / self.verifications

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None if nothing was drafted to this level."""
        return self.accepted / self.drafted if self.drafted else None

    def merge(self, other: LevelStats) -> None:
        """Add another row's numbers (batched calls decode rows one by one)."""
        self.forward_passes += other.forward_passes
        self.seconds += other.seconds
        self.verifications += other.verifications
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.acceptance_lengths.extend(other.acceptance_lengths)
        self.proposed += other.proposed
        self.withheld += other.withheld
        self.paused_rounds += other.paused_rounds
        self.forward_costs = other.forward_costs or self.forward_costs
        self.runner = self.runner or other.runner
        self.bypassed_rounds += other.bypassed_rounds
        self.dropped_rounds += other.dropped_rounds
        self.alternative_rounds += other.alternative_rounds
        self.alternative_hits += other.alternative_hits
        self.sat_out = self.sat_out or other.sat_out
        self.insertion_saving = other.insertion_saving if other.insertion_saving is not None else self.insertion_saving
        for width, count in other.forward_widths.items():
            self.forward_widths[width] = self.forward_widths.get(width, 0) + count


@dataclass
class PolybasicStats:
    """Statistics of one `generate` call.

    Attributes:
        levels: one `LevelStats` per model: ``levels[0]`` is the target M1, then M2, ... Mn.
        new_tokens: tokens generated (summed over rows for a batch).
        seconds: wall time of the decoding (summed over rows), excluding `generate`'s preparation.

    A verification that a stopping criterion (EOS, stop string, ...) cuts short is still counted
    whole in the target's ``acceptance_lengths``, so their sum may exceed ``new_tokens`` by the
    tokens cut from the last block.
    """

    levels: list[LevelStats]
    new_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable), with each level's derived L_i and acceptance rate added."""
        out = asdict(self)
        for level, row in zip(self.levels, out["levels"]):
            row["mean_acceptance_length"] = level.mean_acceptance_length
            row["acceptance_rate"] = level.acceptance_rate
        return out

    def merge(self, other: PolybasicStats) -> None:
        """Add another row's statistics of the same chain (batches are decoded row by row)."""
        for mine, theirs in zip(self.levels, other.levels):
            mine.merge(theirs)
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds

    def __str__(self) -> str:
        width = max(32, *(len(level.name) + 1 for level in self.levels))
        header = (
            f"{'level':<{width}} {'F_i':>6} {'drafted':>8} {'accepted':>9} {'L_i':>6} {'proposed':>9} "
            f"{'paused':>7} {'seconds':>8}"
        )
        rows = [header]
        for level in self.levels:
            mean = level.mean_acceptance_length
            rows.append(
                f"{level.name:<{width}} {level.forward_passes:>6} {level.drafted:>8} {level.accepted:>9} "
                f"{(f'{mean:.2f}' if mean is not None else '-'):>6} {level.proposed:>9} {level.paused_rounds:>7} "
                f"{level.seconds:>8.3f}"
            )
        rows.append(f"{self.new_tokens} new tokens in {self.seconds:.3f} s")
        costs = [level for level in self.levels if level.forward_costs]
        if costs:
            ks = sorted(costs[0].forward_costs)
            rows.append(f"forward cost on this machine, ms, scoring k = {', '.join(map(str, ks))} tokens:")
            for level in costs:
                cells = ", ".join(f"{1000 * level.forward_costs[k]:.1f}" for k in ks if k in level.forward_costs)
                rows.append(f"  {level.name:<{width - 2}} {cells}")
        return "\n".join(rows)


_last = threading.local()  # per thread: model -> the statistics of its latest call in this thread


def _last_by_model() -> weakref.WeakKeyDictionary:
    if not hasattr(_last, "stats"):
        _last.stats = weakref.WeakKeyDictionary()
    return _last.stats


def remember_last(model, stats: PolybasicStats) -> None:
    """Keep ``stats`` as the latest call's of ``model`` in this thread (`last_stats`)."""
    _last_by_model()[model] = stats


def last_stats(model) -> PolybasicStats | None:
    """Statistics of the most recent polybasic `generate` call on ``model`` *in this thread*
    (`hf_polybasic.generate` or `hf_polybasic.assisted_generate`; for tensor outputs:
    ``return_dict_in_generate=True`` returns them with the call itself). Two threads generating with
    one model each see their own call's."""
    return _last_by_model().get(model)
