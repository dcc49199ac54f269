"""The decoding methods the benchmark compares, and the model sets they run on.

A `Method` is a name, a JSON description of its settings (results are cached under it) and a
``run(target, inputs, options)`` callable that calls ``target.generate`` once and returns the
sequences. The factories build the methods:

* `plain`: transformers' own ``generate``, the baseline every speedup is relative to;
* `hf_assisted`: transformers' ``assistant_model=``, by default with a fixed draft length (constant
  schedule, no confidence threshold; or transformers' heuristic schedule, or its defaults), the
  assistant's generation-config fields restored after each call;
* `hf_other_tokenizer`: transformers' ``assistant_model=`` with ``assistant_tokenizer=``, an assistant with
  another tokenizer: UAD when greedy, USD (its TLI) when sampling;
* `hf_prompt_lookup`: transformers' ``prompt_lookup_num_tokens=``;
* `polybasic`: ours, ``custom_generate=hf_polybasic.generate`` with any ``assistant_models`` list
  and `PolybasicConfig`; its per-level statistics come from `hf_polybasic.last_stats`.

The methods of `RECIPES` run on a `hf_polybasic.cli.model_sets.ModelSet` and name the pool
entries they need (`needed_pool`), so only those are built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_polybasic.config import PolybasicConfig
from hf_polybasic.drafters import Drafter, PromptLookup
from hf_polybasic.generation import generate as polybasic_generate
from hf_polybasic.generation import last_stats
from hf_polybasic.request import ADDED_LOOKUP_NGRAM
from hf_polybasic.stats import PolybasicStats
from hf_polybasic.cli.assisted import assisted_generate, assistant_settings
from hf_polybasic.cli.model_sets import ModelSet

RunFn = Callable[[torch.nn.Module, dict, dict], torch.Tensor]



@dataclass
class Method:
    """One way of running ``target.generate``.

    Attributes:
        name: the name it is selected and reported by.
        kind: "plain", "hf-assisted", "hf-prompt-lookup", "polybasic" or "custom".
        description: one line for the report's legend.
        spec: JSON-serialisable settings; cached results are reused only for the same spec.
        run: ``run(target, inputs, options)`` -> the output sequences ``[1, L + new]``; ``inputs``
            holds ``input_ids`` and ``attention_mask``, ``options`` the decoding options
            (``do_sample``, ``max_new_tokens``, ...).
        polybasic: whether ``last_stats(target)`` holds this method's per-level statistics.
        lossless: whether greedy outputs must equal plain ``generate``'s (checked when greedy).
        level_labels: for chains, a short name per level, target first (shown in the report).
    """

    name: str
    kind: str
    description: str
    spec: dict
    run: RunFn
    polybasic: bool = False
    lossless: bool = True
    level_labels: tuple[str, ...] = ()

    @property
    def spec_digest(self) -> str:
        text = json.dumps({"kind": self.kind, **self.spec}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stats(self, target: torch.nn.Module) -> PolybasicStats | None:
        """The per-level statistics of the call just made (ours only)."""
        return last_stats(target) if self.polybasic else None


# ------------------------------------------------------------------------------------- factories
def plain(name: str = "plain", static: bool = False) -> Method:
    """transformers' own ``generate``: the baseline. ``static``: with ``cache_implementation="static"``,
    which on a GPU makes transformers compile the forward itself (a GPU user's fastest plain decoding)."""
    extra = {"cache_implementation": "static"} if static else {}

    def run(target, inputs, options):
        return target.generate(**inputs, **extra, **options)

    description = "transformers generate" + (" with a static cache (compiled on a GPU)" if static else " (baseline)")
    return Method(name, "plain", description, extra, run)


def hf_assisted(
    assistant: torch.nn.Module,
    label: str,
    num_assistant_tokens: int | None = 4,
    name: str = "hf-assisted",
    schedule: str = "constant",
    confidence_threshold: float = 0.0,
    static: bool = False,
) -> Method:
    """transformers' ``assistant_model=``.

    By default K = ``num_assistant_tokens`` drafts per round, constant schedule and no confidence
    threshold (a like-for-like two-model comparison); ``schedule="heuristic"`` is transformers'
    adaptive K. ``num_assistant_tokens=None`` leaves every assistant field unset, i.e.
    transformers' defaults as a user gets them (5.23: 20 tokens, constant, confidence threshold
    0.4, adapted online only when scikit-learn is installed). The assistant's generation-config
    fields are set for the call and restored afterwards (`hf_polybasic.cli.assisted`).
    ``static``: the target on a static cache (transformers >= 5.24 takes one in assisted decoding
    and then compiles the target's forward on a GPU; `compat.ASSISTED_DECODING_TAKES_STATIC_CACHE`).
    """
    settings = assistant_settings(num_assistant_tokens, schedule, confidence_threshold)
    extra = {"cache_implementation": "static"} if static else {}

    def run(target, inputs, options):
        return assisted_generate(target, assistant, settings, **inputs, **extra, **options)

    if num_assistant_tokens is None:
        description = f"transformers assistant_model= {label} (transformers' defaults)"
    else:
        description = f"transformers assistant_model= {label} (K={num_assistant_tokens}, {schedule} schedule)"
    if static:
        description += ", static cache (the target compiled on a GPU)"
    return Method(name, "hf-assisted", description, {"assistant": label, **settings, **extra}, run)


def hf_other_tokenizer(levels, label: str, num_assistant_tokens: int = 4, name: str = "hf-assisted-other") -> Method:
    """transformers' ``assistant_model=`` for an assistant with another tokenizer (``tokenizer=`` the target's,
    ``assistant_tokenizer=`` its own): UAD (text round trips) when greedy, USD (its vocabulary translated,
    TLI) when sampling; K = ``num_assistant_tokens`` drafts per round, constant schedule. ``levels``: two
    `hf_polybasic.levels.translated` levels carrying the model and tokenizers, the one for greedy calls and
    the one for sampling (USD prunes its model's output layer in place, which must be a float layer)."""
    settings = assistant_settings(num_assistant_tokens, "constant", 0.0)
    greedy, sampling = levels

    def run(target, inputs, options):
        level = sampling if options.get("do_sample") else greedy
        return assisted_generate(target, level.model, settings, tokenizer=level.target_tokenizer,
                                 assistant_tokenizer=level.tokenizer, **inputs, **options)

    description = (f"transformers assistant_model= {label} with its own tokenizer: UAD when greedy, USD when sampling "
                   f"(its output layer in float, which USD prunes); K={num_assistant_tokens}, constant schedule")
    return Method(name, "hf-assisted", description, {"assistant": label, "assistant_tokenizer": True, **settings}, run)


def hf_prompt_lookup(num_tokens: int = 8, max_matching_ngram_size: int = 3, name: str = "hf-lookup") -> Method:
    """transformers' prompt lookup decoding (``prompt_lookup_num_tokens=``)."""
    settings = {"prompt_lookup_num_tokens": num_tokens, "max_matching_ngram_size": max_matching_ngram_size}

    def run(target, inputs, options):
        return target.generate(**inputs, **settings, **options)

    description = f"transformers prompt_lookup_num_tokens={num_tokens} (max n-gram {max_matching_ngram_size})"
    return Method(name, "hf-prompt-lookup", description, settings, run)


def polybasic(
    assistant_models: Sequence[Any],
    labels: Sequence[str],
    config: PolybasicConfig,
    name: str,
) -> Method:
    """Ours: ``target.generate(custom_generate=hf_polybasic.generate, assistant_models=...)``.

    ``labels`` names each assistant (strongest first) for the report and the cache.
    """
    chain = list(assistant_models)
    if len(labels) != len(chain):
        raise ValueError(f"polybasic method {name!r}: {len(chain)} assistant models but {len(labels)} labels")

    def run(target, inputs, options):
        return target.generate(
            **inputs,
            custom_generate=polybasic_generate,
            assistant_models=chain,
            polybasic_config=config,
            **options,
        )

    parts = " <- ".join(["target", *labels])
    settings = config.to_dict()
    if len(chain) == 1:
        settings.pop("block_threshold")  # unused without an intermediate level
    if isinstance(chain[-1], Drafter):
        settings.pop("num_draft_tokens")  # K only limits model drafters; a Drafter sets its own length
    shown = ", ".join(f"{key}={value}" for key, value in settings.items() if key != "verification")
    description = f"hf_polybasic {len(chain) + 1} models: {parts}" + (f" ({shown})" if shown else "")
    spec = {"assistants": list(labels), "config": settings}
    return Method(name, "polybasic", description, spec, run, polybasic=True, level_labels=("target", *labels))


@dataclass(frozen=True)
class MethodOptions:
    """Settings shared by the named methods, so that they run with the same budget.

    ``num_draft_tokens`` is K for our model drafters and transformers' ``num_assistant_tokens``;
    ``block_threshold`` is mu of our 3-model chains; ``lookup_tokens`` / ``lookup_max_ngram`` are
    both prompt-lookup drafters' settings (ours and transformers').
    """

    num_draft_tokens: int = 4
    block_threshold: int = 8
    lookup_tokens: int = 8
    lookup_max_ngram: int = 3


@dataclass(frozen=True)
class Recipe:
    """A named method: the pool entries it needs and how to build it from a `ModelSet`."""

    name: str
    needs: tuple[str, ...]
    build: Callable[[ModelSet, MethodOptions], Method]


LOOKUPS = ("lookup", "lookup3")


def _lookup(options: MethodOptions, level: str = "lookup") -> tuple[Drafter, str]:
    """The `PromptLookup` a chain's bottom ``level`` ("lookup" or "lookup3") names, and its label."""
    tokens, longest = options.lookup_tokens, options.lookup_max_ngram
    if level == "lookup3":
        longest = max(longest, ADDED_LOOKUP_NGRAM)
        return (PromptLookup(max_ngram=longest, num_tokens=tokens, min_ngram=ADDED_LOOKUP_NGRAM),
                f"PromptLookup({tokens} tokens, {ADDED_LOOKUP_NGRAM}<=n<={longest})")
    return PromptLookup(max_ngram=longest, num_tokens=tokens), f"PromptLookup({tokens} tokens, n<={longest})"


def _chain(name: str, levels: tuple[str, ...], schedule: str = "constant", **settings) -> Recipe:
    """Ours over ``levels``, strongest first: pool keys ("mid", "draft", ...) and, at the bottom,
    "lookup" (a `PromptLookup`) or "lookup3" (one that copies only after a match of at least
    `hf_polybasic.request.ADDED_LOOKUP_NGRAM` tokens, as `PolybasicConfig(prompt_lookup=True)`'s). K and
    mu come from the shared options, ``settings`` are further `PolybasicConfig` fields; `polybasic` leaves
    the one a chain does not use out of the spec."""

    def build(ms: ModelSet, o: MethodOptions) -> Method:
        parts = [_lookup(o, level) if level in LOOKUPS else (ms.pool[level], ms.labels[level]) for level in levels]
        models, labels = [model for model, _ in parts], [label for _, label in parts]
        config = PolybasicConfig(num_draft_tokens=o.num_draft_tokens, block_threshold=o.block_threshold,
                                 schedule=schedule, **settings)
        return polybasic(models, labels, config, name)

    return Recipe(name, tuple(level for level in levels if level not in LOOKUPS), build)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe("plain", (), lambda ms, o: plain()),
        Recipe(
            "hf-assisted",
            ("draft",),
            lambda ms, o: hf_assisted(ms.pool["draft"], ms.labels["draft"], o.num_draft_tokens, "hf-assisted"),
        ),
        Recipe(
            "hf-assisted-fp32",
            ("draft-fp32",),
            lambda ms, o: hf_assisted(
                ms.pool["draft-fp32"], ms.labels["draft-fp32"], o.num_draft_tokens, "hf-assisted-fp32"
            ),
        ),
        Recipe(
            "hf-assisted-heuristic",
            ("draft",),
            lambda ms, o: hf_assisted(
                ms.pool["draft"], ms.labels["draft"], o.num_draft_tokens, "hf-assisted-heuristic", "heuristic"
            ),
        ),
        Recipe(
            "hf-assisted-default",
            ("draft",),
            lambda ms, o: hf_assisted(ms.pool["draft"], ms.labels["draft"], None, "hf-assisted-default"),
        ),
        Recipe("hf-lookup", (), lambda ms, o: hf_prompt_lookup(o.lookup_tokens, o.lookup_max_ngram)),
        Recipe(
            "hf-assisted-mid",
            ("mid",),
            lambda ms, o: hf_assisted(ms.pool["mid"], ms.labels["mid"], o.num_draft_tokens, "hf-assisted-mid"),
        ),
        _chain("ours-draft", ("draft",)),
        _chain("ours-draft-auto", ("draft",), "cost_aware"),  # the default (its drafter restricted to 65,536 ids)
        _chain("ours-draft-noalt-auto", ("draft",), "cost_aware", draft_alternatives=0),  # the default before them
        _chain("ours-draft-fullvocab-auto", ("draft",), "cost_aware", drafter_vocabulary=None),
        # the default with every CPU model forwarded through its few-row view (hf_polybasic.models.few_rows)
        _chain("ours-draft-fewrow-auto", ("draft",), "cost_aware", few_row_products=True),
        _chain("ours-draft-fullvocab-lookup-auto", ("draft", "lookup"), "cost_aware", drafter_vocabulary=None),
        _chain("ours-mid", ("mid",)),
        _chain("ours-mid-auto", ("mid",), "cost_aware"),
        _chain("ours-draft-fp32", ("draft-fp32",)),
        _chain("ours-lookup", ("lookup",), "cost_aware"),  # the default; a lone Drafter has nothing to schedule
        _chain("ours-mid-draft", ("mid", "draft")),
        _chain("ours-mid-draft-auto", ("mid", "draft"), "cost_aware"),
        _chain("ours-draft-lookup", ("draft", "lookup")),
        _chain("ours-draft-lookup-auto", ("draft", "lookup"), "cost_aware"),
        _chain("ours-draft-lookup3-auto", ("draft", "lookup3"), "cost_aware"),
        _chain("ours-mid-draft-lookup", ("mid", "draft", "lookup")),
        _chain("ours-mid-draft-lookup-auto", ("mid", "draft", "lookup"), "cost_aware"),
        _chain("ours-mid-lookup", ("mid", "lookup")),
        # the paper's shape: a 4-bit copy of the target as the middle level (hf_polybasic.models.int4, .four_bit)
        _chain("ours-midnf4-draft-auto", ("mid-nf4", "draft"), "cost_aware"),
        _chain("ours-midnf4-draft-lookup-auto", ("mid-nf4", "draft", "lookup"), "cost_aware"),
        _chain("ours-midint4-draft-auto", ("mid-int4", "draft"), "cost_aware"),
        # the drafter with its output layer restricted to 32k / 64k ids (hf_polybasic.models.vocab_head)
        *(
            _chain(f"ours-{key}{suffix}", (key, *lookup), schedule)
            for key in ("draft-h32k", "draft-h64k")
            for suffix, lookup, schedule in (("", (), "constant"), ("-auto", (), "cost_aware"),
                                             ("-lookup-auto", ("lookup",), "cost_aware"))
        ),
        # SmolLM2-135M, another tokenizer's model: translated (the tokens both vocabularies share, or through
        # text), alone or below the Qwen 0.5B drafter; and transformers' UAD / USD with a copy of its own
        *(_chain(f"ours-{name}{suffix}", levels, schedule)
          for name, levels in (("smol", ("smol",)), ("smol-text", ("smol-text",)), ("draft-smol", ("draft", "smol")))
          for suffix, schedule in (("", "constant"), ("-auto", "cost_aware"))),
        Recipe("hf-assisted-smol", ("smol-hf",),
               lambda ms, o: hf_other_tokenizer(ms.pool["smol-hf"], ms.labels["smol-hf"], o.num_draft_tokens,
                                                "hf-assisted-smol")),
        Recipe(
            "hf-assisted-draft-h64k",
            ("draft-h64k",),
            lambda ms, o: hf_assisted(ms.pool["draft-h64k"], ms.labels["draft-h64k"], o.num_draft_tokens,
                                      "hf-assisted-draft-h64k"),
        ),
    )
}

DEFAULT_METHODS = (
    "plain",
    "hf-assisted",
    "hf-lookup",
    "ours-draft",
    "ours-lookup",
    "ours-mid-draft",
    "ours-draft-lookup",
)


def resolve_names(names: Sequence[str] | None) -> list[str]:
    """The method names to run, ``plain`` (the baseline) first and always included."""
    names = list(DEFAULT_METHODS if not names else names)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {', '.join(RECIPES)}")
    names = list(dict.fromkeys(names))
    return ["plain"] + [n for n in names if n != "plain"]


def needed_pool(names: Sequence[str]) -> set[str]:
    return {key for name in names for key in RECIPES[name].needs}


def build_methods(model_set: ModelSet, names: Sequence[str], options: MethodOptions) -> list[Method]:
    return [RECIPES[name].build(model_set, options) for name in resolve_names(names)]
