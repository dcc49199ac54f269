"""The decode loop: the target's verifications, emission and stopping, for a batch of rows.

The target is the top `hf_polybasic.decoding.round.Verifier`; each `verify` is one target forward pass over
every live row's proposal. This module is the only place tokens are emitted and stopping is
decided: each row's emitted tokens are checked against the stopping criteria one by one, so EOS,
`stop_strings` and custom criteria stop a row at the same token as plain `generate`, even in the
middle of a round, and the length budget is never exceeded because no level proposes past it.
A row that stops leaves the batch's work (it is asked for nothing more); where the call has no EOS
criterion (``eos_token_id=None``), plain batched `generate` does not pad a row a criterion stopped
but lets it go on until the last row stops, and so does `decode_rows` (`compat.pads_finished_rows`),
on a chain of its own for the rows that stopped early. After every round each
cache holds at most each row's output minus its last token (exactly that, except that a hybrid
model's may hold fewer: `hf_polybasic.runners.recurrent`), and a returned ``past_key_values`` holds exactly
that (transformers' convention), so it can be continued.

Rows are decoded together, each without its left padding (its own positions, processors shifted
accordingly), so each is exactly as if it had been generated alone; where rows cannot share
forwards exactly (windowed attention, recurrent layers, a model that takes positions from its
cache's layout, a Drafter that keeps state, ``use_cache=False``) a batch is decoded row by row,
with the reason said (`row_by_row_reason`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation import (EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria, MaxTimeCriteria,
                                     StoppingCriteriaList)

from ..compat import new_dynamic_cache, pads_finished_rows
from ..runners.recurrent import batch_refusal_reason, settle
from .build import ChainParts, build_chain, level_names
from .round import Verifier
from ..costs import CostCurves
from ..drafters import Drafter
from ..runners.probe import check_cache, rows_problem
from ..processing import DecodingRules, processors_for_row
from ..translation.level import Translated, model_of
from ..request import Request
from ..schedule import BatchGate
from ..runners.head import HeadModel
from ..runners.static import StaticRunner, capacity_for
from ..stats import PolybasicStats
from ..timing import DEFAULT_CLOCK, Clock, timed
from ..vocabulary import warn_if_levels_disagree
from ..user_warnings import warn


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
    host_stops = HostStops.of(stopping_criteria)
    while live := [row for row in prompts if row not in finished and sequences[row].shape[0] < max_lengths[row]]:
        started = clock()
        rounds = top.verify({row: (sequences[row], max_lengths[row] - sequences[row].shape[0]) for row in live})
        kept = first_stops(rounds, sequences, stopping_criteria, host_stops)
        for row, round_ in rounds.items():
            if kept[row] is None:
                kept[row] = len(round_.ids)
            else:
                finished.add(row)
            sequences[row] = torch.cat([sequences[row], round_.tokens[: kept[row]]])
        # a stop inside the round leaves accepted drafts past the output in the caches: cut them, so
        # every cache holds the output minus its last token when committed
        top.rollback_rows({row: sequences[row].shape[0] - 1 for row in rounds})
        top.commit()
        done = [row for row in rounds if row in finished or sequences[row].shape[0] >= max_lengths[row]]
        if done and len(done) < len(live):  # rows that are done leave every later forward
            top.release_rows(done)
        for row, round_ in rounds.items():
            if request.streamer is not None:
                request.streamer.put(torch.tensor(round_.ids[: kept[row]]))  # ids the host has: no read
            if request.keep_scores:
                results[row].scores.extend(round_.scores[: kept[row]].unbind(0))
            if request.keep_logits:
                results[row].logits.extend(round_.logits[: kept[row]].unbind(0))
        if gate is not None:
            gate.observe_round(sum(kept.values()), clock() - started, len(live))
    for row, prompt in prompts.items():
        results[row].tokens = sequences[row][prompt.shape[0] :]
    return results


def first_stops(rounds: dict, sequences: dict[int, torch.LongTensor], stopping_criteria: StoppingCriteriaList,
                host: HostStops | None = None) -> dict:
    """Per row, how many of its round's tokens to keep when a stopping criterion fires at one of
    them (the first that fires, counted from 1), else None. Every criterion sees each token's prefix
    and scores, as in plain `generate`; the verdicts of all rows and tokens are read back at once,
    or, where every criterion is one the host can decide from the round's ids (``host``, made once
    per call by `HostStops.of`), not read at all."""
    if host is not None:
        return {row: host.first_stop(int(sequences[row].shape[0]), round_.ids) for row, round_ in rounds.items()}
    flags, owners = [], []
    for row, round_ in rounds.items():
        for j in range(len(round_.ids)):
            grown = torch.cat([sequences[row], round_.tokens[: j + 1]]).unsqueeze(0)
            flags.append(stopping_criteria(grown, round_.scores[j : j + 1]).any().to(grown.device))
            owners.append((row, j + 1))
    stops = {row: None for row in rounds}
    for (row, count), stop in zip(owners, torch.stack(flags).tolist() if flags else []):
        if stop and stops[row] is None:
            stops[row] = count
    return stops


class HostStops:
    """Transformers' own stopping criteria that the host decides from what it knows, without reading
    the device: a length (`MaxLengthCriteria`: the prefix is at least ``max_length`` long), an end
    token (`EosTokenCriteria`: the token is one of its ids, read once per call) and a deadline
    (`MaxTimeCriteria`). Each verdict is the criterion's own on the same prefix."""

    def __init__(self, max_lengths: list[int], eos: frozenset[int], deadlines: list[tuple[float, float]]):
        self.max_lengths, self.eos, self.deadlines = max_lengths, eos, deadlines

    @classmethod
    def of(cls, criteria: StoppingCriteriaList) -> HostStops | None:
        """The host's version of ``criteria``, or None when one of them must see the device's tensors."""
        max_lengths, eos, deadlines = [], set(), []
        for criterion in criteria:
            kind = type(criterion)
            if kind is MaxLengthCriteria:
                max_lengths.append(criterion.max_length)
            elif kind is EosTokenCriteria:
                eos.update(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())  # once per call
            elif kind is MaxTimeCriteria:
                deadlines.append((criterion.initial_timestamp, criterion.max_time))
            else:
                return None
        return cls(max_lengths, frozenset(eos), deadlines)

    def first_stop(self, length: int, ids: list[int]) -> int | None:
        """How many of ``ids`` (a round's tokens after a prefix of ``length``) to keep: up to the first
        at which a criterion fires, else None."""
        late = any(time.time() - start > limit for start, limit in self.deadlines)
        for count, token in enumerate(ids, 1):
            if late or token in self.eos or any(length + count >= limit for limit in self.max_lengths):
                return count
        return None


def row_by_row_reason(target: torch.nn.Module, assistants: list, use_cache: bool = True) -> str | None:
    """Why the rows of a batch cannot share forwards, or None: without a cache each forward
    recomputes its rows' whole sequences; a `Drafter` that keeps state serves one row; a model
    with recurrent layers (`hf_polybasic.runners.recurrent.batch_refusal_reason`: a shared forward would
    advance its state over the other rows' holes) or whose rows would see each other's cache layout
    (`hf_polybasic.runners.probe.rows_problem`: windowed attention, a forward that fails on holes, or for the
    target, whose logits decide the output, positions taken from the cache's layout) decodes each
    row alone."""
    if not use_cache:
        return "use_cache=False (every forward recomputes its rows' whole sequences)"
    for model in [target, *map(model_of, assistants)]:
        if isinstance(model, Drafter):
            if not getattr(model, "stateless", False):
                return f"the Drafter {type(model).__name__} keeps state between calls (Drafter.stateless is False)"
            continue
        problem = batch_refusal_reason(model) or rows_problem(model, compare_logits=model is target)
        if problem is not None:
            return problem
    return None


_last_row_by_row_reason: str | None = None  # warned again whenever the reason changes


def _level_kind(level) -> str:
    """What a level of ``assistant_models`` is, for `warn_if_levels_disagree`'s hint."""
    if isinstance(level, Drafter):
        return "drafter"
    if isinstance(level, Translated):
        return "translated"
    return "head" if isinstance(model_of(level), HeadModel) else "model"


def _warn_row_by_row(reason: str) -> None:
    global _last_row_by_row_reason
    if reason == _last_row_by_row_reason:
        return
    _last_row_by_row_reason = reason
    warn(f"hf_polybasic decodes this batch row by row (one forward per row): {reason}. Rows of other chains share "
         "each forward.")


def decode_rows(
    target: torch.nn.Module,
    request: Request,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    parts: ChainParts = ChainParts(),
    clock: Clock = DEFAULT_CLOCK,
    costs: CostCurves | None = None,
) -> tuple[list[RowResult], PolybasicStats]:
    """Decode the request's rows, together where they can share forwards (`row_by_row_reason`),
    else one by one; the rows' results and the call's statistics. ``costs`` are the cost curves the
    cost-aware schedule uses (and refreshes). Every model that decodes on a cache is checked first
    (`hf_polybasic.runners.probe.check_cache`)."""
    use_cache = request.caches[0] is not None
    names = level_names(target, request.assistants)  # the roles the chain names its models by
    roles = [f"target {names[0]}"] + [f"assistant_models[{i}] ({names[i + 1]})" for i in range(len(request.assistants))]
    for role, model in zip(roles, [target, *request.assistants]):
        if not isinstance(model, Drafter) and (use_cache or model is not target):
            check_cache(model_of(model), role)
    rows = list(range(len(request.rows)))
    groups = [rows]
    if len(rows) > 1:
        reason = row_by_row_reason(target, request.assistants, use_cache)
        if reason is not None:
            groups = [[row] for row in rows]
            _warn_row_by_row(reason)
    results, total = {}, None
    kinds = ["model"] + [_level_kind(level) for level in request.assistants]
    for group in groups:
        stats = _decode_group(target, request, processors, stopping_criteria, parts, clock, costs, group, results)
        warn_if_levels_disagree(stats, kinds)
        if total is None:
            total = stats
        else:
            total.merge(stats)
    if not pads_finished_rows(stopping_criteria):
        # plain batched generate pads a row a criterion stopped only beside an EOS criterion; without one
        # the row goes on with its own tokens until the last row stops: rows stopped earlier go on from
        # their text to the batch's length, no criterion stopping them (a fresh chain: caches prefilled again)
        until = max(int(results[row].tokens.shape[0]) for row in rows)
        for group in groups:
            behind = [row for row in group if results[row].tokens.shape[0] < until]
            if behind:
                total.merge(_decode_group(target, request, processors, StoppingCriteriaList(), parts, clock, costs,
                                          behind, results, until=until))
    return [results[row] for row in rows], total


def _shares_prompts(prompts: dict[int, torch.LongTensor], repeats: int) -> bool:
    """Whether the rows come in groups of ``repeats`` identical prompts of 2 tokens or more."""
    rows = sorted(prompts)
    return len(rows) % repeats == 0 and all(
        prompts[row].shape[0] >= 2 and torch.equal(prompts[row], prompts[row - row % repeats]) for row in rows
    )


def _decode_group(target, request, processors, stopping_criteria, parts, clock, costs, group, results,
                  until: int | None = None):
    """Decode the rows of ``group`` together with one chain; their results go into ``results``. With
    ``until``, each row goes on from the tokens ``results`` holds for it to ``until`` new tokens."""
    rules, prompts, max_lengths, before = {}, {}, {}, {}
    for index, row in enumerate(group):
        prompt = request.rows[row]
        removed_padding = request.padded_width - prompt.shape[0]
        rules[index] = DecodingRules(
            processors_for_row(processors, row, prompt, removed_padding), request.do_sample, request.eos_token_ids
        )
        before[index] = RowResult(tokens=prompt.new_empty(0)) if until is None else results[row]
        prompts[index] = torch.cat([prompt, before[index].tokens])
        max_lengths[index] = request.max_length - removed_padding if until is None else prompt.shape[0] + until
    if until is not None:  # the target's caches hold the first part's text: decoding goes on on a fresh one
        cache = None if request.caches[0] is None else new_dynamic_cache(target)
    else:
        cache = request.caches[group[0]] if len(group) == 1 else request.caches[0]
    chain = build_chain(target, request.assistants, request.config, rules, cache, parts, clock, costs,
                        static=request.static, capacity=capacity_for(request.max_length))
    if chain.gate is not None:  # what the batch's drafter would prefill, and the budget proposals could save on
        chain.gate.budget(sum(int(prompt.shape[0]) for prompt in prompts.values()),
                          max(max_lengths[row] - int(prompts[row].shape[0]) for row in prompts))
    try:
        with timed(clock) as span:
            if len(group) > 1 and request.repeats > 1 and _shares_prompts(prompts, request.repeats):
                # num_return_sequences: each prompt is computed once; levels below the target only when the
                # batch proposes at all (a batch its gate sits out from the start never runs them)
                drafting = chain.gate is None or not chain.gate.paused
                for runner in chain.runners[: None if drafting else 1]:
                    if runner is not None:
                        runner.prefill_repeated(prompts, request.repeats)
            decoded = decode(chain.top, prompts, max_lengths, stopping_criteria, request, chain.gate, clock)
            # handed back: a hybrid's may hold fewer tokens
            if request.given_cache is not None and len(group) == 1 and until is None:
                if isinstance(chain.runners[0], StaticRunner):  # the target decoded on its own static cache
                    chain.runners[0].copy_into(request.given_cache)
                settle(chain.runners[0], torch.cat([prompts[0], decoded[0].tokens]))
    finally:
        chain.close()  # a call that raises gives its static caches back too
    stats = chain.finish(costs)
    for index, row in enumerate(group):
        first, then = before[index], decoded[index]
        results[row] = RowResult(torch.cat([first.tokens, then.tokens]), first.scores + then.scores,
                                 first.logits + then.logits)
    stats.seconds, stats.new_tokens = span.seconds, sum(int(result.tokens.shape[0]) for result in decoded.values())
    return stats
