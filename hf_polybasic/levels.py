"""Building the levels of a chain from the target itself: cheaper copies and early exits.

* `quantized_copy(target, method)`: an independent, cheaper copy of the target (the paper's M2 is
  a 4-bit copy of M1). Nothing mutable is shared with the target.
* `early_exit(model, num_layers)`: the model's first layers with its final norm and head, sharing
  the weights (no copy) but used with its own cache: a self-drafting level usable anywhere in a
  chain.
* `restricted_vocabulary(model, keep)`: the model with an output layer that scores only a subset
  of the vocabulary (-inf elsewhere), sharing the weights: a cheaper drafter
  (`hf_polybasic.models.vocab_head`).
* `draft_head(source, verifier=model)`: a trained draft head (EAGLE-1/2/3 checkpoints, or a model's
  native MTP layers) that drafts from the hidden states of the level right above it
  (`hf_polybasic.heads`).
* `translated(model, tokenizer, target_tokenizer)`: a model with a tokenizer of its own, at any depth:
  it keeps its text in its own tokens and scores the tokens the two vocabularies share
  (`hf_polybasic.translation`).
* Model-free drafters live in `hf_polybasic.drafters` (`PromptLookup`, and the `Drafter`
  interface for your own) and are re-exported here.

Any of these goes into ``assistant_models``; the chain stays lossless whatever they output. This
module only names them; they are built in `hf_polybasic.models` and `hf_polybasic.drafters`.
"""

from .drafters import Drafter, PromptLookup
from .heads import draft_head
from .models.copies import QUANTIZATION_METHODS, early_exit, quantized_copy
from .models.vocab_head import restricted_vocabulary
from .translation import translated

__all__ = ["Drafter", "PromptLookup", "QUANTIZATION_METHODS", "draft_head", "early_exit", "quantized_copy",
           "restricted_vocabulary", "translated"]
