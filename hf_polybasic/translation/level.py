"""`translated(model, tokenizer, target_tokenizer)`: a level with a tokenizer of its own, at any depth.

A chain's levels verify one another token by token, so every level scores the target's ids. A model
with another tokenizer becomes such a level through a translation (`hf_polybasic.runners.translated`):
it keeps its own text in its own tokens (`hf_polybasic.translation.context`), and hands up drafts in
the target's ids. Two routes:

* ``route="shared"`` (any depth, greedy or sampling): the level scores the tokens the two
  vocabularies share (`hf_polybasic.translation.shared`), its logits written at their twins' ids and
  -inf elsewhere; the chain's processors then run on the target's ids (a repetition penalty sees the
  target's tokens) and the level samples from, and reports, its distribution over that shared
  vocabulary. This is `restricted_vocabulary`'s argument with a fixed set: a draft's distribution is
  exactly what it was drawn from, so speculative sampling stays exact, and a level in the middle
  emits an exact sample of that distribution. Tokens outside the shared set are only ever emitted by
  the level above.
* ``route="text"`` (the bottom only): the level drafts greedily over its whole vocabulary, and its
  drafted text is encoded by the target's tokenizer (transformers' UAD): every draft is a point mass,
  exact under greedy decoding and sampling alike.

Neither changes ``model``, its generation config or the tokenizers (transformers' TLI prunes the
assistant's output layer in place and switches its repetition penalty off).
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import PreTrainedTokenizerBase

from ..labels import model_label
from ..vocabulary import MAX_EXTRA_FRACTION, MAX_EXTRA_ROWS, input_vocabulary_size, output_vocabulary_size
from .shared import SharedVocabulary

ROUTES = ("shared", "text")


class Translated:
    """A model with its own tokenizer, as a level of a chain whose target uses ``target_tokenizer``
    (made by `translated`; see the module docs).

    Attributes: ``model``, ``tokenizer``, ``target_tokenizer``, ``route`` ("shared" or "text") and
    ``shared`` (the `SharedVocabulary` of the two tokenizers).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, target_tokenizer, route: str, shared: SharedVocabulary):
        self.model, self.tokenizer, self.target_tokenizer = model, tokenizer, target_tokenizer
        self.route, self.shared = route, shared

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __repr__(self) -> str:
        return f"translated {'through text ' if self.route == 'text' else ''}{model_label(self.model)}"


_shared_vocabularies = threading.local()  # per thread: (own tokenizer, target tokenizer) -> SharedVocabulary


def shared_vocabulary(tokenizer, target_tokenizer) -> SharedVocabulary:
    """The `SharedVocabulary` of two tokenizers, made once per pair (a large vocabulary takes a second)."""
    made = getattr(_shared_vocabularies, "made", None)
    if made is None:
        made = _shared_vocabularies.made = weakref.WeakKeyDictionary()
    by_target = made.setdefault(tokenizer, weakref.WeakKeyDictionary())
    if target_tokenizer not in by_target:
        by_target[target_tokenizer] = SharedVocabulary(tokenizer, target_tokenizer)
    return by_target[target_tokenizer]


def translated(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase,
               route: str = "shared") -> Translated:
    """``model``, whose tokenizer is ``tokenizer``, as a level of a chain whose target uses
    ``target_tokenizer``: put the result anywhere in ``assistant_models`` (``route="text"``: last).

    Args:
        model: a causal LM (left unchanged).
        tokenizer: ``model``'s tokenizer (a fast tokenizer: byte-level BPE or SentencePiece-style).
        target_tokenizer: the target's tokenizer.
        route: "shared" (the level scores the tokens both vocabularies share; any depth, greedy or
            sampling) or "text" (greedy drafts re-encoded through text; the bottom only). See the
            module docs.
    """
    if route not in ROUTES:
        raise ValueError(f"translated: route must be one of {ROUTES}, got {route!r}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"translated: model must be a transformers model (nn.Module with a config), got "
                        f"{type(model).__name__}")
    for name, value in (("tokenizer", tokenizer), ("target_tokenizer", target_tokenizer)):
        if value is None or not hasattr(value, "convert_ids_to_tokens"):
            raise TypeError(f"translated: {name} must be a transformers tokenizer, got {type(value).__name__}")
    if len(tokenizer) > input_vocabulary_size(model):
        raise ValueError(f"translated: the tokenizer has {len(tokenizer)} ids but {model_label(model)} embeds only "
                         f"{input_vocabulary_size(model)}; pass the model's own tokenizer")
    shared = shared_vocabulary(tokenizer, target_tokenizer)
    if len(shared) == 0:
        raise ValueError("translated: the two tokenizers share no token (no token of one spells the same text as a "
                         "token of the other); such a level could never propose anything")
    return Translated(model, tokenizer, target_tokenizer, route, shared)


def model_of(level):
    """The model a level runs: a translated level's own model, else the level itself."""
    return level.model if isinstance(level, Translated) else level


def check_translated_levels(target: torch.nn.Module, levels: list, tokenizer=None) -> None:
    """Raise a `ValueError` unless each translated level of ``levels`` (``assistant_models``, in order)
    was made for the target's tokenizer: ``target_tokenizer`` has no more ids than the target scores
    (and not far fewer), and is ``tokenizer`` where the call names one; ``route="text"`` only last."""
    rows = output_vocabulary_size(target)
    for position, level in enumerate(levels):
        if not isinstance(level, Translated):
            continue
        where = f"assistant_models[{position}] ({level!r})"
        size = len(level.target_tokenizer)
        if size > rows or rows - size > max(MAX_EXTRA_ROWS, MAX_EXTRA_FRACTION * rows):
            raise ValueError(
                f"{where} was made for a target tokenizer of {size} ids, but the target {model_label(target)} scores "
                f"{rows}: pass the target's own tokenizer as target_tokenizer")
        other = tokenizer is not None and (len(tokenizer), tokenizer.eos_token_id) != (
            size, level.target_tokenizer.eos_token_id)
        if other:
            raise ValueError(
                f"{where} was made for another target tokenizer than the call's tokenizer= ({size} vs {len(tokenizer)} "
                "ids); pass the same tokenizer to translated(...) as target_tokenizer")
        if level.route == "text" and position != len(levels) - 1:
            raise ValueError(
                f"{where} drafts through text (route='text'), which only a bottom level can: its drafts are point "
                "masses, not a distribution to verify with. Put it last in assistant_models, or use route='shared'")
