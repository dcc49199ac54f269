"""``custom_generate=hp.assisted_generate``: transformers' own assisted loop, proposing with the chain.

`assisted_generate` hands the chain below the target (`hf_polybasic.candidates.PolybasicCandidateGenerator`)
to ``GenerationMixin._assisted_decoding``, the loop transformers runs for ``assistant_model=``: its
target forward, its acceptance (greedy match, or `_speculative_sampling`), its cache crop, its
output. `hf_polybasic.generate` stays the main road (batches, stop strings inside a round, static
caches on every release); this one is for a loop every transformers user knows, and a second,
independent verifier of the chain. What that loop does differently, and what is refused because it
would decode the call otherwise than plain `generate`, is in `assisted_generate`'s docstring and
``docs/howto/assisted.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.generation import StoppingCriteriaList

from . import compat
from .candidates import PolybasicCandidateGenerator
from .compat import (assisted_decoding, calling_generate_argument, streamer_of_calling_generate,
                     use_assisted_loop_cache, warn_if_untested)
from .config import PolybasicConfig
from .costs import DEFAULT_COST_CURVES, CostCurves
from .decoding.build import ChainParts
from .outputs import PolybasicGenerateOutput
from .processing import reject_stateful_processors
from .runners.recurrent import recurrent_layers
from .request import HANDLED_MODEL_KWARGS, UNSUPPORTED_OUTPUTS, validate_generation_config
from .stats import remember_last
from .timing import DEFAULT_CLOCK, Clock

__all__ = ["assisted_generate", "check_assisted_call", "make_assisted_generate", "one_chain"]


def make_assisted_generate(
    parts: ChainParts = ChainParts(), clock: Clock = DEFAULT_CLOCK, costs: CostCurves | None = DEFAULT_COST_CURVES
) -> Callable:
    """A `custom_generate` callable running transformers' assisted loop over chains built from
    ``parts``, timed with ``clock``, priced by ``costs`` (as `hf_polybasic.generation.make_generate`
    takes them). `hf_polybasic.assisted_generate` is ``make_assisted_generate()``."""

    @torch.no_grad()
    def assisted_generate(
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
        """transformers' own assisted loop with the chain as its candidate generator, for
        ``model.generate(custom_generate=assisted_generate, assistant_models=[M2, ..., Mn])``.

        ``assistant_model=draft`` (transformers' own argument) stands for ``assistant_models=[draft]``.
        Returns what `generate` returns: a tensor, or with ``return_dict_in_generate=True`` a
        `PolybasicGenerateOutput` (transformers' assisted output: scores, logits, attentions,
        hidden states, the cache, plus ``polybasic_stats``, also `hf_polybasic.last_stats(model)`).

        What transformers' loop does differently from `hf_polybasic.generate`:

        * one prompt at a time: a batch, and ``num_return_sequences > 1``, are refused;
        * stopping criteria other than EOS and the length (``stop_strings``, ``max_time``, your own)
          are checked after each round, so tokens of the round past a stop string are returned
          (plain `generate` stops at the string);
        * a static cache (``cache_implementation="static"``) only from transformers 5.24, whose
          loop crops it (and compiles the target's forward on a GPU); before, it is refused;
        * the target's cache must be cropped: a target with recurrent state is refused;
        * ``assistant_ensemble_weight`` (transformers' mix of the assistant's distribution into the
          target's) is refused: the output would no longer be the target's.

        Exact for any depth under the conditions `PolybasicCandidateGenerator` states: greedy output
        is plain greedy `generate`'s, sampled output is distributed as the target's.
        """
        warn_if_untested()
        if streamer is None:  # transformers hands a custom_generate callable no streamer
            streamer = streamer_of_calling_generate()
        assistant_models = one_chain(assistant_models, calling_generate_argument("assistant_model"))
        static = check_assisted_call(model, input_ids, logits_processor, generation_config, synced_gpus, model_kwargs)
        use_assisted_loop_cache(model, generation_config, model_kwargs)
        generator = PolybasicCandidateGenerator(
            model, assistant_models, input_ids, logits_processor, generation_config, polybasic_config,
            model_kwargs.get("attention_mask"), static=static, parts=parts, clock=clock, costs=costs,
        )
        started = clock()
        try:
            out = assisted_decoding(model, generator, input_ids, model_kwargs, logits_processor=logits_processor,
                                    stopping_criteria=stopping_criteria, generation_config=generation_config,
                                    synced_gpus=False, streamer=streamer)
        finally:
            stats = generator.finish()
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        stats.seconds, stats.new_tokens = clock() - started, int(sequences.shape[1] - input_ids.shape[1])
        remember_last(model, stats)
        if isinstance(out, torch.Tensor):
            return out
        return PolybasicGenerateOutput(**dict(out.items()), polybasic_stats=stats)

    return assisted_generate


assisted_generate = make_assisted_generate()


def one_chain(assistant_models, assistant_model) -> list | None:
    """The call's chain: ``assistant_models``, or ``[assistant_model]`` (transformers' argument,
    which `generate` does not hand a `custom_generate` callable)."""
    if assistant_model is None:
        return assistant_models
    if assistant_models is not None:
        raise ValueError(
            "both `assistant_model=` and `assistant_models=` were given; a call has one chain: put every assistant "
            "in `assistant_models`, strongest first"
        )
    return [assistant_model]


def check_assisted_call(model, input_ids: torch.LongTensor, logits_processor, generation_config, synced_gpus: bool,
                        model_kwargs: dict) -> bool:
    """Raise where transformers' assisted loop would decode the call otherwise than plain `generate`
    (or not at all); returns whether the call runs on a static cache."""
    if synced_gpus:
        raise NotImplementedError("synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported by hf_polybasic")
    validate_generation_config(generation_config)  # beam search and the like first: they widen the batch too
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences}: transformers' assisted loop (hp.assisted_generate) decodes one sequence "
            "at a time; call it once per sequence, or use custom_generate=hp.generate, which decodes them together"
        )
    if input_ids.shape[0] > 1:
        raise ValueError(
            f"transformers' assisted loop (hp.assisted_generate) decodes one prompt at a time, got {input_ids.shape[0]}; "
            "generate them one by one, or use custom_generate=hp.generate for batches"
        )
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError(
            "`assistant_ensemble_weight` mixes the assistant's distribution into the target's, so the output is no "
            "longer the target's; hf_polybasic decodes exactly what the target would: remove the option"
        )
    reject_stateful_processors(logits_processor)
    for name in UNSUPPORTED_OUTPUTS:  # transformers' loop splits them wrongly after a first round that accepts drafts
        if getattr(generation_config, name):
            raise NotImplementedError(f"`{name}=True` is not supported by hf_polybasic; use plain generate for it")
    unknown = sorted(set(model_kwargs) - HANDLED_MODEL_KWARGS - set(UNSUPPORTED_OUTPUTS))
    if unknown:
        raise ValueError(
            f"hf_polybasic does not support these generate arguments: {unknown} (text-only decoder inputs are supported)"
        )
    if generation_config.use_cache is False:
        raise ValueError(
            "use_cache=False: transformers' assisted loop (hp.assisted_generate) verifies drafts on the target's cache "
            "and crops it; leave use_cache on, or use custom_generate=hp.generate"
        )
    # generate builds a StaticCache for cache_implementation="static" before calling us
    static = compat.is_static_cache(compat.given_cache(model_kwargs))
    if static and not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE:
        raise ValueError(
            f"transformers' assisted loop (hp.assisted_generate) takes a static cache from transformers 5.24 on; this "
            f"is {compat.TRANSFORMERS_VERSION}: use custom_generate=hp.generate (its models decode on static caches of "
            "their own), or a dynamic cache"
        )
    layers = recurrent_layers(model)
    if layers:
        raise ValueError(
            f"the target {type(model).__name__} keeps recurrent state ({layers[0].describe()}), which transformers' "
            "assisted loop (hp.assisted_generate) cannot crop back to the accepted drafts; use "
            "custom_generate=hp.generate, whose runners keep copies of the state"
        )
    return static
