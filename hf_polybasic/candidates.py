"""The chain below the target as transformers' own `CandidateGenerator`: `PolybasicCandidateGenerator`.

transformers' assisted loop (``GenerationMixin._assisted_decoding``) asks a candidate generator for a
block of tokens and the distributions they were drawn from (`get_candidates`), verifies the block
with one target forward, and hands back how many tokens it kept (`update_candidate_strategy`). A
chain M1 > M2 > ... > Mn already has that shape below its target: M2, the level right under the
target, proposes a block (`hf_polybasic.decoding.round`), and after the target's verdict every level
rolls back to what was kept. This module only translates between the two: no round is run here
that `hf_polybasic.decoding.round` does not run for `hf_polybasic.generate` too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from .config import PolybasicConfig
from .costs import CostCurves
from .decoding.acceptance import align_vocabulary
from .decoding.build import ChainParts, build_chain, level_names
from .decoding.protocol import Proposal
from .decoding.reads import HostRead
from .drafters import Drafter
from .processing import DecodingRules, processors_for_row
from .request import resolve_config, row_prompts, validate_assistant_models, with_added_levels
from .runners.probe import check_cache
from .runners.static import capacity_for
from .stats import PolybasicStats
from .timing import DEFAULT_CLOCK, Clock
from .vocabulary import as_id_list

__all__ = ["PolybasicCandidateGenerator"]

# what the statistics call the target's runner when transformers' loop ran it (`LevelStats.runner`)
TRANSFORMERS_LOOP = "transformers"


class PolybasicCandidateGenerator(CandidateGenerator):
    """The levels below the target (``assistant_models = [M2, ..., Mn]``) as a transformers
    `CandidateGenerator`, for one prompt (batch size 1, as transformers' assisted loop decodes).

    `get_candidates` returns the prompt and text so far followed by the block of M2, the level right
    under the target, and the distribution M2's level drew each token of it from: its processed
    distribution as float32 log-probabilities (-inf where 0), as wide as the target's vocabulary, or
    None where the block is made of point masses (greedy levels, n-gram drafts).
    `update_candidate_strategy` hands the target's verdict down: every level rolls back to the kept
    prefix, its schedules learn from what was kept and what the verification took, and what is held is
    final (``commit``).

    Why transformers' speculative sampling over it is exact, for any depth. The loop accepts draft
    x_i with probability min(1, p(x_i) / q_i(x_i)) until its first rejection, where it samples from
    norm(max(p - q_i, 0)), and samples from p past a fully accepted block (Leviathan et al., Theorem
    1). Its output is distributed as the target's processed p if two conditions hold:

    1. **The reported distribution is the one each token was sampled from**, given everything decided
       before it: q_i = P(x_i = . | the text, x_<i). By induction down the chain
       (`hf_polybasic.decoding.round`), the tokens M2's level hands up are an autoregressive sample
       of M2's own processed distribution p2, whatever the levels below proposed; so q_i is p2 at
       position i, which its `Proposal` carries (its scores after the target's processors). The
       bottom drafter's distribution would not do: M2 keeps drafts that lean towards min(p2, q3) and
       corrects the rest from a residual. Where the block is made of point masses (greedy levels,
       n-gram drafters) there is no q: None makes the loop sample p at each position and keep drafts
       while they match, which is exact for deterministic drafts. Rounds a shape gate runs without
       a level (bypassed, dropped) report what their proposer drew from, so they are exact too.
    2. **The block's length is a stopping time**: whether x_i is in the block depends only on the
       tokens up to x_i (mu, an EOS, the budget, a schedule's confidence in x_i, decisions made from
       earlier rounds), never on what follows nor on the target's verdict. Dropping a block's last
       token because of what the target later decides, or cutting a block before a token by looking
       at that token, would bias it.

    The loop's own cuts (at the first EOS and the length budget; in releases before 5.24, the token
    after a fully accepted block that reaches them) only drop tokens past where the output stops, so
    they keep it exact. Greedy (``do_sample=False``), every level proposes its own argmax
    continuation and the loop keeps drafts while they match the target's argmax: the output is
    plain greedy `generate`'s.

    Args:
        target: the model that verifies (transformers' loop runs it).
        assistant_models: the chain below it, strongest first, as for `hf_polybasic.generate`.
        input_ids: ``[1, L]`` the prompt (left padding, where ``attention_mask`` says so, is not fed
            to the levels).
        logits_processor: the `LogitsProcessorList` `generate` prepared for the target; every level
            applies it (to a row without its padding: `processors_for_row`).
        generation_config: the call's; its ``do_sample``, ``eos_token_id`` and ``max_length`` rule the
            levels.
        polybasic_config: K, mu, the schedule, as for `hf_polybasic.generate`.
        static: the call runs on static caches (``cache_implementation="static"``): every level that
            can decodes on one.
        parts: the chain's classes (`hf_polybasic.decoding.build.ChainParts`; tests inject wrong ones).
        clock: what the levels and schedules time with.
        costs: the forward-cost curves of the cost-aware schedule (None: the call's timings only).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        assistant_models: Sequence,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        generation_config: GenerationConfig,
        polybasic_config: PolybasicConfig | dict | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        static: bool = False,
        parts: ChainParts = ChainParts(),
        clock: Clock = DEFAULT_CLOCK,
        costs: CostCurves | None = None,
    ):
        _check_one_row(input_ids)
        assistants = validate_assistant_models(target, assistant_models)
        config = resolve_config(polybasic_config, generation_config)
        config.thresholds_for(len(assistants) - 1)  # a per-level mu sequence of the wrong length, before any work
        assistants = with_added_levels(assistants, config, static, bool(generation_config.do_sample))
        names = level_names(target, assistants)
        for index, model in enumerate(assistants):
            if not isinstance(model, Drafter):
                check_cache(model, f"assistant_models[{index}] ({names[index + 1]})")
        self.device = target.device
        prompt = row_prompts(input_ids, attention_mask)[0].to(self.device)
        self.padding = int(input_ids.shape[1] - prompt.shape[0])  # left padding the levels are not fed
        self.max_length = int(generation_config.max_length)
        rules = DecodingRules(processors_for_row(logits_processor, 0, prompt, self.padding),
                              bool(generation_config.do_sample), frozenset(as_id_list(generation_config.eos_token_id)))
        self.chain = build_chain(target, assistants, config, {0: rules}, None, parts, clock, costs, static=static,
                                 capacity=capacity_for(self.max_length))
        self.level = self.chain.top.child  # M2's level: the one the target verifies
        self.width = int(target.config.get_text_config(decoder=True).vocab_size)
        self.clock, self.costs = clock, costs
        self.rounds = 0
        self._proposed, self._handed = 0, 0.0

    @property
    def stats(self) -> PolybasicStats:
        """The call's statistics so far (the target's verifications included)."""
        return self.chain.stats

    def get_candidates(self, input_ids: torch.LongTensor, *args, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """``input_ids`` ``[1, L]`` (the text so far) followed by M2's block ``[1, L + k]``, and the
        distribution each block token was drawn from, ``[1, k, V]`` log-probabilities (None: point
        masses, or an empty block). The block stops one token short of the length budget: the target
        adds one of its own. Other arguments (transformers 5.0 passes ``is_first_iteration``
        positionally, 5.14 and later may pass keywords) are not needed."""
        _check_one_row(input_ids)
        sequence = input_ids[0, self.padding :].to(self.device)
        budget = self.max_length - int(input_ids.shape[1]) - 1
        proposal = settled(self.level.propose({0: (sequence, budget)}))[0]
        self._proposed = len(proposal)
        self._handed = self.clock()
        if not self._proposed:
            return input_ids, None
        candidates = torch.cat([input_ids, proposal.tokens.to(input_ids.device).unsqueeze(0)], dim=1)
        return candidates, self.candidate_logits(proposal)

    def candidate_logits(self, proposal: Proposal) -> torch.Tensor | None:
        """``[1, k, V]`` float32 log-probabilities of the distributions the block was drawn from (-inf
        where 0; transformers softmaxes them back), or None for point masses. A narrower distribution
        (a `Drafter`'s) is padded to the target's width V (`align_vocabulary`); model levels already
        report V ids."""
        if proposal.probs is None:
            return None
        return align_vocabulary(proposal.probs.float(), self.width).log().unsqueeze(0)  # [1, k, V]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int,
                                  *args, **kwargs) -> None:
        """The target kept the first ``num_matches`` tokens of the block (then added one of its
        own): the target's verification is counted, and M2's level learns it and rolls back, with
        every level below it, to the text so far minus that last token."""
        seconds = self.clock() - self._handed  # the target's verification, as transformers' loop ran it
        kept = min(int(num_matches), self._proposed)
        target = self.chain.stats.levels[0]
        target.record_verification(self._proposed, kept)
        target.seconds += seconds
        self.rounds += 1
        self.level.verified({0: kept}, seconds)
        self.level.commit()

    def finish(self) -> PolybasicStats:
        """The call is over: what every level counted (`hf_polybasic.decoding.build.Chain.finish`:
        static caches go back to their pool), the target's forwards (one per verification, by
        transformers' loop) included."""
        stats = self.chain.finish(self.costs)
        stats.levels[0].forward_passes = self.rounds
        stats.levels[0].runner = TRANSFORMERS_LOOP
        return stats


def settled(proposals: dict[int, Proposal]) -> dict[int, Proposal]:
    """``proposals`` with their ends read, where a model drafter left its read to the level above
    (`hf_polybasic.decoding.protocol.Deferred`, where reads wait for the device): transformers' loop
    reads nothing with its decision, so the drafts are read here, in one read."""
    deferred = next((proposal.deferred for proposal in proposals.values() if proposal.deferred is not None), None)
    return proposals if deferred is None else deferred.settle(HostRead(deferred.pieces).read())


def _check_one_row(input_ids: torch.LongTensor) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"PolybasicCandidateGenerator serves one prompt (batch size 1, as transformers' assisted loop decodes), "
            f"got input_ids of {input_ids.shape[0]} rows; use custom_generate=hp.generate for batches"
        )
