"""The decoding methods the benchmark compares, and the model sets they run on.

A `Method` is a name, a JSON description of its settings (results are cached under it) and a
``run(target, inputs, options)`` callable that calls ``target.generate`` once and returns the
sequences. The factories build the methods:

* `plain`: transformers' own ``generate``, the baseline every speedup is relative to;
* `hf_assisted`: transformers' ``assistant_model=``, by default with a fixed draft length (constant
  schedule, no confidence threshold; or transformers' heuristic schedule, or its defaults), the
  assistant's generation-config fields restored after each call;
* `hf_prompt_lookup`: transformers' ``prompt_lookup_num_tokens=``;
* `polybasic`: ours, ``custom_generate=hf_polybasic.generate`` with any ``assistant_models`` list
  and `PolybasicConfig`; its per-level statistics come from `hf_polybasic.last_stats`.

`build_model_set` loads a target, its tokenizer and the *pool* of cheaper models the named methods
in `RECIPES` draw on: ``"tiny"`` (random models from `hf_polybasic.testing`, for tests and CI) or
``"qwen"`` (Qwen2.5-Coder 1.5B target; 0.5B fp32 and int8-dynamic copies and an int8-dynamic copy of
the 1.5B in the pool). Only the pool entries the selected methods need are built.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from ..config import PolybasicConfig
from ..drafters import Drafter, PromptLookup
from ..integration import generate as polybasic_generate
from ..integration import last_stats
from ..levels import quantized_copy
from ..stats import PolybasicStats

RunFn = Callable[[torch.nn.Module, dict, dict], torch.Tensor]

# assistant generation-config fields that hf_assisted sets for its call and then restores
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"
TARGET_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
def plain(name: str = "plain") -> Method:
    """transformers' own ``generate``: the baseline."""

    def run(target, inputs, options):
        return target.generate(**inputs, **options)

    return Method(name, "plain", "transformers generate (baseline)", {}, run)


def hf_assisted(
    assistant: torch.nn.Module,
    label: str,
    num_assistant_tokens: int | None = 4,
    name: str = "hf-assisted",
    schedule: str = "constant",
    confidence_threshold: float = 0.0,
) -> Method:
    """transformers' ``assistant_model=``.

    By default K = ``num_assistant_tokens`` drafts per round, constant schedule and no confidence
    threshold (a like-for-like two-model comparison); ``schedule="heuristic"`` is transformers'
    adaptive K. ``num_assistant_tokens=None`` leaves every assistant field unset, i.e.
    transformers' defaults as a user gets them (5.23: 20 tokens, constant, confidence threshold
    0.4, adapted online only when scikit-learn is installed). The assistant's generation-config
    fields are set for the call and restored afterwards.
    """
    if num_assistant_tokens is None:
        settings = {}
    else:
        settings = {
            "num_assistant_tokens": num_assistant_tokens,
            "num_assistant_tokens_schedule": schedule,
            "assistant_confidence_threshold": confidence_threshold,
        }

    def run(target, inputs, options):
        config = assistant.generation_config
        saved = {key: getattr(config, key, None) for key in ASSISTANT_FIELDS}
        for key, value in settings.items():
            setattr(config, key, value)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its per-call notice about generation_config
        try:
            return target.generate(**inputs, assistant_model=assistant, **options)
        finally:
            transformers.logging.set_verbosity(verbosity)
            for key, value in saved.items():
                setattr(config, key, value)

    if num_assistant_tokens is None:
        description = f"transformers assistant_model= {label} (transformers' defaults)"
    else:
        description = f"transformers assistant_model= {label} (K={num_assistant_tokens}, {schedule} schedule)"
    return Method(name, "hf-assisted", description, {"assistant": label, **settings}, run)


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


# ------------------------------------------------------------------------------------ model sets
@dataclass
class ModelSet:
    """A target, its tokenizer and the pool of cheaper models the methods draw on.

    Attributes:
        name: "tiny" or "qwen".
        pool: built entries among "mid" (a strong, cheap copy of the target, used as an
            intermediate), "draft" (the small drafter, int8) and "draft-fp32".
        labels: a short human name for the target and each pool entry.
        context_length: prompts are cut (oldest tokens first) so prompt + budget fits; None = no cut.
        info: JSON description of the models, recorded with the results.
        generate_options: extra ``generate`` options for every method (the tiny set ignores EOS, so
            that every call of its random models generates the whole budget).
    """

    name: str
    target: torch.nn.Module
    tokenizer: Any
    pool: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    context_length: int | None = None
    info: dict = field(default_factory=dict)
    generate_options: dict = field(default_factory=dict)


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


def _lookup(options: MethodOptions) -> Drafter:
    return PromptLookup(max_ngram=options.lookup_max_ngram, num_tokens=options.lookup_tokens)


def _lookup_label(options: MethodOptions) -> str:
    return f"PromptLookup({options.lookup_tokens} tokens, n<={options.lookup_max_ngram})"


def _chain(name: str, levels: tuple[str, ...], schedule: str = "constant") -> Recipe:
    """Ours over ``levels``, strongest first: pool keys ("mid", "draft", ...) and, at the bottom,
    "lookup" (a `PromptLookup`). K and mu come from the shared options; `polybasic` leaves the one
    a chain does not use out of the spec."""

    def build(ms: ModelSet, o: MethodOptions) -> Method:
        models = [_lookup(o) if level == "lookup" else ms.pool[level] for level in levels]
        labels = [_lookup_label(o) if level == "lookup" else ms.labels[level] for level in levels]
        config = PolybasicConfig(num_draft_tokens=o.num_draft_tokens, block_threshold=o.block_threshold, schedule=schedule)
        return polybasic(models, labels, config, name)

    return Recipe(name, tuple(level for level in levels if level != "lookup"), build)


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
        _chain("ours-draft-auto", ("draft",), "cost_aware"),
        _chain("ours-mid", ("mid",)),
        _chain("ours-mid-auto", ("mid",), "cost_aware"),
        _chain("ours-draft-fp32", ("draft-fp32",)),
        _chain("ours-lookup", ("lookup",), "cost_aware"),  # the default; a lone Drafter has nothing to schedule
        _chain("ours-mid-draft", ("mid", "draft")),
        _chain("ours-mid-draft-auto", ("mid", "draft"), "cost_aware"),
        _chain("ours-draft-lookup", ("draft", "lookup")),
        _chain("ours-draft-lookup-auto", ("draft", "lookup"), "cost_aware"),
        _chain("ours-mid-draft-lookup", ("mid", "draft", "lookup")),
        _chain("ours-mid-draft-lookup-auto", ("mid", "draft", "lookup"), "cost_aware"),
        _chain("ours-mid-lookup", ("mid", "lookup")),
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


TINY_LABELS = {
    "mid": "tiny-mid (noise 0.05)",
    "draft": "tiny-draft-int8 (noise 0.2)",
    "draft-fp32": "tiny-draft-fp32 (noise 0.2)",
}
QWEN_LABELS = {"mid": "1.5B-int8", "draft": "0.5B-int8", "draft-fp32": "0.5B-fp32"}
TINY_OPTIONS = {"eos_token_id": None}  # random models: every call generates the whole budget


def build_model_set(
    models: str, needs: set[str], target_dtype: str = "fp32", cache_dir=None, load: bool = True
) -> ModelSet:
    """The target, tokenizer and the pool entries in ``needs``.

    With ``load=False`` nothing is loaded: the models are None and only the names and the
    description are filled in (enough to describe a run, e.g. to rebuild a report).
    """
    if target_dtype not in TARGET_DTYPES:
        raise ValueError(f"target dtype must be one of {list(TARGET_DTYPES)}, got {target_dtype!r}")
    if models not in ("tiny", "qwen"):
        raise ValueError(f"--models must be 'tiny' or 'qwen', got {models!r}")
    needs = {key for key in ("mid", "draft", "draft-fp32") if key in needs}
    if models == "tiny":
        labels = {"target": f"tiny random Qwen2 target ({target_dtype})", **{k: TINY_LABELS[k] for k in needs}}
        info = {"models": "tiny", "target": labels["target"], "generate": TINY_OPTIONS}
        model_set = ModelSet("tiny", None, None, {k: None for k in needs}, labels, None, info, dict(TINY_OPTIONS))
    else:
        labels = {"target": f"Qwen2.5-Coder-1.5B-Instruct ({target_dtype})", **{k: QWEN_LABELS[k] for k in needs}}
        info = {
            "models": "qwen",
            "target": f"{QWEN_TARGET} ({target_dtype})",
            "int8": "hf_polybasic.levels.quantized_copy(model_fp32, 'int8-dynamic'): torch quantize_dynamic, "
            "per-channel int8 weights, dynamic int8 activations, every nn.Linear",
            "weights": "GGUF Q4_K_M dequantized to fp32 (hf_polybasic.models)",
        }
        model_set = ModelSet("qwen", None, None, {k: None for k in needs}, labels, None, info)
    model_set.info["pool"] = {k: labels[k] for k in sorted(needs)}
    if load:
        if models == "tiny":
            _load_tiny(model_set, target_dtype)
        else:
            _load_qwen(model_set, target_dtype, cache_dir)
    return model_set


def _load_tiny(model_set: ModelSet, target_dtype: str) -> None:
    from ..testing import make_chain, make_tokenizer

    target, mid, draft = make_chain("qwen2", depth=3, seed=0)
    model_set.target = target.to(TARGET_DTYPES[target_dtype])
    model_set.tokenizer = make_tokenizer()
    model_set.context_length = target.config.max_position_embeddings
    built = {"mid": lambda: mid, "draft": lambda: quantized_copy(draft, "int8-dynamic"), "draft-fp32": lambda: draft}
    for key in model_set.pool:
        model_set.pool[key] = built[key]()


def _load_qwen(model_set: ModelSet, target_dtype: str, cache_dir) -> None:
    from .. import models

    pool = model_set.pool
    # The int8 copies are made from fresh fp32 loads *before* the target is loaded, so that the
    # peak memory holds one fp32 1.5B and its copy, never two fp32 1.5Bs and a copy.
    if "mid" in pool:
        fresh, _ = models.load(QWEN_TARGET, dtype=torch.float32, cache_dir=cache_dir)
        pool["mid"] = quantized_copy(fresh, "int8-dynamic")
        del fresh
        gc.collect()
    if "draft" in pool or "draft-fp32" in pool:
        small, _ = models.load(QWEN_DRAFT, dtype=torch.float32, cache_dir=cache_dir)
        if "draft" in pool:
            pool["draft"] = quantized_copy(small, "int8-dynamic")
        if "draft-fp32" in pool:
            pool["draft-fp32"] = small
        del small
        gc.collect()
    model_set.target, model_set.tokenizer = models.load(
        QWEN_TARGET, dtype=TARGET_DTYPES[target_dtype], cache_dir=cache_dir
    )
