"""The decode loop: the target's verifications, emission and stopping, for a batch of rows.

The target is the top `hf_polybasic.chain.Verifier`; each `verify` is one target forward pass over
every live row's proposal. This module is the only place tokens are emitted and stopping is
decided: each row's emitted tokens are checked against the stopping criteria one by one, so EOS,
`stop_strings` and custom criteria stop a row at the same token as plain `generate`, even in the
middle of a round, and the length budget is never exceeded because no level proposes past it.
A row that stops leaves the batch's work (it is asked for nothing more). After every round each
cache holds at most each row's output minus its last token (exactly that, except that a hybrid
model's may hold fewer: `hf_polybasic.recurrent`), and a returned ``past_key_values`` holds exactly
that (transformers' convention), so it can be continued.

Rows are decoded together, each without its left padding (its own positions, processors shifted
accordingly), so each is exactly as if it had been generated alone; models with sliding-window
attention or recurrent layers and Drafters that keep state decode a batch row by row instead (`batchable`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from .cache import supports_rows
from .recurrent import batch_refusal_reason, settle
from .chain import ChainParts, Verifier, build_chain
from .costs import CostCurves
from .drafters import Drafter
from .processing import DecodingRules, processors_for_row
from .request import Request
from .schedule import BatchGate
from .stats import PolybasicStats
from .timing import DEFAULT_CLOCK, Clock, timed
from .vocabulary import warn_if_levels_disagree


@dataclass
class RowResult:
    """New tokens of one row plus, when requested, the target's rows for each of them."""

    tokens: torch.LongTensor  # [m]
    scores: list[torch.Tensor] = field(default_factory=list)  # m x [V] processed
    logits: list[torch.Tensor] = field(default_factory=list)  # m x [V] raw


def decode(
    top: Verifier,
    prompts: dict[int, torch.LongTensor],
    max_lengths: dict[int, int],
    stopping_criteria: StoppingCriteriaList,
    request: Request,
    gate: BatchGate | None = None,
    clock: Clock = DEFAULT_CLOCK,
) -> dict[int, RowResult]:
    """Generate after each row's prompt ``[L]`` until a stopping criterion fires or its
    ``max_length`` tokens; the rows share every round. ``gate`` (a batch's) learns what each round
    yielded and took."""
    sequences = dict(prompts)
    results = {row: RowResult(tokens=prompt.new_empty(0)) for row, prompt in prompts.items()}
    finished: set[int] = set()
    while live := [row for row in prompts if row not in finished and sequences[row].shape[0] < max_lengths[row]]:
        started = clock()
        rounds = top.verify({row: (sequences[row], max_lengths[row] - sequences[row].shape[0]) for row in live})
        kept = {}
        for row, round_ in rounds.items():
            kept[row] = round_.tokens.shape[0]
            for j in range(kept[row]):
                grown = torch.cat([sequences[row], round_.tokens[: j + 1]]).unsqueeze(0)
                if bool(stopping_criteria(grown, round_.scores[j : j + 1]).any()):
                    kept[row] = j + 1
                    finished.add(row)
                    break
            sequences[row] = torch.cat([sequences[row], round_.tokens[: kept[row]]])
        # a stop inside the round leaves accepted drafts past the output in the caches: cut them, so
        # every cache holds the output minus its last token when committed
        top.rollback_to({row: sequences[row].shape[0] - 1 for row in rounds})
        top.commit()
        for row, round_ in rounds.items():
            if request.streamer is not None:
                request.streamer.put(round_.tokens[: kept[row]].cpu())
            if request.keep_scores:
                results[row].scores.extend(round_.scores[: kept[row]].unbind(0))
            if request.keep_logits:
                results[row].logits.extend(round_.logits[: kept[row]].unbind(0))
        if gate is not None:
            gate.observe_round(sum(kept.values()), clock() - started, len(live))
    for row, prompt in prompts.items():
        results[row].tokens = sequences[row][prompt.shape[0] :]
    return results


def batchable(target: torch.nn.Module, assistants: list) -> bool:
    """Whether the rows of a batch can share forwards: every model without sliding-window attention
    (`hf_polybasic.cache.supports_rows`) or recurrent layers (`hf_polybasic.recurrent.batch_refusal_reason`),
    and a bottom `Drafter`, if any, without per-row state."""
    for model in [target, *assistants]:
        if isinstance(model, Drafter):
            if not getattr(model, "stateless", False):
                return False
        elif not supports_rows(model) or batch_refusal_reason(model) is not None:
            return False
    return True


_warned_row_by_row = False


def decode_rows(
    target: torch.nn.Module,
    request: Request,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    parts: ChainParts = ChainParts(),
    clock: Clock = DEFAULT_CLOCK,
    costs: CostCurves | None = None,
) -> tuple[list[RowResult], PolybasicStats]:
    """Decode the request's rows, together where they can share forwards (`batchable`), else one by
    one; the rows' results and the call's statistics. ``costs`` are the cost curves the cost-aware
    schedule uses (and refreshes)."""
    global _warned_row_by_row
    rows = list(range(len(request.rows)))
    groups = [rows]
    if len(rows) > 1 and (request.caches[0] is None or not batchable(target, request.assistants)):
        groups = [[row] for row in rows]
        if not _warned_row_by_row:
            _warned_row_by_row = True
            warnings.warn(
                "hf_polybasic decodes this batch row by row (one forward per row): a model of the chain has "
                "sliding-window attention or recurrent layers, a Drafter keeps state, or use_cache=False. Rows of "
                "other chains share each forward.",
                UserWarning,
                stacklevel=4,
            )
    results, total = {}, None
    is_model = [True] + [not isinstance(m, Drafter) for m in request.assistants]
    for group in groups:
        stats = _decode_group(target, request, processors, stopping_criteria, parts, clock, costs, group, results)
        warn_if_levels_disagree(stats, is_model)
        if total is None:
            total = stats
        else:
            total.merge(stats)
    return [results[row] for row in rows], total


def _shares_prompts(prompts: dict[int, torch.LongTensor], repeats: int) -> bool:
    """Whether the rows come in groups of ``repeats`` identical prompts of 2 tokens or more."""
    rows = sorted(prompts)
    return len(rows) % repeats == 0 and all(
        prompts[row].shape[0] >= 2 and torch.equal(prompts[row], prompts[row - row % repeats]) for row in rows
    )


def _decode_group(target, request, processors, stopping_criteria, parts, clock, costs, group, results):
    """Decode the rows of ``group`` together with one chain; their results go into ``results``."""
    rules, prompts, max_lengths = {}, {}, {}
    for index, row in enumerate(group):
        prompt = request.rows[row]
        removed_padding = request.padded_width - prompt.shape[0]
        rules[index] = DecodingRules(
            processors_for_row(processors, row, prompt, removed_padding), request.do_sample, request.eos_token_ids
        )
        prompts[index] = prompt
        max_lengths[index] = request.max_length - removed_padding
    cache = request.caches[group[0]] if len(group) == 1 else request.caches[0]
    chain = build_chain(target, request.assistants, request.config, rules, cache, parts, clock, costs)
    with timed(clock) as span:
        if len(group) > 1 and request.repeats > 1 and _shares_prompts(prompts, request.repeats):
            for runner in chain.runners:  # num_return_sequences: each prompt is computed once
                if runner is not None:
                    runner.prefill_repeated(prompts, request.repeats)
        decoded = decode(chain.top, prompts, max_lengths, stopping_criteria, request, chain.gate, clock)
        if request.given_cache is not None and len(group) == 1:  # handed back: a hybrid's may hold fewer tokens
            settle(chain.runners[0], torch.cat([prompts[0], decoded[0].tokens]))
    stats = chain.finish(costs)
    for index, row in enumerate(group):
        results[row] = decoded[index]
    stats.seconds, stats.new_tokens = span.seconds, sum(int(result.tokens.shape[0]) for result in decoded.values())
    return stats
