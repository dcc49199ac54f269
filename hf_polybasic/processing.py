"""Applying the `LogitsProcessorList` that `generate` prepared, at every position of a block.

Every level turns raw logits into the *processed* distribution with the same processors the target
uses in plain `generate` (temperature, top-k/p, min-p, repetition penalty, no-repeat-ngram,
min-new-tokens, ...). A processor sees the prefix its position really has: row j of a block is
processed with ``sequence[:, :start + j]``, exactly as `_sample` would have seen it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import logits_process as lp

from . import compat
from .compat import processor_for_row, processor_on_device, shift_positions

@dataclass(frozen=True)
class DecodingRules:
    """What every level of a chain shares: the prepared processors and how tokens are chosen.

    Attributes:
        processors: the `LogitsProcessorList` `generate` prepared for the target (for one row).
        do_sample: draw tokens (True) or take the argmax (False).
        eos_token_ids: ids that end generation; proposals end right after one.
    """

    processors: lp.LogitsProcessorList
    do_sample: bool
    eos_token_ids: frozenset[int]


# Processors whose output for a row depends on that row's scores only, never on input_ids. They are
# applied to all positions of a block in one call instead of one call per position.
PREFIX_FREE_PROCESSORS: tuple[type, ...] = compat.logits_processor_classes(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
)

# Processors that keep state across calls or run another model; speculative rollback would replay
# or skip their calls, so they cannot give the target's exact distribution.
STATEFUL_PROCESSORS: tuple[type, ...] = compat.logits_processor_classes(
    "ClassifierFreeGuidanceLogitsProcessor",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "SynthIDTextWatermarkLogitsProcessor",  # counts its calls and keeps a context across them
    "WhisperNoSpeechDetection",
    "DiaClassifierFreeGuidanceLogitsProcessor",
    "DiaEOSDelayPatternLogitsProcessor",
)


def processors_for_row(
    processors: lp.LogitsProcessorList, row: int, prompt: torch.LongTensor, removed_padding: int
) -> lp.LogitsProcessorList:
    """The processors for row ``row`` of a batch, decoded alone from ``prompt`` ``[L]``, which is
    ``removed_padding`` left-padding tokens shorter than the batch: processors that count absolute
    positions are shifted (`compat.shift_positions`), those that hold something per row see this
    row's (`compat.processor_for_row`: a prefix constraint's ``batch_id``, the prompt of encoder
    repetition penalties), and every tensor they hold is on the row's device (the target's)."""
    return lp.LogitsProcessorList(
        shift_positions(processor_on_device(processor_for_row(processor, row, prompt), prompt.device), removed_padding)
        for processor in processors
    )


def reject_stateful_processors(processors: lp.LogitsProcessorList) -> None:
    """Raise if a processor cannot be applied out of order (see STATEFUL_PROCESSORS)."""
    for processor in processors:
        if isinstance(processor, STATEFUL_PROCESSORS):
            raise ValueError(
                f"{type(processor).__name__} (from `guidance_scale`, `watermarking_config` with SynthID, or a "
                "model-specific option) keeps state across calls, which speculative decoding calls out of order and "
                "rolls back; remove the option or use plain generate"
            )


def process_positions(
    processors: lp.LogitsProcessorList, sequence: torch.LongTensor, start: int, logits: torch.Tensor
) -> torch.Tensor:
    """Processed scores for consecutive positions.

    sequence: [>= start + m - 1] token ids; logits: [m, V] float raw logits, where row j predicts
    the token after ``sequence[:start + j]``. Returns [m, V].
    """
    if not processors:
        return logits
    scores = logits.clone()  # user processors may work in place; raw logits are reported as they were
    num_positions = scores.shape[0]
    prefix = sequence.unsqueeze(0)  # processors take a batch of one
    for processor in processors:
        if isinstance(processor, PREFIX_FREE_PROCESSORS):
            # input_ids is ignored by these; give it a matching batch dimension anyway
            scores = processor(prefix[:, :start].expand(num_positions, -1), scores)
        else:
            scores = torch.cat([processor(prefix[:, : start + j], scores[j : j + 1]) for j in range(num_positions)], dim=0)
    return scores
