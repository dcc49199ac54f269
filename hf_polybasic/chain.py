"""The recursive chain, as transformers `CandidateGenerator`s.

A chain M1 > M2 > ... > Mn is built recursively:

* the bottom model Mn is a `ModelDrafter`: it drafts K tokens autoregressively from its processed
  distribution;
* every model above it is a `VerifyingLevel` over the level below: one forward pass scores a whole
  draft, `hf_polybasic.verify` decides what is accepted, and an intermediate level repeats this
  until it holds mu verified tokens, which it hands up as *its* draft, together with the processed
  distribution each token was drawn from. The target M1 is a `VerifyingLevel` too; the engine just
  runs one round of it at a time and appends the result to the output.

Why the chain is lossless: by `hf_polybasic.verify`, the tokens a verifying level emits are an
autoregressive sample of its own processed distribution p_i (greedy: its argmax continuation),
whatever the level below proposed. So the block M_i hands up really is drawn from the q = p_i it
reports, which is exactly what the level above needs for its own verification to be exact. By
induction up the chain, the target emits a sample of its processed distribution (greedy: its own
greedy output), for any number of levels, any K and any mu.

Protocol (transformers' `CandidateGenerator`, plus two methods): ``get_candidates(input_ids,
max_new_tokens)`` returns the full sequence ``[1, L + m]`` and the proposal log-probabilities
``[1, m, V]`` (or None for a point mass); ``update_candidate_strategy(input_ids, scores,
num_matches)`` tells the level how many of its m tokens the level above accepted;
``rollback_to(length)`` and ``commit()`` move down the chain to every cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation import CandidateGenerator, LogitsProcessorList

from .cache import CachedModel
from .processing import process_positions
from .schedule import ProposalSchedule
from .stats import LevelStats
from .verify import greedy_verify, speculative_verify


@dataclass(frozen=True)
class DecodingRules:
    """What every level shares: the prepared processors and how tokens are chosen.

    Attributes:
        processors: the `LogitsProcessorList` `generate` prepared for the target.
        do_sample: draw tokens (True) or take the argmax (False).
        eos_token_ids: ids that end generation; blocks stop right after one.
    """

    processors: LogitsProcessorList
    do_sample: bool
    eos_token_ids: frozenset[int]


@dataclass
class Round:
    """The result of one verification: the tokens emitted and their target rows.

    tokens: [m] emitted ids (accepted drafts, then the verifier's own token);
    scores: [m, V] processed scores they were chosen from; logits: [m, V] raw logits.
    """

    tokens: torch.LongTensor
    scores: torch.Tensor
    logits: torch.Tensor
    num_accepted: int


def length_through_eos(tokens: torch.LongTensor, eos_token_ids: frozenset[int]) -> int:
    """Number of tokens to keep: up to and including the first EOS, else all."""
    for index, token in enumerate(tokens.tolist()):
        if token in eos_token_ids:
            return index + 1
    return tokens.shape[0]


class ChainLevel(CandidateGenerator):
    """A level of a chain: a candidate generator whose state the level above can roll back.

    Subclasses set ``_prefix_length`` (the length of the sequence given to the last
    `get_candidates`) and implement `rollback_to` and `commit`.
    """

    _prefix_length = 0
    # how many tokens this level proposes per round; None: fixed by the level itself
    schedule: ProposalSchedule | None = None

    def update_candidate_strategy(self, input_ids, scores, num_matches: int) -> None:
        """The level above kept ``num_matches`` of the tokens of the last `get_candidates`."""
        self.rollback_to(self._prefix_length + num_matches)

    def rollback_to(self, length: int) -> None:
        """Forget everything about tokens past ``length``, here and in every level below."""
        raise NotImplementedError

    def commit(self) -> None:
        """Everything so far is final (the target has verified it), here and below."""
        raise NotImplementedError


class ModelDrafter(ChainLevel):
    """Bottom level: drafts up to K tokens with a model, sampling from (or taking the argmax of)
    its processed distribution; stops early after an EOS.

    ``greedy_drafts`` drafts by argmax even when sampling (for a parent that verifies greedily);
    the proposal is then a point mass and reported as None.
    """

    def __init__(
        self,
        runner: CachedModel,
        rules: DecodingRules,
        num_draft_tokens: int,
        stats: LevelStats,
        greedy_drafts: bool = False,
        schedule: ProposalSchedule | None = None,
    ):
        self.runner = runner
        self.rules = rules
        self.stats = stats
        self.samples = rules.do_sample and not greedy_drafts
        self.schedule = schedule or ProposalSchedule("constant", num_draft_tokens, num_draft_tokens)

    def get_candidates(self, input_ids: torch.LongTensor, max_new_tokens: int | None = None):
        started = time.perf_counter()
        length = self.schedule.length()
        limit = length if max_new_tokens is None else min(length, max_new_tokens)
        self._prefix_length = input_ids.shape[1]
        sequence = input_ids
        log_probs = []
        for _ in range(limit):
            logits = self.runner.next_token_logits(sequence, 1).to(sequence.device)  # [1, V]
            scores = process_positions(self.rules.processors, sequence, sequence.shape[1], logits)
            probs = scores.softmax(-1) if self.samples or self.schedule.stops_per_token else None
            if self.samples:
                log_probs.append(self.proposal_log_probs(scores, logits))
                token = torch.multinomial(probs, 1)  # [1, 1]
            else:
                token = scores.argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token.to(sequence.device)], dim=1)
            if int(token) in self.rules.eos_token_ids:
                break
            # the token just drawn is kept whatever it is; only whether to draw another depends on it
            if self.schedule.stops_per_token and not self.schedule.keep_drafting(float(probs[0, int(token)])):
                break
        drafted = sequence.shape[1] - input_ids.shape[1]
        elapsed = time.perf_counter() - started
        self.schedule.observe_proposal(drafted, elapsed)
        self.stats.proposed += drafted
        self.stats.forward_passes = self.runner.forward_passes
        self.stats.seconds += elapsed
        proposal = torch.cat(log_probs, dim=0).unsqueeze(0) if log_probs else None
        return sequence, proposal

    @staticmethod
    def proposal_log_probs(scores: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The q reported upward: the processed distribution the token was drawn from (not the raw
        logits, which would make the chain lossy under top-k/top-p/temperature)."""
        return scores.log_softmax(-1)

    def rollback_to(self, length: int) -> None:
        self.runner.rollback_to(length)

    def commit(self) -> None:
        self.runner.commit()


class VerifyingLevel(ChainLevel):
    """A model that verifies the stream of the level below it.

    As an intermediate level (``block_threshold`` = mu, or a ``schedule`` that varies it) it is
    itself a candidate generator for the level above; as the target (neither given) the engine
    calls `verify_round` directly. After each verification it reports the outcome to the child's
    schedule.
    ``greedy_proposals`` makes it verify by argmax and hand up a point mass even when sampling.
    """

    def __init__(
        self,
        runner: CachedModel,
        child: ChainLevel,
        rules: DecodingRules,
        stats: LevelStats,
        block_threshold: int | None = None,
        greedy_proposals: bool = False,
        schedule: ProposalSchedule | None = None,
    ):
        self.runner = runner
        self.child = child
        self.rules = rules
        self.stats = stats
        if schedule is None and block_threshold is not None:
            schedule = ProposalSchedule("constant", block_threshold, block_threshold)
        self.schedule = schedule
        self.samples = rules.do_sample and not greedy_proposals

    # --- one verification --------------------------------------------------------------------
    def verify_round(self, sequence: torch.LongTensor, max_new_tokens: int) -> Round:
        """Ask the child for a draft, verify it in one forward pass, roll back what was rejected.

        Emits between 1 and ``max_new_tokens`` tokens (the child drafts at most one fewer).
        """
        candidates, proposal_log_probs = self.child.get_candidates(sequence, max_new_tokens=max_new_tokens - 1)
        started = time.perf_counter()
        prefix_length = sequence.shape[1]
        draft = candidates[0, prefix_length:]  # [k]
        num_drafted = draft.shape[0]
        logits = self.runner.next_token_logits(candidates, num_drafted + 1).to(sequence.device)  # [k+1, V]
        scores = process_positions(self.rules.processors, candidates, prefix_length, logits)  # [k+1, V]
        if self.samples:
            draft_probs = None if proposal_log_probs is None else proposal_log_probs[0].to(scores.device).exp()
            num_accepted, next_token = speculative_verify(draft, draft_probs, scores.softmax(-1))
        else:
            num_accepted, next_token = greedy_verify(draft, scores)
        self.stats.record_verification(num_drafted, num_accepted)
        self.runner.rollback_to(prefix_length + num_accepted)
        self.stats.forward_passes = self.runner.forward_passes
        elapsed = time.perf_counter() - started
        self.stats.seconds += elapsed
        if self.child.schedule is not None:
            self.child.schedule.observe_verification(num_drafted, num_accepted, elapsed)
        self.child.update_candidate_strategy(candidates, scores, num_accepted)
        tokens = torch.cat([draft[:num_accepted], draft.new_tensor([next_token])])
        kept = num_accepted + 1
        return Round(tokens=tokens, scores=scores[:kept], logits=logits[:kept], num_accepted=num_accepted)

    # --- as a candidate generator for the level above ----------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, max_new_tokens: int | None = None):
        """Verified tokens until the block holds at least mu of them (or EOS / the budget)."""
        if max_new_tokens is None:
            raise ValueError("VerifyingLevel.get_candidates needs max_new_tokens (the remaining length budget)")
        if self.schedule is None:
            raise ValueError("the target level has no block threshold: call verify_round, not get_candidates")
        started = time.perf_counter()
        threshold = self.schedule.length()
        self._prefix_length = input_ids.shape[1]
        sequence = input_ids
        log_probs = []
        while sequence.shape[1] - input_ids.shape[1] < min(threshold, max_new_tokens):
            budget = max_new_tokens - (sequence.shape[1] - input_ids.shape[1])
            round_ = self.verify_round(sequence, budget)
            keep = length_through_eos(round_.tokens, self.rules.eos_token_ids)
            sequence = torch.cat([sequence, round_.tokens[:keep].unsqueeze(0)], dim=1)
            if self.samples:
                log_probs.append(round_.scores[:keep].log_softmax(-1))
            if int(sequence[0, -1]) in self.rules.eos_token_ids:
                break
        self.stats.proposed += sequence.shape[1] - input_ids.shape[1]
        self.schedule.observe_proposal(sequence.shape[1] - input_ids.shape[1], time.perf_counter() - started)
        proposal = torch.cat(log_probs, dim=0).unsqueeze(0) if log_probs else None
        return sequence, proposal

    def rollback_to(self, length: int) -> None:
        self.runner.rollback_to(length)
        self.child.rollback_to(length)

    def commit(self) -> None:
        self.runner.commit()
        self.child.commit()
