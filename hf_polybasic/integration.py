"""Entry points into `model.generate`: the `custom_generate` callable, `enable` and `disable`.

`generate` is called by transformers' own `GenerationMixin.generate` after it has prepared the
generation config, the logits processors, the stopping criteria and the length budget, so every
option users pass to `generate` means what it always means. Batches (pipelines with
``batch_size > 1``, ``num_return_sequences > 1``) are decoded row by row, each row exactly as if it
had been generated alone, and re-assembled in HF's layout: the (left-padded) prompt, then the new
tokens, right-padded with ``pad_token_id``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.generation import GenerateDecoderOnlyOutput, StoppingCriteriaList, StopStringCriteria

from .cache import new_cache
from .compat import prepared_pad_token_id, streamer_of_calling_generate, warn_if_untested
from .config import PolybasicConfig
from .drafters import Drafter
from .engine import build_chain, timed_decode
from .chain import DecodingRules
from .processing import processors_for_row, reject_stateful_processors
from .stats import PolybasicStats
from .vocabulary import as_id_list, check_chain_vocabularies, warn_if_levels_disagree

# model_kwargs that `generate` prepares and the engine understands (it recomputes positions per row)
HANDLED_MODEL_KWARGS = frozenset({"attention_mask", "past_key_values", "use_cache", "logits_to_keep", "position_ids"})
LAST_STATS_ATTRIBUTE = "_hf_polybasic_last_stats"


@dataclass
class PolybasicGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's `GenerateDecoderOnlyOutput` plus the per-level statistics of the call.

    Attributes:
        polybasic_stats: forward passes, drafted/accepted tokens, acceptance lengths and time of
            every model of the chain (see `PolybasicStats`); the same object as `last_stats(model)`.
    """

    polybasic_stats: PolybasicStats | None = None


def last_stats(model: torch.nn.Module) -> PolybasicStats | None:
    """Statistics of the most recent polybasic `generate` call on ``model`` (for tensor outputs)."""
    return getattr(model, LAST_STATS_ATTRIBUTE, None)


# --- validation ----------------------------------------------------------------------------------
def validate_assistant_models(target, assistant_models) -> list[torch.nn.Module]:
    """The chain below the target, checked: a non-empty list of compatible decoder-only models."""
    if assistant_models is None:
        raise ValueError(
            "hf_polybasic needs `assistant_models=[M2, ..., Mn]`, the models below the target, strongest first "
            "(one model gives plain two-model speculative decoding)"
        )
    if isinstance(assistant_models, torch.nn.Module) or not isinstance(assistant_models, (list, tuple)):
        raise TypeError(
            f"`assistant_models` must be a list of models, strongest first, got {type(assistant_models).__name__}; "
            "for a single assistant write assistant_models=[model]"
        )
    if not assistant_models:
        raise ValueError("`assistant_models` is empty; give at least one assistant model, e.g. assistant_models=[draft]")
    models = list(assistant_models)
    for position, model in enumerate(models):
        if isinstance(model, Drafter):
            if position != len(models) - 1:
                raise ValueError(
                    f"assistant_models[{position}] is a {type(model).__name__}, which only drafts; it must come last "
                    "(the bottom of the chain), below every model"
                )
            continue
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                f"assistant_models[{position}] must be a transformers model (nn.Module with a config) "
                f"or, last, a hf_polybasic.drafters.Drafter; got {type(model).__name__}"
            )
    chain_models = [(i, m) for i, m in enumerate(models) if not isinstance(m, Drafter)]
    for role, model in [("target", target)] + [(f"assistant_models[{i}]", m) for i, m in chain_models]:
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"{role} {type(model).__name__} is an encoder-decoder model; hf_polybasic supports decoder-only chains"
            )
    check_chain_vocabularies(target, chain_models)
    return models


def validate_generation_config(generation_config) -> None:
    """Reject options that speculative decoding cannot honour, instead of ignoring them."""
    if generation_config.num_beams is not None and generation_config.num_beams > 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams}: hf_polybasic supports greedy search and sampling, not beam search"
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            "guidance_scale (classifier-free guidance) runs a stateful processor that cannot be rolled back; "
            "it is not supported with hf_polybasic"
        )
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"):
        if getattr(generation_config, name, None):
            raise ValueError(
                f"`{name}` selects one of transformers' own assisted-generation modes, which hf_polybasic replaces; "
                "put the drafter in `assistant_models` instead"
            )


def resolve_config(polybasic_config, generation_config) -> PolybasicConfig:
    """The call's config, else the default stored in the generation config, else the defaults."""
    if polybasic_config is None:
        return PolybasicConfig.from_generation_config(generation_config) or PolybasicConfig()
    if isinstance(polybasic_config, PolybasicConfig):
        return polybasic_config
    if isinstance(polybasic_config, dict):
        return PolybasicConfig.from_dict(polybasic_config)
    raise TypeError(f"`polybasic_config` must be a PolybasicConfig or a dict, got {type(polybasic_config).__name__}")


def _row_prompts(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> list[torch.LongTensor]:
    """Each row without its left padding, as [1, L_b]."""
    if attention_mask is None:
        return [input_ids[b : b + 1] for b in range(input_ids.shape[0])]
    rows = []
    for b in range(input_ids.shape[0]):
        mask = attention_mask[b].bool()
        if bool((mask[1:].int() < mask[:-1].int()).any()) or not bool(mask[-1]):
            raise ValueError(
                "hf_polybasic needs left padding for batched prompts (attention_mask of the form 0..0 1..1); "
                "set tokenizer.padding_side = 'left'"
            )
        rows.append(input_ids[b : b + 1, int((~mask).sum()) :])
    return rows


# --- the custom_generate callable ------------------------------------------------------------------
@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    assistant_models: Sequence[torch.nn.Module] | None = None,
    polybasic_config: PolybasicConfig | dict | None = None,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs: Any,
):
    """Polybasic speculative decoding, for ``model.generate(custom_generate=generate, ...)``.

    Args:
        assistant_models: the chain below the target, strongest first: ``[M2, ..., Mn]``.
        polybasic_config: a `PolybasicConfig` (or its dict); defaults to the one stored in the
            generation config by `PolybasicConfig.save_to`, else to `PolybasicConfig()`.

    Returns what `generate` returns: a tensor, or with ``return_dict_in_generate=True`` a
    `PolybasicGenerateOutput` whose ``polybasic_stats`` holds the per-level statistics (also
    available as `last_stats(model)`).
    """
    warn_if_untested()
    if streamer is None:
        streamer = streamer_of_calling_generate()
    if synced_gpus:
        raise NotImplementedError("synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported by hf_polybasic")
    for name in ("output_attentions", "output_hidden_states"):
        if model_kwargs.get(name) or getattr(generation_config, name, False):
            raise NotImplementedError(f"`{name}=True` is not supported by hf_polybasic; use plain generate for it")
    unknown = sorted(set(model_kwargs) - HANDLED_MODEL_KWARGS - {"output_attentions", "output_hidden_states"})
    if unknown:
        raise ValueError(
            f"hf_polybasic does not support these generate arguments: {unknown} (text-only decoder inputs are supported)"
        )
    assistants = validate_assistant_models(model, assistant_models)
    return_dict = bool(generation_config.return_dict_in_generate)
    validate_generation_config(generation_config)
    config = resolve_config(polybasic_config, generation_config)
    reject_stateful_processors(logits_processor)
    config.thresholds_for(len(assistants) - 1)  # validates a per-level mu sequence before any work

    rows = _row_prompts(input_ids, model_kwargs.get("attention_mask"))
    if len(rows) > 1 and streamer is not None:
        raise ValueError("streamers support batch size 1 only (as in transformers); stream one prompt at a time")
    given_cache = model_kwargs.get("past_key_values")
    use_cache = model_kwargs.get("use_cache", generation_config.use_cache) is not False
    if given_cache is not None and given_cache.get_seq_length() > 0 and len(rows) > 1:
        raise ValueError("a pre-filled past_key_values can only be continued with a single prompt")

    eos_token_ids = frozenset(as_id_list(generation_config.eos_token_id))
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    total_stats: PolybasicStats | None = None
    results = []
    warned = False  # about levels that disagree: once per call
    for row in rows:
        if not use_cache:
            target_cache = None
        elif len(rows) == 1 and given_cache is not None:
            target_cache = given_cache
        else:
            target_cache = new_cache(model)
        removed_padding = input_ids.shape[1] - row.shape[1]
        rules = DecodingRules(
            processors=processors_for_row(logits_processor, removed_padding),
            do_sample=bool(generation_config.do_sample),
            eos_token_ids=eos_token_ids,
        )
        top, stats = build_chain(model, assistants, config, rules, target_cache)
        results.append(
            timed_decode(
                top,
                stats,
                row,
                max_length=generation_config.max_length - removed_padding,
                stopping_criteria=stopping_criteria,
                streamer=streamer,
                keep_scores=keep_scores,
                keep_logits=keep_logits,
            )
        )
        if not warned:
            warned = warn_if_levels_disagree(stats, [True] + [not isinstance(m, Drafter) for m in assistants])
        if total_stats is None:
            total_stats = stats
        else:
            total_stats.merge(stats)
    if streamer is not None:
        streamer.end()
    setattr(model, LAST_STATS_ATTRIBUTE, total_stats)

    sequences = _assemble_sequences(input_ids, [r.tokens for r in results], generation_config)
    if not return_dict:
        return sequences
    return PolybasicGenerateOutput(
        sequences=sequences,
        scores=_stack_per_step([r.scores for r in results]) if keep_scores else None,
        logits=_stack_per_step([r.logits for r in results]) if keep_logits else None,
        past_key_values=given_cache if (len(rows) == 1 and use_cache) else None,
        polybasic_stats=total_stats,
    )


def _pad_token_id(generation_config) -> int:
    pad = prepared_pad_token_id(generation_config)
    if pad is None:  # as transformers does: the first EOS id
        eos = as_id_list(generation_config.eos_token_id)
        pad = eos[0] if eos else 0
    return int(pad)


def _assemble_sequences(input_ids, new_tokens: list[torch.LongTensor], generation_config) -> torch.LongTensor:
    """[B, L + max_new]: the prompts as given, then each row's tokens right-padded with pad_token_id."""
    width = max(t.shape[0] for t in new_tokens)
    out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + width), _pad_token_id(generation_config))
    out[:, : input_ids.shape[1]] = input_ids
    for b, tokens in enumerate(new_tokens):
        out[b, input_ids.shape[1] : input_ids.shape[1] + tokens.shape[0]] = tokens.to(out.device)
    return out


def _stack_per_step(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """One [B, V] tensor per generated step, as HF returns scores; rows that already stopped get 0."""
    steps = max(len(rows) for rows in per_row)
    vocab = next(t.shape[-1] for rows in per_row for t in rows)
    reference = next(t for rows in per_row for t in rows)
    out = []
    for step in range(steps):
        column = [rows[step] if step < len(rows) else reference.new_zeros(vocab) for rows in per_row]
        out.append(torch.stack(column, dim=0))
    return tuple(out)


# --- opt-in patching ---------------------------------------------------------------------------
ENABLED_ATTRIBUTE = "_hf_polybasic_enabled"


def enable(model, assistant_models: Sequence[torch.nn.Module] | None = None, polybasic_config=None):
    """Make ``model.generate`` (and pipelines built on it) accept ``assistant_models=`` and
    ``polybasic_config=``; optionally store a default chain used when a call gives none.

    Only this model instance is changed; `disable` undoes it. Calls without any chain run plain
    `generate`, unchanged.
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"enable() needs a transformers generation model, got {type(model).__name__}")
    if assistant_models is not None:
        assistant_models = validate_assistant_models(model, assistant_models)
    if polybasic_config is not None:
        polybasic_config = resolve_config(polybasic_config, None)
    plain_generate = type(model).generate

    @functools.wraps(plain_generate)
    def polybasic_model_generate(*args, **kwargs):
        chain = kwargs.pop("assistant_models", assistant_models)
        if chain is None:
            if kwargs.get("polybasic_config") is not None:
                raise ValueError("`polybasic_config` was given without `assistant_models`; pass the chain too")
            kwargs.pop("polybasic_config", None)
            return plain_generate(model, *args, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("this model is enabled for hf_polybasic; do not also pass `custom_generate`")
        if kwargs.get("assistant_model") is not None:
            raise ValueError(
                "`assistant_model=` (transformers' two-model assisted generation) cannot be combined with "
                "hf_polybasic's `assistant_models=`; put every assistant in `assistant_models`"
            )
        if kwargs.get("polybasic_config") is None and polybasic_config is not None:
            kwargs["polybasic_config"] = polybasic_config
        if kwargs.get("tokenizer") is not None:
            checked = validate_assistant_models(model, chain)
            check_chain_vocabularies(
                model, [(i, m) for i, m in enumerate(checked) if not isinstance(m, Drafter)], kwargs["tokenizer"]
            )
        _route_stop_strings(kwargs)
        return plain_generate(model, *args, custom_generate=generate, assistant_models=chain, **kwargs)

    model.generate = polybasic_model_generate
    setattr(model, ENABLED_ATTRIBUTE, True)
    return model


def _route_stop_strings(kwargs: dict) -> None:
    """transformers drops ``tokenizer=`` before calling a `custom_generate` callable, so build the
    `StopStringCriteria` here, where the tokenizer is still at hand."""
    stop_strings = kwargs.get("stop_strings")
    tokenizer = kwargs.get("tokenizer")
    if stop_strings is None or tokenizer is None:
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def disable(model) -> None:
    """Undo `enable`: ``model.generate`` is transformers' own again."""
    if not getattr(model, ENABLED_ATTRIBUTE, False):
        raise ValueError(f"{type(model).__name__} was not enabled with hf_polybasic.enable()")
    del model.generate
    delattr(model, ENABLED_ATTRIBUTE)
