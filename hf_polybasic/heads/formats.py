"""Head checkpoints as their publishers write them, told apart by their own ``config.json``:

=====================  ==================================================  ===================================
format                 config.json says                                    loaded by
=====================  ==================================================  ===================================
speculators            ``speculators_model_type``: ``"eagle"``/``"eagle3"``  `eagle.speculators_eagle`,
                                                                           `eagle3.speculators_eagle3`
EAGLE-3 (SafeAILab,    ``draft_vocab_size`` (or ``midlayer.*`` weights)    `eagle3.safeailab_eagle3`
SpecForge)
EAGLE-1/2 (SafeAILab)  a Llama config; weights ``fc.weight``, ``layers.*``  `eagle.safeailab_eagle`
=====================  ==================================================  ===================================

Each loader checks that the checkpoint fits its verifier (hidden size, vocabulary, the layers it reads)
and that every weight is accounted for (`hf_polybasic.heads.weights`) before a head exists.
"""

from __future__ import annotations

from .base import DraftHead
from .eagle import safeailab_eagle, speculators_eagle
from .eagle3 import safeailab_eagle3, speculators_eagle3
from .weights import VerifierShape, checkpoint_directory, read_config, read_weights, where

SPECULATORS = {"eagle": speculators_eagle, "eagle3": speculators_eagle3}


def checkpoint_format(config: dict, keys, source):
    """The loader of a checkpoint with this ``config.json`` and these weight ``keys``."""
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind not in SPECULATORS:
            raise ValueError(f"{where(source)}: speculators_model_type is {kind!r}; draft_head reads speculators' "
                             f"{' and '.join(repr(name) for name in SPECULATORS)} heads")
        return SPECULATORS[kind]
    if "draft_vocab_size" in config or any(key.startswith("midlayer.") for key in keys):
        return safeailab_eagle3
    if "fc.weight" in keys and any(key.startswith("layers.") for key in keys):
        return safeailab_eagle
    raise ValueError(f"{where(source)}: not a head checkpoint draft_head reads: its config.json has no "
                     "speculators_model_type (speculators) nor draft_vocab_size (EAGLE-3), and its weights are not "
                     "EAGLE-1/2's (fc.weight and layers.*)")


def load_head(source, verifier) -> DraftHead:
    """The head checkpoint at ``source`` (a local directory, or a Hub id resolved in the HF cache or
    downloaded) as a `DraftHead` for ``verifier``: its weights in the verifier's dtype, on the device of
    its LM head; the verifier's embeddings (and EAGLE-1/2's LM head) shared, not copied."""
    directory = checkpoint_directory(source)
    config = read_config(directory, source)
    state = read_weights(directory, source)
    load = checkpoint_format(config, state, source)
    return load(config, state, VerifierShape.of(verifier), source)
