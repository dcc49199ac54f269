"""What a call returns, in transformers' layout: sequences, or a `PolybasicGenerateOutput`.

Rows decoded one by one are re-assembled as `generate` returns a batch: the prompts as given (left
padding included), then each row's new tokens, right-padded with the pad id `generate` settled on;
scores and logits as one ``[B, V]`` tensor per generated step, zeros for rows that already stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from .compat import OUTPUT_CACHE_FIELD, prepared_pad_token_id
from .decoding.loop import RowResult
from .request import Request
from .stats import PolybasicStats
from .vocabulary import as_id_list


@dataclass
class PolybasicGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's `GenerateDecoderOnlyOutput` plus the per-level statistics of the call.

    Attributes:
        polybasic_stats: forward passes, drafted/accepted tokens, acceptance lengths and time of
            every model of the chain (see `PolybasicStats`); the same object as `last_stats(model)`.
    """

    polybasic_stats: PolybasicStats | None = None


def assemble_output(
    input_ids: torch.LongTensor, request: Request, results: list[RowResult], stats: PolybasicStats, generation_config
):
    """The sequences tensor, or with ``return_dict_in_generate`` a `PolybasicGenerateOutput`."""
    sequences = assemble_sequences(input_ids, [r.tokens for r in results], pad_token_id(generation_config))
    if not request.return_dict:
        return sequences
    return PolybasicGenerateOutput(
        sequences=sequences,
        scores=stack_per_step([r.scores for r in results], input_ids.device) if request.keep_scores else None,
        logits=stack_per_step([r.logits for r in results], input_ids.device) if request.keep_logits else None,
        polybasic_stats=stats,
        **{OUTPUT_CACHE_FIELD: request.given_cache if len(results) == 1 else None},
    )


def pad_token_id(generation_config) -> int:
    """The pad id `generate` settled on; without one, as transformers does, the first EOS id."""
    pad = prepared_pad_token_id(generation_config)
    if pad is None:
        eos = as_id_list(generation_config.eos_token_id)
        pad = eos[0] if eos else 0
    return int(pad)


def assemble_sequences(input_ids, new_tokens: list[torch.LongTensor], pad: int) -> torch.LongTensor:
    """[B, L + max_new]: the prompts as given, then each row's tokens right-padded with ``pad``."""
    width = max(t.shape[0] for t in new_tokens)
    out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + width), pad)
    out[:, : input_ids.shape[1]] = input_ids
    for b, tokens in enumerate(new_tokens):
        out[b, input_ids.shape[1] : input_ids.shape[1] + tokens.shape[0]] = tokens.to(out.device)
    return out


def stack_per_step(per_row: list[list[torch.Tensor]], device) -> tuple[torch.Tensor, ...]:
    """One [B, V] tensor per generated step on ``device`` (the input's, where `generate` keeps them),
    as HF returns scores; rows that already stopped get 0."""
    steps = max(len(rows) for rows in per_row)
    reference = next(t for rows in per_row for t in rows)
    out = []
    for step in range(steps):
        column = [rows[step] if step < len(rows) else reference.new_zeros(reference.shape) for rows in per_row]
        out.append(torch.stack(column, dim=0).to(device))
    return tuple(out)
