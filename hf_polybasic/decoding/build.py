"""Assembling a chain for one call: its levels, their runners, schedules, cost estimates and gates.

Nothing here decodes: `build_chain` wires the levels of `hf_polybasic.decoding.round` bottom-up, and
`Chain.finish` collects what they counted once the call is over.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..compat import cached_tokens, new_dynamic_cache
from ..config import MAX_BLOCK_THRESHOLD, MAX_DRAFT_TOKENS, PolybasicConfig
from ..costs import CostCurves, CostEstimate
from ..drafters import AddedPromptLookup, Drafter
from ..labels import model_label
from ..models.few_rows import few_row_view
from ..runners.dynamic import CachedModel
from ..runners.head import HeadModel, HeadRunner, head_source
from ..runners.probe import compile_problem, static_problem
from ..runners.static import StaticRunner
from ..runners.text_route import TextRouteRunner
from ..runners.translated import TranslatedRunner
from ..schedule import BatchGate, RowSchedules, ShapeGate
from ..schedule.shape_gate import BYPASSED, DROPPED
from ..stats import LevelStats, PolybasicStats
from ..timing import DEFAULT_CLOCK, Clock
from ..processing import DecodingRules
from ..translation.level import Translated
from .alternatives import DEFAULT_ALTERNATIVES, AlternativesPolicy
from . import round as levels_round
from .round import DrafterLevel, IntermediateLevel, ModelDrafter, Verifier
from ..user_warnings import warn


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
        warn(f"hf_polybasic let {name} sit out: the chain ran faster without it ({reason}). {how}")


def level_names(target: torch.nn.Module, assistant_models: Sequence) -> list[str]:
    """"M1 <target class>", "M2 <class or Drafter repr>", ..., as in the statistics."""
    return [
        f"M{i + 1} {repr(m) if isinstance(m, (Drafter, Translated)) else model_label(m)}"
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
    row_schedules: RowSchedules | None = None  # what made the schedules: keeps what their calibrations learned

    def close(self) -> None:
        """Give every static runner's cache back for later calls (`hf_polybasic.runners.static.take_cache`),
        whether the call ended or raised."""
        for runner in self.runners:
            runner = getattr(runner, "inner", runner)  # a head's runner: the one its own cache is on
            if isinstance(runner, StaticRunner):
                runner.close()

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
            runner = getattr(runner, "inner", runner)  # a head's runner: the one its own cache is on
            if isinstance(runner, StaticRunner):
                level.runner = ("static, compile failed" if runner.fallback else
                                "static, compiled" if runner.compiled else "static")
                level.forward_widths = dict(sorted(collections.Counter(runner.forward_widths).items()))
            elif runner is not None:
                level.runner = "dynamic"
        if self.row_schedules is not None:
            self.row_schedules.keep_learned()
        for index, shape in self.shape_gates.items():
            shape.keep()
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
    runner = getattr(runner, "inner", runner)  # a head's runner: the one its own cache is on
    if isinstance(runner, StaticRunner):
        return "compiled" if runner.compiled else "static"
    return "dynamic"


def _warn_runner(model, reason: str, message: str) -> None:
    key = (model_label(model), reason)
    if key not in _warned_runners:
        _warned_runners.add(key)
        warn(message)


@dataclass
class _Link:
    """One level of a chain being built: its model (or `Drafter`), the runner it decodes with (None for
    a `Drafter`), and under the cost-aware schedule its cost estimate and a row's share of it."""

    model: object
    runner: object | None
    estimate: CostEstimate | None = None
    share: BatchShare | None = None

    def step(self, rows: int) -> float | None:
        """A row's share of one step of this level's model, T(rows) / rows (None: not estimated)."""
        return None if self.estimate is None else self.estimate.seconds(rows) / rows


def _links(target, assistant_models: Sequence, names: list[str], target_cache, config: PolybasicConfig, static: bool,
           capacity: int | None, clock: Clock, rows: int, costs: CostCurves | None) -> list[_Link]:
    """Each level's `_Link`, top-down: a fresh cache for every assistant model (a draft head's runner reads
    the features the runner above it keeps, `hf_polybasic.runners.head`) and, under the cost-aware schedule,
    every model's cost estimate from ``costs`` (measured on first use)."""
    vocab = target.config.get_text_config(decoder=True).vocab_size
    target = _kernel_view(target, config, static)
    links = [_Link(target, make_runner(target, target_cache, f"target {names[0]}", config, static, capacity, None,
                                       clock, rows))]
    for index, model in enumerate(assistant_models):
        role = f"assistant_models[{index}] ({names[index + 1]})"
        if isinstance(model, Drafter):
            runner = None
        elif isinstance(model, HeadModel):  # fed the hidden states of the level above
            inner = make_runner(model, new_dynamic_cache(model), role, config, static, capacity, None, clock, rows)
            runner = HeadRunner(inner, head_source(links[-1].runner, role), vocab)
        elif isinstance(model, Translated):  # its own model on its own ids, behind a translation
            runner, model = _translated_runner(model, role, config, static, clock, rows, vocab), model.model
        else:
            model = _kernel_view(model, config, static)
            runner = make_runner(model, new_dynamic_cache(model), role, config, static, capacity, vocab, clock, rows)
        links.append(_Link(model, runner))
    if config.schedule == "cost_aware" and costs is not None:
        for link in links:
            curve = None if link.runner is None else costs.curve_for(
                link.model, clock, measure=config.measure_costs, runner=runner_kind(link.runner), capacity=capacity)
            if curve is not None:  # None: not stored and not to be measured; the schedule goes by the call's timings
                link.estimate = link.runner.cost_observer = CostEstimate(curve)
                link.share = BatchShare(link.estimate, link.runner)
    return links


def _kernel_view(model, config: PolybasicConfig, static: bool):
    """The model a level's dynamic runner forwards: on the CPU, its few-row view where that pays
    (`PolybasicConfig.few_row_products`, `hf_polybasic.models.few_rows.few_row_view`; its cost curve is
    its own, `hf_polybasic.costs.measure.model_description`); else the model as given."""
    if not config.few_row_products or static or model.device.type != "cpu" or config.compiles(model.device):
        return model
    return few_row_view(model)


def _translated_runner(level: Translated, role: str, config: PolybasicConfig, static: bool, clock: Clock, rows: int,
                       width: int):
    """A translated level's runner (`hf_polybasic.runners.translated`) over a `CachedModel` of its own model:
    dynamic, since how many of its own tokens a row takes is known only as it is translated."""
    if static or config.compiles(level.model.device):
        _warn_runner(level.model, "translated", f"hf_polybasic runs {role} on a dynamic cache, uncompiled: a translated "
                     "level's own tokens per target token vary, so no static cache size holds for it")
    inner = CachedModel(level.model, new_dynamic_cache(level.model), role=role, clock=clock, rows=rows)
    return (TextRouteRunner if level.route == "text" else TranslatedRunner)(inner, level.shared, width)


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
    do_sample = rules[rows[0]].do_sample
    links = _links(target, assistant_models, names, target_cache, config, static, capacity, clock, count, costs)
    models = [link.model for link in links]
    # rows of a batch: whether the level under the target proposes at all is the batch's decision
    gate = BatchGate(count, links[0].estimate, links[1].estimate) if count > 1 and config.schedule == "cost_aware" else None
    made = RowSchedules(config.schedule, rows, gate)
    schedules = [None] * len(links)
    bottom = len(links) - 1
    if links[bottom].runner is None:
        # a Drafter sets its own length; the cost-aware schedule caps it (and can sit it out) by how
        # often the level above accepts its drafts
        if config.schedule == "cost_aware":
            schedules[bottom] = made.for_level(MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, links[bottom - 1].share, bottom == 1,
                                               per_token=False)
        level = parts.drafter_level(models[bottom], rules, stats.levels[bottom], clock, schedules[bottom])
    else:
        # below a greedy intermediate level, sampled drafts would only lower its acceptance
        samples = do_sample and not (config.verification == "greedy" and bottom > 1)
        schedules[bottom] = made.for_level(config.num_draft_tokens, MAX_DRAFT_TOKENS, links[bottom - 1].share,
                                           bottom == 1, step_seconds=links[bottom].step(count),
                                           pair=(models[bottom], models[bottom - 1]), sampled=samples)
        level = parts.model_drafter(links[bottom].runner, rules, stats.levels[bottom], schedules[bottom], samples, clock)
    # a PromptLookup the config added below the bottom model (drafting K tokens, `with_prompt_lookup`):
    # that model is an intermediate level now, with the config's last mu
    added = int(isinstance(models[bottom], AddedPromptLookup))
    thresholds = config.thresholds_for(bottom - 1 - added)
    thresholds += (thresholds[-1] if thresholds else config.last_threshold,) * added
    shape_gates: dict[int, ShapeGate] = {}
    samples = do_sample and config.verification != "greedy"
    for index in range(bottom - 1, 0, -1):  # intermediate levels, bottom-up
        verifier = parts.verifier(links[index].runner, level, rules, stats.levels[index], samples, clock)
        # its T(1) is what a token costs until its rounds are timed (they may emit several per
        # forward, so it does not rule the level out up front)
        schedules[index] = made.for_level(thresholds[index - 1], MAX_BLOCK_THRESHOLD, links[index - 1].share,
                                          index == 1, step_seconds=links[index].step(count), static_check=False,
                                          pair=(models[index], models[index - 1]),
                                          sampled=do_sample if index == 1 else samples)
        shape = {}
        if index == bottom - 1 and all(link.estimate is not None for link in links[index - 1 : bottom + 1]):
            shape = _shape_gate(links[index - 1 : bottom + 1], index == 1, made, config, parts, rules,
                                stats.levels[index], samples, clock, count, do_sample)
            shape_gates[index] = shape["shape_gate"]
        level = parts.intermediate(verifier, schedules[index], clock, **shape)
    top = parts.verifier(links[0].runner, level, rules, stats.levels[0], do_sample, clock)
    _offer_alternatives(top, level, links[0], config, do_sample)
    return Chain(top, stats, [link.runner for link in links], schedules, [link.estimate for link in links], gate,
                 shape_gates, made)


def alternatives_problem(level, target_runner, do_sample: bool) -> str | None:
    """Why the target cannot score the drafter's alternatives beside its drafts
    (`hf_polybasic.decoding.alternatives`), or None."""
    if do_sample:
        return "they are for greedy decoding (do_sample=False)"
    if not drafters_under_target(level):
        return ("they need a model drafter that proposes to the target (a chain of two models, or of three "
                "under the cost-aware schedule, whose gate may bypass the middle level or drop the drafter)")
    if levels_round.reads_wait(target_runner.device):  # as the round reads (tests emulate a GPU's)
        return "they run where reads do not wait for the device (the CPU)"
    if not getattr(target_runner, "scores_alternatives", False):
        return (f"the target's runner ({runner_kind(target_runner)}, {target_runner.rows} row(s)) cannot: it needs one "
                "row on a DynamicCache, sdpa or eager attention, no windowed layers and no draft head reading it")
    return None


def _offer_alternatives(top: Verifier, level, target: _Link, config: PolybasicConfig, do_sample: bool) -> None:
    """Let the target score the drafter's next-best tokens beside its drafts where it can: every round with
    a count the user set (refused with the reason where it cannot), or under ``"auto"`` where the target's
    measured costs say it pays (`hf_polybasic.decoding.alternatives.AlternativesPolicy`)."""
    asked = config.draft_alternatives
    if asked == 0:
        return
    problem = alternatives_problem(level, target.runner, do_sample)
    if problem is not None:
        if asked != "auto":
            raise ValueError(f"PolybasicConfig.draft_alternatives={asked}: {problem}; use 'auto' or 0")
        return
    auto = asked == "auto"
    if auto and target.estimate is None:
        return  # unpriced (another schedule): nothing says the wider forward pays
    count = DEFAULT_ALTERNATIVES if auto else asked
    top.alternatives = AlternativesPolicy(count, auto, None if target.estimate is None else target.estimate.seconds)
    for drafter in drafters_under_target(level):
        drafter.alternatives = count


def drafters_under_target(level) -> list[ModelDrafter]:
    """The model drafters whose proposals reach the target straight from ``level``, the level under it: the
    level itself, or a shape gate's drafter in the rounds it bypasses the middle level and the middle
    model drafting in those it drops the drafter (an intermediate level's own blocks carry none). The
    drafter of a gated chain then also offers its alternatives to the middle level, which does not
    score them (a next-best pick per drafted token)."""
    if isinstance(level, ModelDrafter):
        return [level]
    if isinstance(level, IntermediateLevel) and level.shape_gate is not None:
        return [drafter for drafter in (level.verifier.child, level.drop_drafter) if isinstance(drafter, ModelDrafter)]
    return []


def _shape_gate(links: list[_Link], under_target: bool, made: RowSchedules, config: PolybasicConfig,
                parts: ChainParts, rules, stats: LevelStats, samples: bool, clock: Clock, rows: int,
                do_sample: bool = False) -> dict:
    """What a middle level right above a model drafter takes for its shape gate (``links``: the level
    above, the middle, the drafter). It takes part only while Theorem 3.2 says it pays; when bypassed, the
    drafter proposes to the level above under schedules priced by that level's costs; and the drafter only
    while the middle model drafting alone to the level above is not faster: then that model drafts under
    schedules priced by the level above's costs, with a calibration of its own (kept for this chain:
    `calibration.remembered`, ``within``). ``samples``: intermediate levels verify by sampling;
    ``do_sample``: the target does."""
    above, middle, drafter = links
    sampled = do_sample if under_target else samples  # how the level above accepts
    level_costs = (above.share.seconds, middle.share.seconds, drafter.share.seconds)
    drop_schedules = made.for_level(config.num_draft_tokens, MAX_DRAFT_TOKENS, above.share, under_target,
                                    step_seconds=middle.step(rows), pair=(middle.model, above.model),
                                    within=(drafter.model,), sampled=sampled)
    return dict(shape_gate=ShapeGate(level_costs, models=(above.model, middle.model, drafter.model), drops=True),
                bypass_schedules=made.for_level(config.num_draft_tokens, MAX_DRAFT_TOKENS, above.share, under_target,
                                                step_seconds=drafter.step(rows), pair=(drafter.model, above.model),
                                                sampled=sampled),
                drop_drafter=parts.model_drafter(middle.runner, rules, stats, drop_schedules, samples, clock))
