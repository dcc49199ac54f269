"""Levels with a tokenizer of their own: the vocabulary two tokenizers share, a row's text in the level's
own tokens, and `translated` (`hf_polybasic.translation.level`), which makes such a model a level."""

from .level import Translated, translated

__all__ = ["Translated", "translated"]
