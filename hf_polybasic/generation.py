"""Entry points into `model.generate`: the `custom_generate` callable, `enable` and `disable`.

`generate` is called by transformers' own `GenerationMixin.generate` after it has prepared the
generation config, the logits processors, the stopping criteria and the length budget, so every
option users pass to `generate` means what it always means. A call is checked
(`hf_polybasic.request`), decoded row by row (`hf_polybasic.decoding.loop`) and assembled in HF's layout
(`hf_polybasic.outputs`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.generation import StoppingCriteriaList, StopStringCriteria

from .assisted import assisted_generate, one_chain
from .decoding.build import ChainParts
from .compat import (assistant_model_of_calling_generate, stop_recording_past_states, streamer_of_calling_generate,
                     warn_if_untested)
from .config import PolybasicConfig
from .costs import DEFAULT_COST_CURVES, CostCurves
from .decoding.loop import decode_rows
from .outputs import PolybasicGenerateOutput, assemble_output
from .request import HF_ASSISTANT_MODEL, PAGED_CACHE, check_request, resolve_config, validate_assistant_models
from .stats import last_stats, remember_last
from .translation.level import translated
from .timing import DEFAULT_CLOCK, Clock

__all__ = ["PolybasicGenerateOutput", "disable", "enable", "generate", "last_stats", "make_generate"]

def make_generate(
    parts: ChainParts = ChainParts(), clock: Clock = DEFAULT_CLOCK, costs: CostCurves | None = DEFAULT_COST_CURVES
) -> Callable:
    """A `custom_generate` callable whose chains are built from ``parts``, timed with ``clock``,
    and (under the cost-aware schedule) steered by the forward-cost curves in ``costs``.

    `hf_polybasic.generate` is ``make_generate()``: the default parts, wall time, and cost curves
    measured once per model and machine and kept on disk (`hf_polybasic.costs`). Other parts (your
    own level classes), a simulated clock (`hf_polybasic.testing.SimulatedClock`, for deterministic
    tests of schedules that react to timings) or other curves go here, instead of patching module
    globals.
    """

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
        if assistant_model_of_calling_generate() is not None:  # transformers dropped it before this call
            raise ValueError(HF_ASSISTANT_MODEL)
        if streamer is None:
            streamer = streamer_of_calling_generate()
        request = check_request(
            model, input_ids, logits_processor, generation_config, assistant_models, polybasic_config,
            synced_gpus, streamer, model_kwargs,
        )
        results, stats = decode_rows(model, request, logits_processor, stopping_criteria, parts, clock, costs)
        if request.given_cache is not None:
            stop_recording_past_states(request.given_cache)  # handed back as generate would
        if streamer is not None:
            streamer.end()
        remember_last(model, stats)
        return assemble_output(input_ids, request, results, stats, generation_config)

    return generate


generate = make_generate()


# --- opt-in patching ---------------------------------------------------------------------------
ENABLED_ATTRIBUTE = "_hf_polybasic_enabled"  # the chain and config given to `enable` (may be None)


class _EnabledDefaults:
    """What `enable` stored on a model: its default chain and config, and which loop runs it. Copies
    of the model share it (a deep copy does not duplicate the assistant models)."""

    def __init__(self, assistant_models, polybasic_config, loop: str = "polybasic"):
        self.assistant_models, self.polybasic_config, self.loop = assistant_models, polybasic_config, loop

    def __deepcopy__(self, memo):
        return self


# `enable(loop=...)`: which loop an enabled model's calls with a chain run
LOOPS = ("polybasic", "transformers")


_ENABLED_CLASSES: dict[type, type] = {}
_enabled_classes_lock = threading.Lock()


def _enabled_class(plain: type) -> type:
    """``plain`` with a `generate` that routes calls with a chain through `generate` (made once per
    class, same name: ``save_pretrained`` records the architecture as before). An enabled model is
    an instance of it, so copies (``copy.copy``, ``deepcopy``) generate with themselves."""
    with _enabled_classes_lock:
        if plain not in _ENABLED_CLASSES:

            @functools.wraps(plain.generate)
            def enabled_generate(self, *args, **kwargs):
                return _route_generate(self, plain, *args, **kwargs)

            _ENABLED_CLASSES[plain] = type(
                plain.__name__,
                (plain,),
                {"generate": enabled_generate, "__module__": plain.__module__, "__qualname__": plain.__qualname__,
                 "_hf_polybasic_plain_class": plain},
            )
        return _ENABLED_CLASSES[plain]


def enable(model, assistant_models: Sequence[torch.nn.Module] | None = None, polybasic_config=None,
           loop: str = "polybasic"):
    """Make ``model.generate`` (and pipelines built on it) accept ``assistant_models=`` and
    ``polybasic_config=``; optionally store a default chain used when a call gives none.

    ``loop``: ``"polybasic"`` (the default) runs calls with a chain through `generate`;
    ``"transformers"`` runs them through transformers' own assisted loop (`assisted_generate`: one
    prompt at a time), where transformers' ``assistant_model=draft`` also means the chain ``[draft]``.

    Only this model instance is changed (its class becomes an enabled subclass of the same name);
    copies of it (``copy.copy``, ``copy.deepcopy``) are enabled too and generate with themselves;
    `disable` undoes it. Calls without any chain run plain `generate`, unchanged. An enabled model
    is not picklable as a whole (``save_pretrained`` works as before; `disable` first to pickle).
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"enable() needs a transformers generation model, got {type(model).__name__}")
    if loop not in LOOPS:
        raise ValueError(
            f"enable(loop={loop!r}): choose 'polybasic' (hf_polybasic's own loop, hp.generate) or 'transformers' "
            "(transformers' assisted loop, hp.assisted_generate)"
        )
    if assistant_models is not None:
        assistant_models = validate_assistant_models(model, assistant_models)
    if polybasic_config is not None:
        polybasic_config = resolve_config(polybasic_config, None)
    plain = getattr(type(model), "_hf_polybasic_plain_class", type(model))
    model.__class__ = _enabled_class(plain)
    setattr(model, ENABLED_ATTRIBUTE, _EnabledDefaults(assistant_models, polybasic_config, loop))
    return model


def _route_generate(model, plain: type, *args, **kwargs):
    """The enabled `generate`: plain `generate` without a chain, else plain `generate` with our
    `custom_generate` (`generate`, or `assisted_generate` for ``loop="transformers"``, where
    ``assistant_model=`` is a chain too) and the chain (the call's, else the one given to `enable`)."""
    defaults = getattr(model, ENABLED_ATTRIBUTE, None) or _EnabledDefaults(None, None)
    assisted = defaults.loop == "transformers"
    if kwargs.get("assistant_tokenizer") is not None:  # transformers' spelling of one assistant with its own tokenizer
        if assisted:
            raise ValueError(ASSISTED_OTHER_TOKENIZER)
        _route_assistant_tokenizer(kwargs)
    elif assisted and kwargs.get("assistant_model") is not None:
        kwargs["assistant_models"] = one_chain(kwargs.get("assistant_models"), kwargs.pop("assistant_model"))
    chain = kwargs.pop("assistant_models", defaults.assistant_models)
    if chain is None:
        if kwargs.get("polybasic_config") is not None:
            raise ValueError("`polybasic_config` was given without `assistant_models`; pass the chain too")
        kwargs.pop("polybasic_config", None)
        return plain.generate(model, *args, **kwargs)
    if kwargs.get("custom_generate") is not None:
        raise ValueError("this model is enabled for hf_polybasic; do not also pass `custom_generate`")
    if kwargs.get("assistant_model") is not None:
        raise ValueError(HF_ASSISTANT_MODEL)
    if kwargs.get("cache_implementation") == "paged":  # transformers would switch before our callable runs
        raise ValueError(PAGED_CACHE)
    if kwargs.get("polybasic_config") is None and defaults.polybasic_config is not None:
        kwargs["polybasic_config"] = defaults.polybasic_config
    if kwargs.get("tokenizer") is not None:  # transformers drops it before our callable: check here
        validate_assistant_models(model, chain, kwargs["tokenizer"])
    _route_stop_strings(kwargs)
    return plain.generate(model, *args, custom_generate=assisted_generate if assisted else generate,
                          assistant_models=chain, **kwargs)


ASSISTED_OTHER_TOKENIZER = (
    "`assistant_tokenizer=`: transformers' loop (enable(model, loop=\"transformers\")) runs assistants that share the "
    "target's tokenizer; an assistant with its own tokenizer runs on hf_polybasic's own loop: enable the model without "
    "loop=\"transformers\", or pass assistant_models=[hf_polybasic.levels.translated(model, its_tokenizer, "
    "target_tokenizer)] to custom_generate=hp.generate")


def _route_assistant_tokenizer(kwargs: dict) -> None:
    """``assistant_model=small, tokenizer=tok, assistant_tokenizer=small_tok`` (transformers' UAD and USD)
    becomes the chain ``[translated(small, small_tok, tok)]``, decoded by hf_polybasic like any chain."""
    assistant, assistant_tokenizer = kwargs.pop("assistant_model", None), kwargs.pop("assistant_tokenizer")
    if kwargs.get("assistant_models") is not None or assistant is None or kwargs.get("tokenizer") is None:
        raise ValueError(
            "`assistant_tokenizer=` goes with `assistant_model=` (the assistant) and `tokenizer=` (the target's), and "
            "not with `assistant_models=`; in a chain, wrap the model: "
            "assistant_models=[hf_polybasic.levels.translated(model, its_tokenizer, target_tokenizer)]")
    kwargs["assistant_models"] = [translated(assistant, assistant_tokenizer, kwargs["tokenizer"])]


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
    """Undo `enable`: ``model.generate`` is transformers' own again (the model's class is its own)."""
    plain = getattr(type(model), "_hf_polybasic_plain_class", None)
    if plain is None:
        raise ValueError(f"{type(model).__name__} was not enabled with hf_polybasic.enable()")
    model.__class__ = plain
    if ENABLED_ATTRIBUTE in vars(model):
        delattr(model, ENABLED_ATTRIBUTE)
