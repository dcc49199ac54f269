"""A trained head written as vllm-project/speculators writes an EAGLE-3 checkpoint, so speculators, vLLM
and `hf_polybasic.levels.draft_head` read it: ``config.json`` and ``model.safetensors``.

What speculators writes (vllm-project/speculators @ c05b95b, read 2026-11-28): its trainer builds the
head with ``Eagle3DraftModel.from_training_args`` (``src/speculators/models/eagle3/core.py``) on the
``transformer_layer_config`` that ``scripts/train.py``'s ``create_transformer_layer_config`` derives from
the verifier (a ``LlamaConfig``: the verifier's vocabulary, hidden size, heads, ``intermediate_size`` and
RoPE; ``num_layers`` layers, SiLU, untied), and saves it with ``save_pretrained`` through
``train/checkpointer.py`` (floats cast to ``bfloat16``, ``config.json``'s dtype patched to match). The
config is ``Eagle3SpeculatorConfig`` (``models/eagle3/config.py``) with its trainer's EAGLE-3 defaults:
``norm_before_residual``, ``norm_before_fc`` and ``norm_output`` true, ``fc_norm`` false, the layer
config serialised by ``to_diff_dict``, ``speculators_config`` naming the verifier and a greedy proposal of
``speculative_tokens`` tokens. Weights: the module's state dict less ``verifier_norm``/``verifier_lm_head``
(``_keys_to_ignore_on_save``): ``layers.<i>.*``, ``fc.weight``, ``input_norm.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``/``t2d`` (only with a reduced vocabulary: ``DraftVocabMixin``) and
``embed_tokens.weight``. The embeddings are the verifier's own, frozen; they are written only where
``save_embeddings`` asks (speculators lists the key in ``_keys_to_ignore_on_load_missing`` and fills it from
the verifier, vLLM shares the target's, and `draft_head` shares the verifier's): for a 150k-id vocabulary
they are twice the rest of the head.

Initial weights are speculators': linear layers N(0, ``initializer_range``), norms one, and the output
layer the verifier's own rows of the draft vocabulary (``load_verifier_weights``), frozen unless asked.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import torch

from ..heads.eagle3 import SPECULATORS_RENAMES, speculators_eagle3, speculators_eagle3_skeleton
from ..heads.weights import VerifierShape

SPECULATORS_VERSION = "0.7.0"  # the release of the layout above (its setup.py LAST_RELEASE_VERSION)
SLIDING_WINDOW = 2048  # create_transformer_layer_config's default; every layer is full attention here
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default ``eagle_aux_hidden_state_layer_ids`` (``resolve_target_layer_ids``): the inputs of
    layers 2, L//2 and L-3, three distinct layers from 7 layers on."""
    layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) < 3 or min(layers) < 0:
        raise ValueError(f"train_head: the model has {num_layers} layers; EAGLE-3's default layers (the inputs of 2, "
                         "L//2 and L-3) are three distinct layers only from 7 layers on: pass aux_layers, distinct "
                         f"layer ids in 0 .. {num_layers - 1}")
    return layers


def layer_config(verifier, num_layers: int, intermediate_size: int | None):
    """The head's ``LlamaConfig``, as speculators' ``create_transformer_layer_config`` derives it from the
    verifier's config (full attention in every layer)."""
    from transformers import LlamaConfig

    source = verifier.config.get_text_config(decoder=True)
    hidden, heads = source.hidden_size, source.num_attention_heads
    kv_heads = getattr(source, "num_key_value_heads", None) or heads
    head_dim = getattr(source, "head_dim", None)
    if head_dim and hidden % heads and not hidden % head_dim:
        heads = hidden // head_dim
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    inner = intermediate_size or getattr(source, "intermediate_size", None) or 3 * hidden
    config = LlamaConfig(vocab_size=source.vocab_size, hidden_size=hidden, intermediate_size=inner,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         hidden_act="silu", max_position_embeddings=getattr(source, "max_position_embeddings", 2048),
                         initializer_range=getattr(source, "initializer_range", 0.02),
                         rms_norm_eps=getattr(source, "rms_norm_eps", None) or 1e-6, head_dim=head_dim,
                         tie_word_embeddings=False, sliding_window=SLIDING_WINDOW, use_sliding_window=False,
                         layer_types=["full_attention"] * num_layers)
    rope = copy.deepcopy(getattr(source, "rope_parameters", None))
    if isinstance(rope, dict) and "rope_theta" in rope:  # transformers >= 5
        for key in ("type", "mrope_interleaved") + (() if "mrope_section" in rope else ("partial_rotary_factor",)):
            rope.pop(key, None)
        config.rope_parameters = rope
    else:
        config.rope_theta = getattr(source, "rope_theta", None) or 10000.0
    return config


def eagle3_config(verifier, layers, *, draft_vocab_size: int, aux_layers: list[int], speculative_tokens: int,
                  save_dtype: str) -> dict:
    """``config.json`` of the head (see the module docstring); ``layers``: its `layer_config`."""
    import transformers

    config = verifier.config
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layers.to_diff_dict(),
        "draft_vocab_size": draft_vocab_size,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": True,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": getattr(config, "name_or_path", None) or None,
                         "architectures": list(getattr(config, "architectures", None) or [type(verifier).__name__])},
        },
        "dtype": save_dtype,
        "transformers_version": transformers.__version__,
    }


def training_shape(verifier, device) -> VerifierShape:
    """The verifier as a head trained on ``device`` in float32 sees it."""
    return dataclasses.replace(VerifierShape.of(verifier), dtype=torch.float32, device=torch.device(device))


def _theirs(key: str) -> str:
    for publisher, ours in SPECULATORS_RENAMES:
        if key.startswith(ours):
            return publisher + key[len(ours):]
    return key


def initial_weights(config: dict, verifier, ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """speculators' initial weights of the head ``config`` describes (see the module docstring), float32,
    by speculators' key names, with ``d2t``/``t2d`` for the draft vocabulary ``ids`` where it is reduced."""
    from .vocabulary import vocabulary_maps

    shape = training_shape(verifier, "cpu")
    skeleton, layers, draft_vocab = speculators_eagle3_skeleton(config, shape, "train_head")
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(layers, "initializer_range", 0.02))
    rows = verifier.get_output_embeddings().weight.detach()[ids.to(shape.lm_head.weight.device)].float().cpu()
    weights = {}
    for key, value in sorted(skeleton.state_dict(keep_vars=True).items()):
        if key == "lm_head.weight":
            weights[key] = rows.clone()
        elif key.endswith("norm.weight") or ".fc_norm." in key:
            weights[_theirs(key)] = torch.ones(value.shape)
        elif key.endswith(".bias"):
            weights[_theirs(key)] = torch.zeros(value.shape)
        else:
            weights[_theirs(key)] = torch.randn(value.shape, generator=generator) * std
    if draft_vocab != shape.vocab_size:
        weights["d2t"], weights["t2d"] = vocabulary_maps(ids, shape.vocab_size)
    return weights


def build_head(config: dict, weights: dict[str, torch.Tensor], verifier, device):
    """The head ``config`` and ``weights`` (speculators' keys) describe, float32 on ``device``, through the
    loader `draft_head` uses (so what is trained is what it will load)."""
    return speculators_eagle3(config, dict(weights), training_shape(verifier, device), "train_head")


def exported_weights(head, verifier, config: dict, save_embeddings: bool) -> dict[str, torch.Tensor]:
    """The head's weights by speculators' key names, floats in ``config``'s dtype, on the CPU (see the
    module docstring)."""
    from .vocabulary import vocabulary_maps

    dtype = SAVE_DTYPES[config["dtype"]]
    vocab = verifier.config.get_text_config(decoder=True).vocab_size
    weights = {_theirs(key): value.detach() for key, value in head.state_dict().items()}
    if config["draft_vocab_size"] != vocab:
        weights["d2t"], weights["t2d"] = vocabulary_maps(head.draft_ids.cpu(), vocab)
    if save_embeddings:
        weights["embed_tokens.weight"] = verifier.get_input_embeddings().weight.detach()
    return {key: value.to(device="cpu", dtype=dtype if value.is_floating_point() else value.dtype).contiguous()
            for key, value in weights.items()}


def write_checkpoint(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """``config.json`` and ``model.safetensors`` (``{"format": "pt"}`` metadata, as ``save_pretrained``),
    each replacing the old one whole."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / "model.safetensors.partial"
    save_file(weights, str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / "model.safetensors")
    (directory / "config.json.partial").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(directory / "config.json.partial", directory / "config.json")
    return directory
