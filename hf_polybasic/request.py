"""A `generate` call, checked: what it asks for, validated, as a `Request` the engine decodes.

Options that speculative decoding cannot honour are refused with a clear error instead of being
ignored (beam search, classifier-free guidance, transformers' own assisted modes, attentions and
hidden states, right padding, ...); see ``docs/reference/errors.md`` for every message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import compat
from .compat import new_dynamic_cache
from .config import PolybasicConfig
from .drafters import AddedPromptLookup, Drafter
from .processing import reject_stateful_processors
from .models.vocab_head import drafting_view
from .translation.level import Translated, check_translated_levels
from .vocabulary import as_id_list, check_chain_vocabularies
from .user_warnings import warn

# model_kwargs that `generate` prepares and the engine understands (it recomputes positions per row)
HANDLED_MODEL_KWARGS = frozenset(
    {"attention_mask", *compat.CACHE_KWARGS, "use_cache", "logits_to_keep", "position_ids"}
)  # the cache under every name generate gives it (`compat.CACHE_KWARGS`: ``cache`` from transformers 5.24 on)
UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
# transformers' own assisted generation asked beside a chain: refused by `hp.generate` and the enabled
# route alike (`hf_polybasic.generation`; transformers drops ``assistant_model`` before a callable sees it)
HF_ASSISTANT_MODEL = (
    "`assistant_model=` (transformers' two-model assisted generation) cannot be combined with "
    "hf_polybasic's `assistant_models=`; put every assistant in `assistant_models`"
)
# transformers switches ``cache_implementation="paged"`` to continuous batching (`generate_batch`) before a
# `custom_generate` callable is reached, where it is passed as a keyword (from 5.x); refused where we see it
PAGED_CACHE = (
    "cache_implementation='paged' runs transformers' continuous batching (generate_batch), which never runs "
    "the chain: leave it out (hf_polybasic decodes a left-padded batch of prompts together), or pass "
    "cache_implementation='static' for static caches"
)
# the longest draft of the PromptLookup that PolybasicConfig(prompt_lookup=True) adds, under the
# cost-aware schedule (which shortens it as acceptance says); the other schedules draft K
ADDED_LOOKUP_TOKENS = 8
# the shortest match after which that lookup copies (it looks for no longer one): on held-out Spec-Bench
# prompts (Qwen2.5-Coder 1.5B over its 0.5B, greedy; docs: Benchmarks), the model above a lookup that also
# copied after 1- and 2-token matches accepted 9-20 % of its copies on code and math, against 23-39 % after
# 3-token matches only, and on prose as many accepted from about half the copies; a wrong copy costs that
# model a forward as wide as the copy
ADDED_LOOKUP_NGRAM = 3


@dataclass(frozen=True)
class Request:
    """A checked `generate` call: everything decoding needs.

    Attributes:
        assistants: the chain below the target, strongest first.
        config: the call's `PolybasicConfig`.
        rows: each prompt without its left padding, ``[L_b]``, on the target's device.
        padded_width: the prompts' width as given (rows are shifted by the padding they lose).
        max_length: the length budget of the padded batch.
        do_sample, eos_token_ids: as `generate` resolved them.
        caches: the target's cache for each row (None: ``use_cache=False``).
        given_cache: the ``past_key_values`` the caller passed (returned when there is one row).
        streamer: `generate`'s streamer (batch size 1 only), or None.
        return_dict: return a `PolybasicGenerateOutput` instead of a tensor.
        keep_scores, keep_logits: collect the target's processed scores / raw logits per token.
        repeats: how many rows each prompt was expanded to (``num_return_sequences``); consecutive
            rows share a prompt.
        static: the call asked for static caches (``cache_implementation="static"``): every model
            that can decodes on one (`hf_polybasic.runners.static`).
    """

    assistants: list
    config: PolybasicConfig
    rows: list[torch.LongTensor]
    padded_width: int
    max_length: int
    do_sample: bool
    eos_token_ids: frozenset[int]
    caches: list
    given_cache: Any = None
    streamer: Any = None
    return_dict: bool = False
    keep_scores: bool = False
    keep_logits: bool = False
    repeats: int = 1
    static: bool = False


def check_request(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    generation_config,
    assistant_models: Sequence | None,
    polybasic_config,
    synced_gpus: bool,
    streamer,
    model_kwargs: dict[str, Any],
) -> Request:
    """Validate a call of `hf_polybasic.generate` and describe it as a `Request`."""
    if synced_gpus:
        raise NotImplementedError("synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported by hf_polybasic")
    for name in UNSUPPORTED_OUTPUTS:
        if model_kwargs.get(name) or getattr(generation_config, name, False):
            raise NotImplementedError(f"`{name}=True` is not supported by hf_polybasic; use plain generate for it")
    unknown = sorted(set(model_kwargs) - HANDLED_MODEL_KWARGS - set(UNSUPPORTED_OUTPUTS))
    if unknown:
        raise ValueError(
            f"hf_polybasic does not support these generate arguments: {unknown} (text-only decoder inputs are supported)"
        )
    assistants = validate_assistant_models(model, assistant_models)
    validate_generation_config(generation_config)
    config = resolve_config(polybasic_config, generation_config)
    reject_stateful_processors(logits_processor)
    config.thresholds_for(len(assistants) - 1)  # validates a per-level mu sequence before any work
    given_cache = compat.given_cache(model_kwargs)
    static = wants_static_cache(generation_config, given_cache)
    assistants = with_added_levels(assistants, config, static, bool(generation_config.do_sample))

    rows = row_prompts(input_ids, model_kwargs.get("attention_mask"))
    check_position_ids(model_kwargs.get("position_ids"), rows)
    rows = [row.to(model.device) for row in rows]  # decoded where the target runs: moved once, not per forward
    if len(rows) > 1 and streamer is not None:
        raise ValueError("streamers support batch size 1 only (as in transformers); stream one prompt at a time")
    # generate refuses cache_implementation next to a cache of the caller's: with it set, generate built this one
    made_by_generate = getattr(generation_config, "cache_implementation", None) is not None
    if static:  # the chain's static runners keep their own caches; this one holds what is handed back
        if given_cache is not None:
            compat.forget_generate_static_cache(model, given_cache)
        given_cache = new_dynamic_cache(model)
    elif given_cache is not None and compat.replaceable_empty_cache(given_cache, made_by_generate):
        if not compat.is_dynamic_cache(given_cache):
            warn(
                f"hf_polybasic replaces the empty {type(given_cache).__name__} that "
                f"cache_implementation={generation_config.cache_implementation!r} made with a DynamicCache: a "
                "speculative chain cuts rejected tokens from its caches, which a static, hybrid or quantized cache "
                "cannot do")
        given_cache = new_dynamic_cache(model)  # laid out for rollback here
    if given_cache is not None and compat.cached_tokens(given_cache) > 0 and len(rows) > 1:
        raise ValueError("a pre-filled past_key_values can only be continued with a single prompt")
    use_cache = model_kwargs.get("use_cache", generation_config.use_cache) is not False
    return_dict = bool(generation_config.return_dict_in_generate)
    return Request(
        assistants=assistants,
        config=config,
        rows=rows,
        padded_width=input_ids.shape[1],
        max_length=generation_config.max_length,
        do_sample=bool(generation_config.do_sample),
        eos_token_ids=frozenset(as_id_list(generation_config.eos_token_id)),
        caches=_target_caches(model, len(rows), use_cache, given_cache),
        given_cache=given_cache if use_cache else None,
        streamer=streamer,
        return_dict=return_dict,
        keep_scores=return_dict and bool(generation_config.output_scores),
        keep_logits=return_dict and bool(generation_config.output_logits),
        repeats=max(int(generation_config.num_return_sequences or 1), 1),
        static=static,
    )


def wants_static_cache(generation_config, given_cache) -> bool:
    """Whether the call asks for static caches: ``cache_implementation="static"``, or an empty
    `StaticCache` of the caller's (a filled one cannot be continued by a chain: a clear error)."""
    if given_cache is not None and compat.is_static_cache(given_cache):
        if compat.cached_tokens(given_cache) > 0:
            raise ValueError(
                "a pre-filled StaticCache (past_key_values) cannot be continued by hf_polybasic: its models decode on "
                "caches of their own; pass the whole text, or continue from a DynamicCache"
            )
        return True
    return getattr(generation_config, "cache_implementation", None) == "static"


def _target_caches(target, rows: int, use_cache: bool, given) -> list:
    """The target's cache for each row: the given one for a single row, else a fresh one (None
    without caching)."""
    if not use_cache:
        return [None] * rows
    if rows == 1 and given is not None:
        return [given]
    return [new_dynamic_cache(target) for _ in range(rows)]


def with_restricted_drafter(assistants: list, config: PolybasicConfig, static: bool = False,
                            samples: bool = False) -> list:
    """``assistants`` with the bottom model replaced by its restricted-vocabulary drafting view
    (`PolybasicConfig.drafter_vocabulary`, `hf_polybasic.models.vocab_head.drafting_view`) where that pays
    and stays exact; otherwise unchanged. Above a `Drafter` (one given last, or the lookup
    `PolybasicConfig.prompt_lookup` adds) the bottom model verifies: greedy, its restricted argmax is
    one more proposal the level above decides, so it is restricted there too; sampling (``samples``),
    not: a verifying level must emit a token wherever the processors allow one. Not on a static cache
    or compiled (``static``, `PolybasicConfig.compiles`): the view's output layer grows with the text,
    which a fixed-shape forward cannot follow."""
    below = 1 if isinstance(assistants[-1], Drafter) else 0  # the Drafter under the bottom model, if given
    if config.drafter_vocabulary is None or len(assistants) <= below:
        return assistants
    if (below or config.prompt_lookup) and samples:
        return assistants
    index = len(assistants) - 1 - below  # the bottom model (only the last level may be a Drafter)
    bottom = assistants[index]
    if isinstance(bottom, Translated) or static or config.compiles(bottom.device):
        return assistants
    view = drafting_view(bottom, config.drafter_vocabulary)
    return assistants if view is None else [*assistants[:index], view, *assistants[index + 1 :]]


def with_added_levels(assistants: list, config: PolybasicConfig, static: bool, samples: bool) -> list:
    """The levels a call decodes with below the target: ``assistants`` with the bottom model's drafting
    view (`with_restricted_drafter`), then the lookup the config adds (`with_prompt_lookup`); in this
    order, as the view is chosen knowing whether a lookup sits below it."""
    return with_prompt_lookup(with_restricted_drafter(assistants, config, static, samples), config)


def with_prompt_lookup(assistants: list, config: PolybasicConfig) -> list:
    """``assistants`` with a `PromptLookup` below the bottom model when the config asks for one
    (`PolybasicConfig.prompt_lookup`); a Drafter at the bottom already is left alone. The lookup is
    the chain's bottom drafter: it copies only after a match of `ADDED_LOOKUP_NGRAM` tokens, drafts K
    tokens per round (``num_draft_tokens``; under the cost-aware schedule up to `ADDED_LOOKUP_TOKENS`,
    which the schedule shortens as acceptance says), and the former bottom model, now an intermediate
    level, gets the config's last mu."""
    if not config.prompt_lookup or isinstance(assistants[-1], Drafter):
        return assistants
    if isinstance(assistants[-1], Translated) and assistants[-1].route == "text":
        raise ValueError(
            "PolybasicConfig(prompt_lookup=True) puts a PromptLookup below the bottom model, but the bottom level "
            f"{assistants[-1]!r} drafts through text (route='text'), which cannot verify; use route='shared' or "
            "prompt_lookup=False")
    tokens = ADDED_LOOKUP_TOKENS if config.schedule == "cost_aware" else config.num_draft_tokens
    return [*assistants, AddedPromptLookup(max_ngram=ADDED_LOOKUP_NGRAM, num_tokens=tokens,
                                           min_ngram=ADDED_LOOKUP_NGRAM)]


def validate_assistant_models(target, assistant_models, tokenizer=None) -> list:
    """The chain below the target, checked: a non-empty list of decoder-only models sharing the
    target's vocabulary (and ``tokenizer``'s, when given) or translated to it
    (`hf_polybasic.translation.level.translated`), with at most a `Drafter` at the bottom."""
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
        if not isinstance(model, Translated) and (not isinstance(model, torch.nn.Module) or not hasattr(model, "config")):
            raise TypeError(
                f"assistant_models[{position}] must be a transformers model (nn.Module with a config), a "
                f"hf_polybasic.levels.translated(...) level or, last, a hf_polybasic.drafters.Drafter; got "
                f"{type(model).__name__}"
            )
    chain_models = [(i, m) for i, m in enumerate(models) if not isinstance(m, (Drafter, Translated))]
    translated = [(i, m.model) for i, m in enumerate(models) if isinstance(m, Translated)]
    for role, model in [("target", target)] + [(f"assistant_models[{i}]", m) for i, m in chain_models + translated]:
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"{role} {type(model).__name__} is an encoder-decoder model; hf_polybasic supports decoder-only chains"
            )
    check_chain_vocabularies(target, chain_models, tokenizer)
    check_translated_levels(target, models, tokenizer)
    return models


# generation modes `generate` would pick from the options, other than greedy search and sampling, and
# what selects them; a callable `custom_generate` replaces transformers' dispatch, so they are refused
# here instead of silently becoming greedy search or sampling
OTHER_GENERATION_MODES = {
    "contrastive_search": "`penalty_alpha` (contrastive search)",
    "dola_generation": "`dola_layers` (DoLa decoding)",
    "constrained_beam_search": "`constraints` / `force_words_ids` (constrained beam search)",
    "group_beam_search": "`num_beam_groups` (group beam search)",
}


def validate_generation_config(generation_config) -> None:
    """Reject options that speculative decoding cannot honour, instead of ignoring them."""
    mode = str(getattr(generation_config.get_generation_mode(), "value", generation_config.get_generation_mode()))
    if mode in OTHER_GENERATION_MODES:
        raise ValueError(
            f"{OTHER_GENERATION_MODES[mode]} selects another decoding method than greedy search or sampling, which is "
            "all hf_polybasic runs; remove the option, or use plain generate for that method"
        )
    if getattr(generation_config, "cache_implementation", None) == "paged":
        raise ValueError(PAGED_CACHE)
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


def check_position_ids(position_ids: torch.Tensor | None, rows: list[torch.LongTensor]) -> None:
    """Raise unless ``position_ids`` are the ones the chain uses anyway: each row's tokens numbered
    0, 1, ... after its left padding (what `generate` derives from the attention mask when the
    call gives none). Custom positions would be dropped, so they are refused. (One read back from
    the device for all rows.)"""
    if position_ids is None:
        return
    position_ids = position_ids.reshape(-1, position_ids.shape[-1]) if position_ids.dim() > 1 else position_ids[None]
    width = position_ids.shape[-1]
    lengths = torch.tensor([row.shape[0] for row in rows], device=position_ids.device)
    given = position_ids.long().expand(len(rows), -1) if position_ids.shape[0] == 1 else position_ids[: len(rows)].long()
    expected = lengths[:, None] - width + torch.arange(width, device=position_ids.device)  # [rows, width]
    if not bool(((given != expected) & (expected >= 0)).any()):
        return
    for index, row in enumerate(rows):  # the error path: find the row to name
        own = given[index][max(width - row.shape[0], 0) :]
        if not torch.equal(own, expected[index][max(width - row.shape[0], 0) :]):
            raise ValueError(
                f"custom `position_ids` are not supported by hf_polybasic (row {index} ends with positions "
                f"{own.tolist()[-8:]}, not {expected[index][max(width - row.shape[0], 0):].tolist()[-8:]}): every "
                "model of the chain numbers a row's tokens 0, 1, ... after its left padding, as generate does from "
                "attention_mask; leave position_ids out"
            )


def row_prompts(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> list[torch.LongTensor]:
    """Each row without its left padding, as ``[L_b]`` (one read back from the device for all rows)."""
    if attention_mask is None:
        return [input_ids[b] for b in range(input_ids.shape[0])]
    mask = attention_mask.bool()
    malformed = (mask[:, 1:].int() < mask[:, :-1].int()).any(-1) | ~mask[:, -1]  # [B]
    padding = torch.stack([malformed.long(), (~mask).sum(-1)]).tolist()
    empty = [row for row, pad in enumerate(padding[1]) if pad == mask.shape[1]]
    if empty:
        raise ValueError(
            f"row {empty[0]} of attention_mask is all zeros: that prompt has no token to generate from; drop the "
            "row, or give it at least one token"
        )
    if any(padding[0]):
        raise ValueError(
            "hf_polybasic needs left padding for batched prompts (attention_mask of the form 0..0 1..1); "
            "set tokenizer.padding_side = 'left'"
        )
    return [input_ids[b, pad:] for b, pad in enumerate(padding[1])]
