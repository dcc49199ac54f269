"""The recursive chain: verifiers over the level below, and how a chain is assembled.

A chain M1 > M2 > ... > Mn is built bottom-up (`build_chain`):

* the bottom is a drafter (`hf_polybasic.drafting`): a model drafting K tokens, or a `Drafter`;
* every model above it is a `Verifier` over the level below: one forward pass scores a whole
  proposal, `hf_polybasic.verify` decides what is accepted (the one place that happens), and the
  rejected tail is rolled back; an intermediate model is an `IntermediateLevel`, which repeats
  verifications until it holds mu tokens and hands them up as *its* proposal, together with the
  processed distribution each token was drawn from. The target M1 is the top `Verifier`; the engine
  runs one verification of it at a time and emits the result.

Why the chain is lossless: by `hf_polybasic.verify`, the tokens a verifier emits are an
autoregressive sample of its own processed distribution p_i (greedy: its argmax continuation),
whatever the level below proposed. So the block M_i hands up really is drawn from the q = p_i it
reports, which is exactly what the level above needs for its own verification to be exact. By
induction up the chain, the target emits a sample of its processed distribution (greedy: its own
greedy output), for any number of levels, any K and any mu.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import CachedModel, model_label
from .compat import new_dynamic_cache
from .config import MAX_BLOCK_THRESHOLD, MAX_DRAFT_TOKENS, PolybasicConfig
from .costs import CostCurves, CostEstimate
from .drafters import AddedPromptLookup, Drafter
from .drafting import DrafterLevel, ModelDrafter
from .processing import DecodingRules, process_positions
from .protocol import Block, Level, Proposal
from .schedule import Schedule, make_schedule
from .stats import LevelStats, PolybasicStats
from .timing import DEFAULT_CLOCK, Clock, timed
from .verify import greedy_verify, speculative_verify


@dataclass
class Round:
    """One verification: the tokens emitted and the verifier's rows for them.

    tokens: [m] emitted ids (accepted drafts, then the verifier's own token);
    scores: [m, V] processed scores they were chosen from; logits: [m, V] raw logits.
    """

    tokens: torch.LongTensor
    scores: torch.Tensor
    logits: torch.Tensor


class Verifier:
    """A model that verifies the proposals of the level below it.

    ``samples=False`` verifies by argmax even when the target samples (an intermediate level with
    ``verification="greedy"``).
    """

    def __init__(
        self,
        runner: CachedModel,
        child: Level,
        rules: DecodingRules,
        stats: LevelStats,
        samples: bool,
        clock: Clock = DEFAULT_CLOCK,
    ):
        self.runner, self.child, self.rules, self.stats = runner, child, rules, stats
        self.samples = samples
        self.clock = clock

    def verify(self, sequence: torch.LongTensor, budget: int) -> Round:
        """Ask the child for a proposal, score it in one forward pass, keep what is accepted.

        Emits between 1 and ``budget`` tokens (the child proposes at most one fewer).
        """
        proposal = self.child.propose(sequence, budget - 1)
        start = sequence.shape[0]
        with self.stats.timed(self.clock) as span:
            candidates = torch.cat([sequence, proposal.tokens])
            logits = self.runner.logits(candidates, len(proposal) + 1).to(sequence.device)  # [k + 1, V]
            scores = process_positions(self.rules.processors, candidates, start, logits)  # [k + 1, V]
            if self.samples:
                draft_probs = None if proposal.probs is None else proposal.probs.to(scores.device)
                accepted, next_token = speculative_verify(proposal.tokens, draft_probs, scores.softmax(-1))
            else:
                accepted, next_token = greedy_verify(proposal.tokens, scores)
            self.stats.record_verification(len(proposal), accepted)
            self.runner.rollback_to(start + accepted)
        self.child.verified(accepted, span.seconds)
        tokens = torch.cat([proposal.tokens[:accepted], proposal.tokens.new_tensor([next_token])])
        return Round(tokens=tokens, scores=scores[: accepted + 1], logits=logits[: accepted + 1])

    def rollback_to(self, length: int) -> None:
        """Forget everything about tokens past ``length``, here and in every level below."""
        self.runner.rollback_to(length)
        self.child.rollback_to(length)

    def commit(self) -> None:
        """Everything so far is final (the target has verified it), here and below."""
        self.runner.commit()
        self.child.commit()


class IntermediateLevel:
    """A `Verifier` that the level above uses as its proposer: it verifies rounds of the level
    below until its block holds at least mu tokens (the schedule's length), an EOS or the budget.

    Each round asks its verifier for one token more than the block has room for, so the level below
    drafts up to the budget (in a chain of n models every level drafts as soon as 2 tokens remain);
    `Block.extend` cuts the surplus, which can only be the verifier's own token (the cut block is
    still an autoregressive sample of this level's distribution, and its cache never held that token).
    """

    def __init__(self, verifier: Verifier, schedule: Schedule, clock: Clock = DEFAULT_CLOCK):
        self.verifier, self.schedule, self.clock = verifier, schedule, clock
        self.stats = verifier.stats
        self._start = 0
        self._proposed = 0

    def propose(self, sequence: torch.LongTensor, budget: int) -> Proposal:
        threshold = self.schedule.length()
        block = Block(self.verifier.rules.eos_token_ids, budget, sequence.device)
        self._start = sequence.shape[0]
        stops_per_token = self.schedule.stops_per_token
        with timed(self.clock) as span:  # this level and everything below: what the block cost
            while not block.closed and block.size < threshold:
                # one more than the block can take: the level below may then draft up to the budget,
                # and only the verifier's own last token (free from the same forward) can be cut
                round_ = self.verifier.verify(torch.cat([sequence, block.tokens]), budget - block.size + 1)
                probs = round_.scores.softmax(-1) if self.verifier.samples or stops_per_token else None
                before = block.size
                kept = block.extend(round_.tokens, probs if self.verifier.samples else None)
                if stops_per_token and self._stop_within(block, before, round_.tokens[:kept], probs[:kept]):
                    break
        proposal = block.proposal()
        self._proposed = len(proposal)
        self.stats.proposed += len(proposal)
        self.schedule.observe_proposal(len(proposal), span.seconds)
        return proposal

    def _stop_within(self, block: Block, before: int, tokens: torch.LongTensor, probs: torch.Tensor) -> bool:
        """Ask the schedule, token by token, whether to go on after each new token (its confidence:
        this level's probability of it); on the first no, end the block right after that token."""
        confidences = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        for index, confidence in enumerate(confidences):
            if not block.closed and not self.schedule.keep_drafting(confidence):
                block.truncate(before + index + 1)
                return True
        return False

    def verified(self, kept: int, seconds: float) -> None:
        self.schedule.observe_verification(self._proposed, kept, seconds)
        self.rollback_to(self._start + kept)

    def rollback_to(self, length: int) -> None:
        self.verifier.rollback_to(length)

    def commit(self) -> None:
        self.verifier.commit()


@dataclass(frozen=True)
class ChainParts:
    """The classes a chain is built from. `hf_polybasic.integration.make_generate` takes another set:
    tests inject deliberately wrong levels to prove that the distribution tests can fail."""

    model_drafter: type = ModelDrafter
    drafter_level: type = DrafterLevel
    intermediate: type = IntermediateLevel
    verifier: type = Verifier


def level_names(target: torch.nn.Module, assistant_models: Sequence) -> list[str]:
    """"M1 <target class>", "M2 <class or Drafter repr>", ..., as in the statistics."""
    return [
        f"M{i + 1} {repr(m) if isinstance(m, Drafter) else model_label(m)}"
        for i, m in enumerate([target, *assistant_models])
    ]


@dataclass
class Chain:
    """A built chain: its top `Verifier` (the target), the call's statistics, and per level its
    model runner (None for a `Drafter`), schedule (None for the target and a `Drafter`) and cost
    estimate (None unless the schedule is cost-aware)."""

    top: Verifier
    stats: PolybasicStats
    runners: list
    schedules: list
    estimates: list

    def finish(self, costs: CostCurves | None = None) -> PolybasicStats:
        """Fill in what the levels counted (forward passes, rounds sat out, forward costs) and let
        ``costs`` learn what the forwards of this call cost."""
        for level, runner, schedule, estimate in zip(self.stats.levels, self.runners, self.schedules, self.estimates):
            if runner is not None:
                level.forward_passes = runner.forward_passes
            if schedule is not None:
                level.paused_rounds = schedule.paused_rounds
            if estimate is not None:
                level.forward_costs = estimate.snapshot()
                if costs is not None:
                    costs.refresh(runner.model, estimate)
        return self.stats


def build_chain(
    target: torch.nn.Module,
    assistant_models: Sequence,
    config: PolybasicConfig,
    rules: DecodingRules,
    target_cache,
    parts: ChainParts = ChainParts(),
    clock: Clock = DEFAULT_CLOCK,
    costs: CostCurves | None = None,
) -> Chain:
    """The chain M1 > M2 > ... > Mn, with a fresh cache for every assistant model and the target's
    ``target_cache`` (None when ``use_cache=False``). Under the cost-aware schedule every model's
    cost curve comes from ``costs`` (measured on first use) and each schedule sees its parent's."""
    names = level_names(target, assistant_models)
    roles = ["target"] + ["intermediate"] * (len(assistant_models) - 1) + ["drafter"]
    stats = PolybasicStats(levels=[LevelStats(name=name, role=role) for name, role in zip(names, roles)])
    vocab = target.config.get_text_config(decoder=True).vocab_size
    greedy_intermediates = config.verification == "greedy"
    models = [target, *assistant_models]
    runners = [CachedModel(target, target_cache, role=f"target {names[0]}", clock=clock)] + [
        None if isinstance(model, Drafter)
        else CachedModel(model, new_dynamic_cache(model), role=f"assistant_models[{i}] ({names[i + 1]})",
                         vocab_limit=vocab, clock=clock)
        for i, model in enumerate(assistant_models)
    ]
    estimates = [None] * len(models)
    if config.schedule == "cost_aware" and costs is not None:
        for index, runner in enumerate(runners):
            curve = None if runner is None else costs.curve_for(models[index], clock, measure=config.measure_costs)
            if curve is not None:  # None: not stored and not to be measured; the schedule goes by the call's timings
                estimates[index] = runner.cost_observer = CostEstimate(curve)
    schedules = [None] * len(models)

    bottom = len(models) - 1
    if runners[bottom] is None:
        # a Drafter sets its own length; the cost-aware schedule caps it (and can sit it out) by how
        # often the level above accepts its drafts
        schedule = None if config.schedule != "cost_aware" else make_schedule(
            config.schedule, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, verifier_costs=estimates[bottom - 1]
        )
        schedules[bottom] = schedule
        level = parts.drafter_level(models[bottom], rules, stats.levels[bottom], clock, schedule)
    else:
        own = estimates[bottom]
        schedules[bottom] = make_schedule(
            config.schedule, config.num_draft_tokens, MAX_DRAFT_TOKENS, per_token=True,
            verifier_costs=estimates[bottom - 1], step_seconds=None if own is None else own.seconds(1),
        )
        # below a greedy intermediate level, sampled drafts would only lower its acceptance
        samples = rules.do_sample and not (greedy_intermediates and bottom > 1)
        level = parts.model_drafter(runners[bottom], rules, stats.levels[bottom], schedules[bottom], samples, clock)
    added = int(isinstance(models[bottom], AddedPromptLookup))  # its level above has no mu of the caller's
    thresholds = config.thresholds_for(bottom - 1 - added) + (MAX_BLOCK_THRESHOLD,) * added
    for index in range(bottom - 1, 0, -1):  # intermediate levels, bottom-up
        samples = rules.do_sample and not greedy_intermediates
        verifier = parts.verifier(runners[index], level, rules, stats.levels[index], samples, clock)
        # its T(1) is what a token costs until its rounds are timed (they may emit several per
        # forward, so it does not rule the level out up front)
        own = estimates[index]
        schedules[index] = make_schedule(
            config.schedule, thresholds[index - 1], MAX_BLOCK_THRESHOLD, per_token=True,
            verifier_costs=estimates[index - 1], step_seconds=None if own is None else own.seconds(1),
            static_check=False,
        )
        level = parts.intermediate(verifier, schedules[index], clock)
    top = parts.verifier(runners[0], level, rules, stats.levels[0], rules.do_sample, clock)
    return Chain(top, stats, runners, schedules, estimates)
