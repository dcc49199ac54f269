"""Does a chain share one vocabulary? Checks before a call, and a warning when agreement collapses.

Every token the target emits is fed to every assistant, so each assistant must be able to embed
every id the target can emit. What the target can emit is its tokenizer's vocabulary when the
tokenizer is known (padded output rows beyond it never win), else its output layer's rows; an
assistant may lack a few of those rows (padding: Qwen2.5 7B has 152,064 rows, 0.5B 151,936, the
tokenizer 151,665 ids), and if the target ever emits one of them the model runner raises a clear
error instead of an IndexError (`hf_polybasic.runners.dynamic.CachedModel`). Output rows an assistant has
beyond the target's are never proposed (they are cut), but far more rows than the target's mean
another tokenizer.

Two different tokenizers of the same size pass every size check; their models then almost never
agree. `warn_if_levels_disagree` reports that after the call, so a wrong chain is not silently slow.

A model with another tokenizer enters a chain translated (`hf_polybasic.levels.translated`), which
keeps its text in its own tokens; such a level is checked against the target's tokenizer there
(`hf_polybasic.translation.level.check_translated_levels`), not here.
"""

from __future__ import annotations


import torch

from .labels import model_label
from .user_warnings import warn

# an assistant may have this fraction fewer input ids than the target can emit (padding rows)
MAX_MISSING_FRACTION = 0.01
# and this many more output rows (absolute or relative, whichever is larger): padding of one tokenizer
MAX_EXTRA_ROWS = 256
MAX_EXTRA_FRACTION = 0.01
# a verifying level that accepted less than this share of at least MIN_DRAFTS model drafts in one
# row is reported (models that share a tokenizer accept far more; different tokenizers about 1 / V)
MIN_AGREEMENT = 0.02
MIN_DRAFTS = 32
# ... or, when the level below sat out most rounds (cost-aware back-off), at least this many
MIN_PROBE_DRAFTS = 4



def input_vocabulary_size(model: torch.nn.Module) -> int:
    """How many token ids ``model`` can embed."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, torch.nn.Embedding):
        return int(embeddings.num_embeddings)
    return int(model.config.get_text_config(decoder=True).vocab_size)

def as_id_list(value) -> list[int]:
    """Token ids from an int, a list or a tensor, in their order (the first EOS id matters)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def output_vocabulary_size(model: torch.nn.Module) -> int:
    """How many token ids ``model`` scores (its output rows)."""
    return int(model.config.get_text_config(decoder=True).vocab_size)


def check_chain_vocabularies(target, assistants, tokenizer=None) -> None:
    """Raise a `ValueError` naming the models and sizes unless every assistant can embed every id
    the target can emit and their output layers and special tokens look like one tokenizer's.

    ``assistants`` are the models of ``assistant_models`` (Drafters left out), in order, with their
    positions in that list: ``[(position, model), ...]``.
    """
    emitted = output_vocabulary_size(target)
    source = f"the target {model_label(target)} can emit"
    if tokenizer is not None:
        emitted, source = len(tokenizer), "the tokenizer has"
    target_config = target.config.get_text_config(decoder=True)
    for position, assistant in assistants:
        where = f"assistant_models[{position}] {model_label(assistant)}"
        representable = input_vocabulary_size(assistant)
        missing = emitted - representable
        if tokenizer is not None and missing > 0:
            raise ValueError(
                f"{source} {emitted} ids but {where} can embed only {representable} token ids: every token the "
                "target emits is fed to every assistant. Every model of a chain must use the target's tokenizer, or be "
                "wrapped in hf_polybasic.levels.translated(model, its_tokenizer, target_tokenizer)"
            )
        if missing > MAX_MISSING_FRACTION * emitted:
            raise ValueError(
                f"{where} has {representable} token ids but {source} {emitted} ({representable} vs {emitted}): "
                "every token the target emits is fed to every assistant. Every model of a chain must use the "
                "target's tokenizer (output layers may differ only by padding), or be wrapped in "
                "hf_polybasic.levels.translated(model, its_tokenizer, target_tokenizer)"
            )
        rows, target_rows = output_vocabulary_size(assistant), output_vocabulary_size(target)
        if rows - target_rows > max(MAX_EXTRA_ROWS, MAX_EXTRA_FRACTION * target_rows):
            raise ValueError(
                f"{where} scores {rows} token ids, far more than the target {model_label(target)} "
                f"({rows} vs {target_rows}): they do not share a tokenizer. Every model of a chain must use the "
                "target's tokenizer (output layers may differ only by padding), or be wrapped in "
                "hf_polybasic.levels.translated(model, its_tokenizer, target_tokenizer)"
            )
        config = assistant.config.get_text_config(decoder=True)
        for name in ("bos_token_id", "eos_token_id"):
            mine = set(as_id_list(getattr(config, name, None)))
            theirs = set(as_id_list(getattr(target_config, name, None)))
            if mine and theirs and not mine & theirs:
                raise ValueError(
                    f"{where} and the target {model_label(target)} disagree on {name}: {sorted(mine)} vs "
                    f"{sorted(theirs)}; they do not share a tokenizer (a model with its own tokenizer goes in the chain as "
                    "hf_polybasic.levels.translated(model, its_tokenizer, target_tokenizer))"
                )
        if tokenizer is not None:
            _check_special_tokens(tokenizer, where, config)


def _check_special_tokens(tokenizer, where: str, config) -> None:
    for name in ("eos_token_id", "bos_token_id"):
        theirs = getattr(tokenizer, name, None)
        mine = set(as_id_list(getattr(config, name, None)))
        if theirs is not None and mine and int(theirs) not in mine:
            raise ValueError(
                f"the tokenizer's {name} is {theirs} but {where} has {sorted(mine)}; every model of a chain must "
                "use the target's tokenizer, or be wrapped in hf_polybasic.levels.translated(model, its_tokenizer, "
                "target_tokenizer)"
            )


# why a level may agree this little with the one above it, by its kind (`warn_if_levels_disagree`)
DISAGREEMENT_HINTS = {
    "model": "Models that share a tokenizer rarely agree this little: check that every model of the chain uses "
             "the target's tokenizer.",
    "translated": "It drafts through a tokenizer of its own, and on this text its tokens rarely line up with the "
                  "target's: try route='text' for it, or a drafter with the target's tokenizer.",
    "head": "A head agrees this little when it was trained for another model or on other text: check draft_head's "
            "verifier= and what the head was trained on.",
}


def warn_if_levels_disagree(stats, kinds: list[str]) -> bool:
    """Warn when a verifying level accepted almost none of the drafts of the level below it in one
    row's decoding (rows of a batch may repeat one prompt, so their sum proves nothing): at least
    `MIN_DRAFTS` drafts, or a few drafts after which the cost-aware schedule sat the level out for
    most rounds. True if it warned.

    ``kinds[i]`` is what level i (target first) is: "model", "translated" (another tokenizer's model),
    "head" (a draft head) or "drafter" (a `Drafter` proposes only where it finds something to copy,
    so its low agreement is no sign of anything wrong: never warned about); the warning's hint is the
    kind's (`DISAGREEMENT_HINTS`).
    """
    for index, level in enumerate(stats.levels[:-1]):
        below = stats.levels[index + 1]
        hint = DISAGREEMENT_HINTS.get(kinds[index + 1])
        if hint is None or level.drafted < MIN_PROBE_DRAFTS:
            continue
        sat_out = below.paused_rounds >= max(level.verifications, 1) / 2
        if (level.drafted >= MIN_DRAFTS or sat_out) and level.accepted < MIN_AGREEMENT * level.drafted:
            pause = f", then let {level.name} decode alone for {below.paused_rounds} rounds" if sat_out else ""
            warn(
                f"{level.name} accepted {level.accepted} of {level.drafted} drafts from {below.name} "
                f"({level.accepted / level.drafted:.1%}){pause}. {hint} Such a chain is no faster than plain "
                "generate.")
            return True
    return False
