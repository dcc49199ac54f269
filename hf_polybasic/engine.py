"""The decode loop: build a chain for one row, run the target's verification rounds, stop exactly.

The target is the top `VerifyingLevel`; each call of `verify_round` is one target forward pass over
the block the chain below produced. Emitted tokens are checked against the stopping criteria one by
one, so EOS, `stop_strings` and custom criteria stop generation at the same token as plain
`generate`, even in the middle of a block; the length budget is never exceeded because no level
drafts past it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation import StoppingCriteriaList

from .cache import CachedModel, model_label, new_cache
from .config import MAX_BLOCK_THRESHOLD, MAX_DRAFT_TOKENS, PolybasicConfig
from .drafters import Drafter, DrafterLevel
from .chain import DecodingRules, ModelDrafter, VerifyingLevel
from .schedule import ProposalSchedule
from .stats import LevelStats, PolybasicStats


def build_chain(
    target: torch.nn.Module,
    assistant_models: Sequence[torch.nn.Module],
    config: PolybasicConfig,
    rules: DecodingRules,
    target_cache,
) -> tuple[VerifyingLevel, PolybasicStats]:
    """The recursive chain M1 > M2 > ... > Mn with a fresh cache for every assistant model.

    The bottom is a `ModelDrafter` (K autoregressive drafts) or, for a `Drafter`, a `DrafterLevel`.

    ``target_cache`` is the target's cache (None when ``use_cache=False``).
    """
    names = [
        f"M{i + 1} {repr(m) if isinstance(m, Drafter) else model_label(m)}"
        for i, m in enumerate([target, *assistant_models])
    ]
    roles = ["target"] + ["intermediate"] * (len(assistant_models) - 1) + ["drafter"]
    stats = PolybasicStats(levels=[LevelStats(name=name, role=role) for name, role in zip(names, roles)])

    vocab = target.config.get_text_config(decoder=True).vocab_size
    greedy_intermediates = config.verification == "greedy"
    bottom = assistant_models[-1]
    if isinstance(bottom, Drafter):
        level = DrafterLevel(bottom, rules.eos_token_ids, stats.levels[-1])
    else:
        level = ModelDrafter(
            CachedModel(bottom, new_cache(bottom), role=f"assistant_models[{len(assistant_models) - 1}] ({names[-1]})", vocab_limit=vocab),
            rules,
            config.num_draft_tokens,
            stats.levels[-1],
            # below a greedy intermediate level, sampled drafts would only lower its acceptance
            greedy_drafts=greedy_intermediates and len(assistant_models) > 1,
            schedule=ProposalSchedule(config.schedule, config.num_draft_tokens, MAX_DRAFT_TOKENS, stops_early=True),
        )
    thresholds = config.thresholds_for(len(assistant_models) - 1)
    for index in range(len(assistant_models) - 2, -1, -1):  # intermediate levels, bottom-up
        model = assistant_models[index]
        level = VerifyingLevel(
            CachedModel(model, new_cache(model), role=f"assistant_models[{index}] ({names[index + 1]})", vocab_limit=vocab),
            level,
            rules,
            stats.levels[index + 1],
            greedy_proposals=greedy_intermediates,
            schedule=ProposalSchedule(config.schedule, thresholds[index], MAX_BLOCK_THRESHOLD),
        )
    top = VerifyingLevel(CachedModel(target, target_cache, role=f"target {names[0]}"), level, rules, stats.levels[0])
    return top, stats


@dataclass
class RowResult:
    """New tokens of one row plus, when requested, the target's rows for each of them."""

    tokens: torch.LongTensor  # [m]
    scores: list[torch.Tensor] = field(default_factory=list)  # m x [V] processed
    logits: list[torch.Tensor] = field(default_factory=list)  # m x [V] raw


def decode_row(
    top: VerifyingLevel,
    prompt: torch.LongTensor,
    max_length: int,
    stopping_criteria: StoppingCriteriaList,
    streamer=None,
    keep_scores: bool = False,
    keep_logits: bool = False,
) -> RowResult:
    """Generate after ``prompt`` ([1, L]) until a stopping criterion fires or ``max_length``."""
    sequence = prompt
    result = RowResult(tokens=prompt.new_empty(0))
    finished = False
    while not finished and sequence.shape[1] < max_length:
        round_ = top.verify_round(sequence, max_length - sequence.shape[1])
        keep = round_.tokens.shape[0]
        for j in range(keep):
            grown = torch.cat([sequence, round_.tokens[: j + 1].unsqueeze(0)], dim=1)
            if bool(stopping_criteria(grown, round_.scores[j : j + 1]).any()):
                keep, finished = j + 1, True
                break
        tokens = round_.tokens[:keep]
        sequence = torch.cat([sequence, tokens.unsqueeze(0)], dim=1)
        # a stop inside the round leaves accepted drafts past the output in the caches: cut them, so
        # every cache holds the output minus its last token (transformers' convention) when committed
        top.rollback_to(sequence.shape[1] - 1)
        top.commit()
        if streamer is not None:
            streamer.put(tokens.cpu())
        if keep_scores:
            result.scores.extend(round_.scores[:keep].unbind(0))
        if keep_logits:
            result.logits.extend(round_.logits[:keep].unbind(0))
    result.tokens = sequence[0, prompt.shape[1] :]
    return result


def timed_decode(
    top: VerifyingLevel, stats: PolybasicStats, prompt: torch.LongTensor, **kwargs
) -> RowResult:
    """`decode_row`, filling the call-level fields of ``stats``."""
    started = time.perf_counter()
    result = decode_row(top, prompt, **kwargs)
    stats.seconds = time.perf_counter() - started
    stats.new_tokens = int(result.tokens.shape[0])
    return result
