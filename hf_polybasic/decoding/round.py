"""The recursive chain: verifiers over the level below, and how a chain is assembled.

A chain M1 > M2 > ... > Mn is built bottom-up (`build_chain`):

* the bottom is a drafter (`hf_polybasic.decoding.drafting`): a model drafting K tokens, or a `Drafter`;
* every model above it is a `Verifier` over the level below: one forward pass scores a whole
  proposal, `hf_polybasic.decoding.acceptance` decides what is accepted (the one place that happens), and the
  rejected tail is rolled back; an intermediate model is an `IntermediateLevel`, which repeats
  verifications until it holds mu tokens and hands them up as *its* proposal, together with the
  processed distribution each token was drawn from. The target M1 is the top `Verifier`; the engine
  runs one verification of it at a time and emits the result.

Why the chain is lossless: by `hf_polybasic.decoding.acceptance`, the tokens a verifier emits are an
autoregressive sample of its own processed distribution p_i (greedy: its argmax continuation),
whatever the level below proposed. So the block M_i hands up really is drawn from the q = p_i it
reports, which is exactly what the level above needs for its own verification to be exact. By
induction up the chain, the target emits a sample of its processed distribution (greedy: its own
greedy output), for any number of levels, any K and any mu.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..labels import model_label
from ..runners.dynamic import CachedModel
from ..compat import cached_tokens, new_dynamic_cache
from ..config import MAX_BLOCK_THRESHOLD, MAX_DRAFT_TOKENS, PolybasicConfig
from ..costs import CostCurves, CostEstimate
from ..drafters import AddedPromptLookup, Drafter
from .drafting import DrafterLevel, ModelDrafter, ScheduledRows
from .processing import DecodingRules, process_positions
from .protocol import Block, Level, Proposal, Runner
from ..schedule import BatchGate, Schedule, ShapeGate, make_schedule
from ..schedule.calibration import remembered as remembered_calibration
from ..schedule.shape_gate import BYPASSED, DROPPED
from ..runners.probe import compile_problem, static_problem
from ..runners.static import StaticRunner
from ..stats import LevelStats, PolybasicStats
from ..timing import DEFAULT_CLOCK, Clock, timed
from .acceptance import greedy_decision, speculative_decision
from ..models.vocab_head import NOTHING_TO_SAMPLE


@dataclass
class Round:
    """One verification: the tokens emitted and the verifier's rows for them.

    tokens: [m] emitted ids (accepted drafts, then the verifier's own token), on the device; ids:
    the same as host ints; scores: [m, V] processed scores they were chosen from; logits: [m, V]
    raw logits; confidences: the verifier's processed probability of each token, when its level
    asked for them (`Verifier.confidences`).
    """

    tokens: torch.LongTensor
    scores: torch.Tensor
    logits: torch.Tensor
    ids: list[int] = field(default_factory=list)
    confidences: list[float] | None = None


class Verifier:
    """A model that verifies the proposals of the level below it, for every row asked, in one forward.

    ``samples=False`` verifies by argmax even when the target samples (an intermediate level with
    ``verification="greedy"``). ``rules`` are per row. ``confidences``: each round also reports the
    verifier's probability of every token it emits (an intermediate level whose schedule stops
    blocks by confidence sets it).

    A round reads back from the device once for all its rows (every row's number of accepted drafts,
    next token and, with ``confidences``, the probabilities): never per token or per row, and it
    uploads nothing (the next token stays on the device).
    """

    def __init__(
        self,
        runner: Runner,
        child: Level,
        rules: dict[int, DecodingRules],
        stats: LevelStats,
        samples: bool,
        clock: Clock = DEFAULT_CLOCK,
    ):
        self.runner, self.child, self.rules, self.stats = runner, child, rules, stats
        self.samples = samples
        self.clock = clock
        self.confidences = False

    def verify(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Round]:
        """``{row: (sequence, budget)}``: ask the child for each row's proposal, score them all in one
        forward pass, keep what is accepted. Emits between 1 and ``budget`` tokens per row (the child
        proposes at most one fewer)."""
        proposals = self.child.propose({row: (sequence, budget - 1) for row, (sequence, budget) in requests.items()})
        with self.stats.timed(self.clock) as span:
            candidates = {row: torch.cat([requests[row][0], proposals[row].tokens]) for row in requests}
            logits = self.runner.logits_rows({row: (candidates[row], len(proposals[row]) + 1) for row in requests})
            scores = {
                row: process_positions(self.rules[row].processors, candidates[row], sequence.shape[0],
                                       logits[row].to(sequence.device))  # [k + 1, V]
                for row, (sequence, _) in requests.items()
            }
            try:
                decided = {row: self._decide(proposals[row], scores[row]) for row in requests}  # [2] each
            except RuntimeError as error:  # vocab_head: a restricted level may be left nothing to sample from
                if self.samples and not all(bool(torch.isfinite(s).any(-1).all()) for s in scores.values()):
                    raise ValueError(NOTHING_TO_SAMPLE.format(level=self.runner.role)) from error
                raise
            values = self._read(proposals, decided, scores)  # the round's one read, every row at once
            rounds, kept = {}, {}
            for row in requests:
                accepted, next_token, confidences = values[row]
                rounds[row] = self._round(proposals[row], accepted, next_token, decided[row][1:], scores[row],
                                          logits[row], confidences)
                kept[row] = accepted
            self.runner.rollback_rows({row: requests[row][0].shape[0] + count for row, count in kept.items()})
        # each row's share of the forward the rows shared, split evenly as `BatchShare` prices it (the
        # whole forward's seconds would make every row's overhead look like the other rows' work)
        self.child.verified(kept, span.seconds / len(kept))
        return rounds

    def _decide(self, proposal: Proposal, scores: torch.Tensor) -> torch.Tensor:
        """The one place a row's drafts are accepted (`hf_polybasic.decoding.acceptance`): ``[accepted, next token]``
        on the device."""
        if self.samples:
            return speculative_decision(proposal.tokens, proposal.probs, scores.softmax(-1))
        return greedy_decision(proposal.tokens, scores)

    def _read(self, proposals: dict[int, Proposal], decided: dict[int, torch.Tensor],
              scores: dict[int, torch.Tensor]) -> dict[int, tuple[int, int, list[float] | None]]:
        """Every row's (accepted, next token, confidences) in one read from the device. With
        ``confidences``, the verifier's processed probability of each token the row emits (its first
        ``accepted`` drafts, then its own token), computed for all k + 1 positions before the read."""
        packed = []
        for row, decision in decided.items():
            packed.append(decision.to(torch.float64))
            if self.confidences:
                drafts = proposals[row].tokens.to(decision.device)  # [k]
                positions = torch.arange(drafts.shape[0] + 1, device=decision.device)
                emitted = torch.where(positions < decision[0], torch.cat([drafts, decision[1:]]), decision[1])  # [k + 1]
                probs = scores[row].softmax(-1).gather(1, emitted.to(scores[row].device).unsqueeze(1)).squeeze(1)
                packed.append(probs.to(device=decision.device, dtype=torch.float64))
        values = torch.cat(packed).tolist()
        read, start = {}, 0
        for row in decided:
            accepted, next_token = int(values[start]), int(values[start + 1])
            start += 2
            confidences = None
            if self.confidences:
                width = len(proposals[row]) + 1
                confidences = values[start : start + accepted + 1]
                start += width
            read[row] = (accepted, next_token, confidences)
        return read

    def _round(self, proposal: Proposal, accepted: int, next_token: int, next_on_device: torch.Tensor, scores,
               logits, confidences: list[float] | None) -> Round:
        """The row's round: its tokens on the device (the verifier's own token taken from the decision
        ``[1]``, not uploaded again) and as host ints."""
        self.stats.record_verification(len(proposal), accepted)
        tokens = torch.cat([proposal.tokens[:accepted], next_on_device.to(proposal.tokens.device)])
        ids = (proposal.tokens[:accepted].tolist() if proposal.ids is None else proposal.ids[:accepted]) + [next_token]
        return Round(tokens=tokens, scores=scores[: accepted + 1], logits=logits[: accepted + 1], ids=ids,
                     confidences=confidences)

    def rollback_to(self, lengths: dict[int, int]) -> None:
        """Forget everything about each row's tokens past its length, here and in every level below."""
        self.runner.rollback_rows(lengths)
        self.child.rollback_to(lengths)

    def commit(self) -> None:
        """Everything so far is final (the target has verified it), here and below."""
        self.runner.commit()
        self.child.commit()

    def release_rows(self, rows) -> None:
        """These rows are done: they leave every forward, here and below."""
        self.runner.release_rows(rows)
        self.child.release_rows(rows)


class IntermediateLevel(ScheduledRows):
    """A `Verifier` that the level above uses as its proposer: for each row it verifies rounds of the
    level below until the row's block holds at least mu tokens (its schedule's length), an EOS or the
    budget, or its schedule ends it after a token; rows still building share each round's forward.

    Each round asks its verifier for one token more than the block has room for, so the level below
    drafts up to the budget (in a chain of n models every level drafts as soon as 2 tokens remain);
    `Block.extend` cuts the surplus, which can only be the verifier's own token (the cut block is
    still an autoregressive sample of this level's distribution, and its cache never held that token).

    With a ``shape_gate`` (`hf_polybasic.schedule.ShapeGate`: the level right above a model drafter,
    under the cost-aware schedule) the level is *bypassed* in the rounds the gate says: the drafter
    proposes straight to the level above, under its ``bypass_schedules`` (priced by that level's
    costs), and this level's model neither verifies nor runs (its cache catches up when it is back).
    With a ``drop_drafter`` too (a `ModelDrafter` over this level's own runner, under schedules priced
    by the level above's costs) the gate may *drop* the drafter instead: this level's model drafts its
    block token by token, reporting the distribution each token was drawn from as any model drafter
    does, and the drafter neither drafts nor runs (its cache catches up when it is back).
    """

    def __init__(self, verifier: Verifier, schedules: dict[int, Schedule], clock: Clock = DEFAULT_CLOCK,
                 shape_gate: ShapeGate | None = None, bypass_schedules: dict[int, Schedule] | None = None,
                 drop_drafter: ModelDrafter | None = None):
        super().__init__()
        self.verifier, self.schedules, self.clock = verifier, schedules, clock
        self.stats = verifier.stats
        verifier.confidences = any(schedule.stops_per_token for schedule in schedules.values())
        self.shape_gate, self.bypass_schedules, self.drop_drafter = shape_gate, bypass_schedules, drop_drafter
        self._bypassing = self._dropping = False
        self._own_schedules = None  # the drafter's schedules, while a bypassed round lends it others
        self._before: tuple[int, ...] | None = None

    def _counts(self) -> tuple[int, ...]:
        """(this level's verifications, drafted, accepted, the drafter's forwards, this level's
        forwards, answers of its schedules and the drafter's, in any shape, given on an uncalibrated
        confidence calibration) so far."""
        child = self.verifier.child
        lent = [self.schedules, child.schedules, self.bypass_schedules,
                None if self.drop_drafter is None else self.drop_drafter.schedules]
        distinct = {id(schedules): schedules for schedules in lent if schedules is not None}.values()
        stops = sum(getattr(schedule, "uncalibrated_answers", 0)
                    for schedules in distinct for schedule in schedules.values())
        return (self.stats.verifications, self.stats.drafted, self.stats.accepted, child.runner.forward_passes,
                self.verifier.runner.forward_passes, stops)

    def _bypass(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        child = self.verifier.child
        self._own_schedules, child.schedules = child.schedules, self.bypass_schedules
        self._bypassing = True
        return child.propose(requests)

    def _drop(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        self._dropping = True
        return self.drop_drafter.propose(requests)

    def verified(self, kept: dict[int, int], seconds: float) -> None:
        """The level above kept ``kept`` of this round's proposal: whoever proposed learns and rolls
        back (the drafter under the lent schedules when bypassed, this level's model as a drafter when
        the drafter was dropped, else this level), and the shape gate is told what the round took."""
        if self._bypassing:
            proposer, shape = self.verifier.child, BYPASSED
            proposer.verified(kept, seconds)
            proposer.schedules = self._own_schedules
        elif self._dropping:
            proposer, shape = self.drop_drafter, DROPPED
            proposer.verified(kept, seconds)
        else:
            proposer, shape = self, None
            super().verified(kept, seconds)
        self._bypassing = self._dropping = False
        if self.shape_gate is None:
            return
        verifications, drafted, accepted, drafter_forwards, own_forwards, stops = (
            now - then for now, then in zip(self._counts(), self._before))
        # the forwards of the model that drafted, and (in) what the middle level's own rounds did
        forwards, middle = {BYPASSED: (drafter_forwards, (0, 0, 0)), DROPPED: (own_forwards, (0, 0, 0))}.get(
            shape, (drafter_forwards, (verifications, accepted + verifications, drafted)))
        self.shape_gate.observe(len(kept), sum(kept.values()) + len(kept), sum(proposer._proposed[r] for r in kept),
                                forwards, middle, stops > 0)

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        if self.shape_gate is not None:
            self._before = self._counts()
            if self.shape_gate.bypassed:
                return self._bypass(requests)
            if self.shape_gate.dropped:
                return self._drop(requests)
        blocks, thresholds, building = {}, {}, []
        for row, (sequence, budget) in requests.items():
            thresholds[row] = self.schedules[row].length()
            blocks[row] = Block(self.verifier.rules[row].eos_token_ids, budget, sequence.device)
            self._starts[row] = sequence.shape[0]
            if not blocks[row].closed and thresholds[row] > 0:
                building.append(row)
        with timed(self.clock) as span:  # this level and everything below: what the blocks cost
            while building:
                rounds = self.verifier.verify({
                    row: (torch.cat([requests[row][0], blocks[row].tokens]), requests[row][1] - blocks[row].size + 1)
                    for row in building
                })
                building = [row for row in building if self._extend(row, blocks[row], rounds[row], thresholds[row])]
        self._observe(blocks, span.seconds)
        return {row: block.proposal() for row, block in blocks.items()}

    def _extend(self, row: int, block: Block, round_: Round, threshold: int) -> bool:
        """Add a round's tokens to the row's block; whether the row goes on building."""
        schedule = self.schedules[row]
        probs = round_.scores.softmax(-1) if self.verifier.samples else None
        before = block.size
        kept = block.extend(round_.tokens, probs, ids=round_.ids)
        if schedule.stops_per_token and self._stop_within(schedule, block, before, round_.confidences[:kept]):
            return False
        return not block.closed and block.size < threshold

    @staticmethod
    def _stop_within(schedule, block: Block, before: int, confidences: list[float]) -> bool:
        """Ask the schedule, token by token, whether to go on after each new token (its confidence:
        this level's probability of it); on the first no, end the block right after that token."""
        for index, confidence in enumerate(confidences):
            if not block.closed and not schedule.keep_drafting(confidence):
                block.truncate(before + index + 1)
                return True
        return False

    def rollback_to(self, lengths: dict[int, int]) -> None:
        self.verifier.rollback_to(lengths)

    def commit(self) -> None:
        self.verifier.commit()

    def release_rows(self, rows) -> None:
        self.verifier.release_rows(rows)


@dataclass(frozen=True)
class ChainParts:
    """The classes a chain is built from. `hf_polybasic.generation.make_generate` takes another set:
    tests inject deliberately wrong levels to prove that the distribution tests can fail."""

    model_drafter: type = ModelDrafter
    drafter_level: type = DrafterLevel
    intermediate: type = IntermediateLevel
    verifier: type = Verifier


_warned_sat_out: set[tuple[str, bool]] = set()


def _warn_sat_out(name: str, reason: str, dropped: bool = False) -> None:
    """Once per level kind and way: a level the user passed sat out most of a call (a middle level
    bypassed, or the drafter ``dropped`` while the level above it drafted alone)."""
    kind = name.split(" ", 1)[-1]
    if (kind, dropped) not in _warned_sat_out:
        _warned_sat_out.add((kind, dropped))
        how = ("The level above it drafted on its own; polybasic_stats says in how many rounds (dropped_rounds)"
               if dropped else
               "Its drafts went straight to the level above; polybasic_stats says in how many rounds (bypassed_rounds)")
        warnings.warn(f"hf_polybasic let {name} sit out: the chain ran faster without it ({reason}). {how}",
                      UserWarning, stacklevel=6)


def level_names(target: torch.nn.Module, assistant_models: Sequence) -> list[str]:
    """"M1 <target class>", "M2 <class or Drafter repr>", ..., as in the statistics."""
    return [
        f"M{i + 1} {repr(m) if isinstance(m, Drafter) else model_label(m)}"
        for i, m in enumerate([target, *assistant_models])
    ]


class BatchShare:
    """A row's view of a verifier's costs while the rows still live share each of its forwards
    (``runner.live_rows``, n: rows that are done have left them): a forward scoring k tokens for
    each of n rows is priced as one of n k tokens (the machine reads the weights once for all of
    them), split evenly, T(n k) / n. One row: the curve itself."""

    def __init__(self, estimate, runner):
        self.estimate, self.runner = estimate, runner

    @property
    def rows(self) -> int:
        return max(self.runner.live_rows, 1)

    def seconds(self, tokens: float) -> float:
        rows = self.rows
        return self.estimate.seconds(rows * tokens) / rows

    @property
    def last_seconds(self) -> float | None:
        last = self.estimate.last_seconds
        return None if last is None else last / self.rows


@dataclass
class Chain:
    """A built chain: its top `Verifier` (the target), the call's statistics, and per level its
    model runner (None for a `Drafter`), per-row schedules (None for the target) and cost estimate
    (None unless the schedule is cost-aware); for a batch under the cost-aware schedule, its `BatchGate`."""

    top: Verifier
    stats: PolybasicStats
    runners: list
    schedules: list
    estimates: list
    gate: BatchGate | None = None  # a batch's: whether the level under the target proposes at all
    shape_gates: dict = field(default_factory=dict)  # level index -> its ShapeGate (whether it takes part)
    learned: list = field(default_factory=list)  # (proposer, verifier, within, schedules): calibrations to keep

    def finish(self, costs: CostCurves | None = None) -> PolybasicStats:
        """Fill in what the levels counted (forward passes, rounds sat out, forward costs) and let
        ``costs`` learn what the forwards of this call cost."""
        for level, runner, schedules, estimate in zip(self.stats.levels, self.runners, self.schedules, self.estimates):
            if runner is not None:
                level.forward_passes = runner.forward_passes
            if schedules is not None:
                level.paused_rounds = sum(schedule.paused_rounds for schedule in schedules.values())
            if estimate is not None:
                level.forward_costs = estimate.snapshot()
                if costs is not None:
                    costs.refresh(runner.model, estimate, runner_kind(runner))
            if isinstance(runner, StaticRunner):
                level.runner = "static, compiled" if runner.compiled else "static"
                level.forward_widths = dict(sorted(collections.Counter(runner.forward_widths).items()))
                runner.close()
            elif runner is not None:
                level.runner = "dynamic"
        for proposer, verifier, within, schedules in self.learned:  # the row that learned most, for the next call
            taught = max(schedules.values(), key=lambda schedule: schedule.calibration.observations)
            remembered_calibration.keep(proposer, verifier, taught.calibration, within)
        for index, shape in self.shape_gates.items():
            level, below = self.stats.levels[index], self.stats.levels[index + 1]
            level.bypassed_rounds, below.dropped_rounds = shape.bypassed_rounds, shape.dropped_rounds
            if shape.verdict is not None:
                level.insertion_saving = shape.verdict.time_saved_per_token
            # sat out beyond the rounds the gate measured the chain without it
            if shape.bypassed_rounds > shape.probe_rounds[BYPASSED]:
                level.sat_out = shape.describe()
                _warn_sat_out(level.name, level.sat_out)
            if shape.dropped_rounds > shape.probe_rounds.get(DROPPED, 0):
                below.sat_out = shape.describe_drop()
                _warn_sat_out(below.name, below.sat_out, dropped=True)
        return self.stats


_warned_runners: set[tuple[str, str]] = set()


def make_runner(model, cache, role: str, config: PolybasicConfig, static: bool, capacity: int | None,
                vocab_limit: int | None = None, clock: Clock = DEFAULT_CLOCK, rows: int = 1):
    """The runner a model of the chain decodes with: a `StaticRunner` when the call asks for a static
    cache or compiled forwards (`PolybasicConfig.compiles`) and the model can (`static_problem`; the
    cache it would start from is empty), compiled unless hooks on it say not now (`compile_problem`);
    else a `CachedModel` on ``cache``. What was asked and not done is said in a warning, once per
    model kind and reason."""
    compiled = config.compiles(model.device)
    if not (static or compiled) or capacity is None or cache is None or cached_tokens(cache) != 0:
        return CachedModel(model, cache, role=role, vocab_limit=vocab_limit, clock=clock, rows=rows)
    problem = static_problem(model)
    if problem is None:
        hooked = compile_problem(model) if compiled else None
        if hooked is not None:
            _warn_runner(model, hooked, f"hf_polybasic runs {role} on a static cache, uncompiled: {hooked}")
        return StaticRunner(model, role, capacity, vocab_limit, clock, rows, compiled=compiled and hooked is None)
    _warn_runner(model, problem, f"hf_polybasic runs {role} on a dynamic cache" + (", uncompiled" if compiled else "")
                 + f": {problem}. The other models of the chain run " + ("compiled " if compiled else "")
                 + "on static caches where they can")
    return CachedModel(model, cache, role=role, vocab_limit=vocab_limit, clock=clock, rows=rows)


def runner_kind(runner) -> str:
    """"compiled", "static" or "dynamic": the runner a model's forwards go through (its costs differ)."""
    if isinstance(runner, StaticRunner):
        return "compiled" if runner.compiled else "static"
    return "dynamic"


def _warn_runner(model, reason: str, message: str) -> None:
    key = (model_label(model), reason)
    if key not in _warned_runners:
        _warned_runners.add(key)
        warnings.warn(message, UserWarning, stacklevel=7)


def build_chain(
    target: torch.nn.Module,
    assistant_models: Sequence,
    config: PolybasicConfig,
    rules: dict[int, DecodingRules],
    target_cache,
    parts: ChainParts = ChainParts(),
    clock: Clock = DEFAULT_CLOCK,
    costs: CostCurves | None = None,
    static: bool = False,
    capacity: int | None = None,
) -> Chain:
    """The chain M1 > M2 > ... > Mn for the rows of ``rules`` (row -> its `DecodingRules`), with a
    fresh cache for every assistant model and the target's ``target_cache`` (None when
    ``use_cache=False``). Under the cost-aware schedule every model's cost curve comes from ``costs``
    (measured on first use), and each row's schedule prices its tokens with its parent's curve as the
    rows share it (`BatchShare`). ``static`` (the call asked for a static cache) or compiled forwards
    (`PolybasicConfig.compile`) run each model that can on a `StaticRunner` of ``capacity`` slots
    per row (`make_runner`)."""
    rows = sorted(rules)
    count = len(rows)
    names = level_names(target, assistant_models)
    roles = ["target"] + ["intermediate"] * (len(assistant_models) - 1) + ["drafter"]
    stats = PolybasicStats(levels=[LevelStats(name=name, role=role) for name, role in zip(names, roles)])
    vocab = target.config.get_text_config(decoder=True).vocab_size
    greedy_intermediates = config.verification == "greedy"
    do_sample = rules[rows[0]].do_sample
    models = [target, *assistant_models]
    runners = [make_runner(target, target_cache, f"target {names[0]}", config, static, capacity, None, clock, count)] + [
        None if isinstance(model, Drafter)
        else make_runner(model, new_dynamic_cache(model), f"assistant_models[{i}] ({names[i + 1]})", config, static,
                         capacity, vocab, clock, count)
        for i, model in enumerate(assistant_models)
    ]
    estimates = [None] * len(models)
    if config.schedule == "cost_aware" and costs is not None:
        for index, runner in enumerate(runners):
            curve = None if runner is None else costs.curve_for(models[index], clock, measure=config.measure_costs,
                                                                  runner=runner_kind(runner), capacity=capacity)
            if curve is not None:  # None: not stored and not to be measured; the schedule goes by the call's timings
                estimates[index] = runner.cost_observer = CostEstimate(curve)
    shared = [None if estimate is None else BatchShare(estimate, runner) for estimate, runner in zip(estimates, runners)]
    # rows of a batch: whether the level under the target proposes at all is the batch's decision
    gate = BatchGate(count, estimates[0], estimates[1]) if count > 1 and config.schedule == "cost_aware" else None

    def per_row(make):
        return {row: make() for row in rows}

    learned = []  # (proposing model, verifying model, within, its rows' schedules): calibrations kept for later calls

    def calibrated(proposer: int, verifier: int, make, within: tuple = ()):
        """Each row's schedule of a model level, its calibration started from what the last call of the
        same two models learned (cost-aware only); ``within``: the models that key it further."""
        if config.schedule != "cost_aware":
            return per_row(lambda: make(None))
        made = per_row(lambda: make(remembered_calibration.start(models[proposer], models[verifier], within)))
        learned.append((models[proposer], models[verifier], within, made))
        return made

    schedules = [None] * len(models)
    bottom = len(models) - 1
    if runners[bottom] is None:
        # a Drafter sets its own length; the cost-aware schedule caps it (and can sit it out) by how
        # often the level above accepts its drafts
        if config.schedule == "cost_aware":
            schedules[bottom] = per_row(lambda: make_schedule(
                config.schedule, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, verifier_costs=shared[bottom - 1],
                gate=gate if bottom == 1 else None))
        level = parts.drafter_level(models[bottom], rules, stats.levels[bottom], clock, schedules[bottom])
    else:
        own = estimates[bottom]
        step = None if own is None else own.seconds(count) / count
        schedules[bottom] = calibrated(bottom, bottom - 1, lambda calibration: make_schedule(
            config.schedule, config.num_draft_tokens, MAX_DRAFT_TOKENS, per_token=True,
            verifier_costs=shared[bottom - 1], step_seconds=step, gate=gate if bottom == 1 else None,
            calibration=calibration))
        # below a greedy intermediate level, sampled drafts would only lower its acceptance
        samples = do_sample and not (greedy_intermediates and bottom > 1)
        level = parts.model_drafter(runners[bottom], rules, stats.levels[bottom], schedules[bottom], samples, clock)
    # a PromptLookup the config added below the bottom model (drafting K tokens, `with_prompt_lookup`):
    # that model is an intermediate level now, with the config's last mu
    added = int(isinstance(models[bottom], AddedPromptLookup))
    thresholds = config.thresholds_for(bottom - 1 - added)
    thresholds += (thresholds[-1] if thresholds else config.last_threshold,) * added
    shape_gates: dict[int, ShapeGate] = {}
    for index in range(bottom - 1, 0, -1):  # intermediate levels, bottom-up
        samples = do_sample and not greedy_intermediates
        verifier = parts.verifier(runners[index], level, rules, stats.levels[index], samples, clock)
        # its T(1) is what a token costs until its rounds are timed (they may emit several per
        # forward, so it does not rule the level out up front)
        own = estimates[index]
        step = None if own is None else own.seconds(count) / count
        schedules[index] = calibrated(index, index - 1, lambda calibration: make_schedule(
            config.schedule, thresholds[index - 1], MAX_BLOCK_THRESHOLD, per_token=True,
            verifier_costs=shared[index - 1], step_seconds=step, static_check=False,
            gate=gate if index == 1 else None, calibration=calibration))
        shape = {}
        if index == bottom - 1 and runners[bottom] is not None and None not in estimates[index - 1 : bottom + 1]:
            # the level right above a model drafter takes part only while Theorem 3.2 says it pays; when
            # bypassed, the drafter proposes to the level above under schedules priced by its costs; and
            # the drafter only while the level's model drafting alone to the level above is not faster:
            # then that model drafts under schedules priced by the level above's costs, with a
            # calibration of its own (kept for this chain: `calibration.remembered`, ``within``)
            drafter_step = estimates[bottom].seconds(count) / count
            middle_step = estimates[index].seconds(count) / count
            level_costs = (shared[index - 1].seconds, shared[index].seconds, shared[bottom].seconds)
            drop_schedules = calibrated(index, index - 1, lambda calibration: make_schedule(
                config.schedule, config.num_draft_tokens, MAX_DRAFT_TOKENS, per_token=True,
                verifier_costs=shared[index - 1], step_seconds=middle_step, gate=gate if index == 1 else None,
                calibration=calibration), within=(models[bottom],))
            shape = dict(shape_gate=ShapeGate(level_costs, models=(models[index - 1], models[index], models[bottom]),
                                              drops=True),
                         bypass_schedules=calibrated(bottom, index - 1, lambda calibration: make_schedule(
                             config.schedule, config.num_draft_tokens, MAX_DRAFT_TOKENS, per_token=True,
                             verifier_costs=shared[index - 1], step_seconds=drafter_step,
                             gate=gate if index == 1 else None, calibration=calibration)),
                         drop_drafter=parts.model_drafter(runners[index], rules, stats.levels[index], drop_schedules,
                                                          samples, clock))
            shape_gates[index] = shape["shape_gate"]
        level = parts.intermediate(verifier, schedules[index], clock, **shape)
    top = parts.verifier(runners[0], level, rules, stats.levels[0], do_sample, clock)
    return Chain(top, stats, runners, schedules, estimates, gate, shape_gates, learned)
