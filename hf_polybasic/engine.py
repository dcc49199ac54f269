"""The decode loop: the target's verifications, emission and stopping, row by row.

The target is the top `hf_polybasic.chain.Verifier`; each `verify` is one target forward pass over
the proposal the chain below produced. This module is the only place tokens are emitted and
stopping is decided: emitted tokens are checked against the stopping criteria one by one, so EOS,
`stop_strings` and custom criteria stop generation at the same token as plain `generate`, even in
the middle of a round, and the length budget is never exceeded because no level proposes past it.
After every round each cache holds exactly the output minus its last token (transformers'
convention), so a returned ``past_key_values`` can be continued.

Batches are decoded row by row (`decode_rows`), each row exactly as if it had been generated
alone: without its left padding, with the processors shifted accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from .chain import ChainParts, Verifier, build_chain
from .costs import CostCurves
from .drafters import Drafter
from .processing import DecodingRules, processors_for_row
from .request import Request
from .stats import PolybasicStats
from .timing import DEFAULT_CLOCK, Clock, timed
from .vocabulary import warn_if_levels_disagree


@dataclass
class RowResult:
    """New tokens of one row plus, when requested, the target's rows for each of them."""

    tokens: torch.LongTensor  # [m]
    scores: list[torch.Tensor] = field(default_factory=list)  # m x [V] processed
    logits: list[torch.Tensor] = field(default_factory=list)  # m x [V] raw


def decode_row(
    top: Verifier, prompt: torch.LongTensor, max_length: int, stopping_criteria: StoppingCriteriaList, request: Request
) -> RowResult:
    """Generate after ``prompt`` ``[L]`` until a stopping criterion fires or ``max_length`` tokens."""
    sequence = prompt
    result = RowResult(tokens=prompt.new_empty(0))
    finished = False
    while not finished and sequence.shape[0] < max_length:
        round_ = top.verify(sequence, max_length - sequence.shape[0])
        keep = round_.tokens.shape[0]
        for j in range(keep):
            grown = torch.cat([sequence, round_.tokens[: j + 1]]).unsqueeze(0)
            if bool(stopping_criteria(grown, round_.scores[j : j + 1]).any()):
                keep, finished = j + 1, True
                break
        sequence = torch.cat([sequence, round_.tokens[:keep]])
        # a stop inside the round leaves accepted drafts past the output in the caches: cut them, so
        # every cache holds the output minus its last token when committed
        top.rollback_to(sequence.shape[0] - 1)
        top.commit()
        if request.streamer is not None:
            request.streamer.put(round_.tokens[:keep].cpu())
        if request.keep_scores:
            result.scores.extend(round_.scores[:keep].unbind(0))
        if request.keep_logits:
            result.logits.extend(round_.logits[:keep].unbind(0))
    result.tokens = sequence[prompt.shape[0] :]
    return result


def decode_rows(
    target: torch.nn.Module,
    request: Request,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    parts: ChainParts = ChainParts(),
    clock: Clock = DEFAULT_CLOCK,
    costs: CostCurves | None = None,
) -> tuple[list[RowResult], PolybasicStats]:
    """Decode each row with a chain of its own; the rows' results and their summed statistics.
    ``costs`` are the cost curves the cost-aware schedule uses (and refreshes)."""
    results, total = [], None
    warned = False  # about levels that disagree: once per call
    is_model = [True] + [not isinstance(m, Drafter) for m in request.assistants]
    for index, (row, cache) in enumerate(zip(request.rows, request.caches)):
        removed_padding = request.padded_width - row.shape[0]
        rules = DecodingRules(
            processors_for_row(processors, index, row, removed_padding), request.do_sample, request.eos_token_ids
        )
        chain = build_chain(target, request.assistants, request.config, rules, cache, parts, clock, costs)
        with timed(clock) as span:
            result = decode_row(chain.top, row, request.max_length - removed_padding, stopping_criteria, request)
        stats = chain.finish(costs)
        stats.seconds, stats.new_tokens = span.seconds, int(result.tokens.shape[0])
        results.append(result)
        warned = warned or warn_if_levels_disagree(stats, is_model)
        if total is None:
            total = stats
        else:
            total.merge(stats)
    return results, total
