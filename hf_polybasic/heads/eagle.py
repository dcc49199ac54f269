"""EAGLE-1/2 heads (Li et al. 2024): ``fc(cat(embed(token), feature))`` through decoder layers whose first
has no input norm, then the verifier's own LM head; the feature is the verifier's last hidden state
after its final norm, and the head's output is its prediction of the next position's feature.

Read from the layouts their publishers write (`hf_polybasic.heads.formats` finds which):

* **SafeAILab** (SafeAILab/EAGLE ``eagle/model/cnets1.py``, class ``Model``, and ``ea_model.py``, which
  loads it): a Llama config (``num_hidden_layers`` layers; ``bias``, the fc bias, true unless said;
  ``qkv_bias`` where present); weights ``fc.weight``, ``fc.bias``, ``layers.<i>.*`` (layer 0 without
  ``input_layernorm``), ``embed_tokens.weight`` where shipped. EAGLE-2 heads are the same module (only
  the tree search differs, which a chain does not use).
* **speculators** (vllm-project/speculators ``src/speculators/models/eagle.py``, class
  ``EagleSpeculator``, before its removal in 792b9e6c): ``speculators_model_type: "eagle"``,
  ``transformer_layer_config`` (the verifier's config: one layer of its type is built),
  ``fusion_bias``, ``layernorms`` (HASS-style: ``embedding_layernorm`` on the embeddings, the layer's own
  ``input_layernorm``, ``pre_lm_head_layernorm`` before the LM head); weights ``fusion_fc.*``,
  ``transformer.*``; embeddings and LM head are the verifier's.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, LlamaConfig

from .. import compat
from .base import LAST_NORMED, DraftHead
from .decoder import decoder_stack, head_config, readable_fields
from .weights import VerifierShape, assign, must_equal, shared_or_own_embedding, where


class EagleHead(DraftHead):
    """An EAGLE-1/2 head (see the module docstring). ``shared``: the verifier's embeddings and LM head,
    read and never submodules; ``own_embedding`` replaces the first where the checkpoint ships its own."""

    feature_layers = (LAST_NORMED,)

    def __init__(self, config, verifier: VerifierShape, *, fc_bias: bool, extra_norms: bool = False,
                 qkv_bias: bool = False):
        super().__init__()
        width = config.hidden_size
        self.hidden_size, self.vocab_size, self.decoder_config = width, verifier.output_width, config

        def adjust(index, layer):
            if index == 0 and not extra_norms:
                layer.input_layernorm = torch.nn.Identity()
            if qkv_bias:  # cnets1: q/k/v with a bias, the output projection without
                attention = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attention, name)
                    setattr(attention, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))
            return layer

        self.decoder = decoder_stack(config, adjust)
        norm = type(self.decoder.layers[0].post_attention_layernorm)
        with torch.device("meta"):
            self.fc = torch.nn.Linear(2 * width, width, bias=fc_bias)
            self.embedding_norm = norm(width, eps=config.rms_norm_eps) if extra_norms else None
            self.output_norm = norm(width, eps=config.rms_norm_eps) if extra_norms else None
        self.own_embedding = None
        self._cache_argument = compat.cache_argument(self.decoder)  # the release's name (read once: not in a graph)
        self._shared = (verifier.embeddings, verifier.lm_head)

    def forward(self, input_ids, features, *, position_ids, attention_mask, cache, use_cache=True):
        embeddings, lm_head = self._shared
        embeds = (embeddings if self.own_embedding is None else self.own_embedding)(input_ids).to(features.dtype)
        if self.embedding_norm is not None:
            embeds = self.embedding_norm(embeds)
        hidden = self.decoder(inputs_embeds=self.fc(torch.cat([embeds, features], dim=-1)), position_ids=position_ids,
                              attention_mask=attention_mask, use_cache=use_cache,
                              **{self._cache_argument: cache}).last_hidden_state
        out = hidden if self.output_norm is None else self.output_norm(hidden)
        return lm_head(out).float(), hidden


def _fit(config, verifier: VerifierShape, source, hidden_key: str, vocab_key: str) -> None:
    must_equal(source, hidden_key, config.hidden_size, verifier.hidden_size, "the verifier's hidden size")
    must_equal(source, vocab_key, config.vocab_size, verifier.vocab_size, "the verifier's vocab_size")


def safeailab_eagle(config: dict, state: dict, verifier: VerifierShape, source) -> EagleHead:
    """An EAGLE-1/2 head from SafeAILab's layout (see the module docstring)."""
    llama = LlamaConfig(**readable_fields(config))
    _fit(llama, verifier, source, "config.json hidden_size", "config.json vocab_size")
    head = EagleHead(head_config(llama, llama.num_hidden_layers), verifier, fc_bias=bool(config.get("bias", True)),
                     qkv_bias=bool(config.get("qkv_bias", False)))
    own_embedding = shared_or_own_embedding(state, verifier, llama.hidden_size, source)
    assign(head, state, (("layers.", "decoder.layers."),), source, "SafeAILab EAGLE", verifier,
           ignored=("rotary_emb.inv_freq",))
    head.own_embedding = own_embedding
    return head.eval()


def speculators_eagle(config: dict, state: dict, verifier: VerifierShape, source) -> EagleHead:
    """An EAGLE-1/2 head from speculators' layout (see the module docstring)."""
    layer_config = AutoConfig.for_model(**readable_fields(config["transformer_layer_config"]))
    _fit(layer_config, verifier, source, "transformer_layer_config.hidden_size", "transformer_layer_config.vocab_size")
    architecture = config.get("transformer_layer_architecture", "auto")
    layer_config = head_config(layer_config, 1)
    head = EagleHead(layer_config, verifier, fc_bias=bool(config.get("fusion_bias", False)),
                     extra_norms=bool(config.get("layernorms", False)))
    own_class = type(head.decoder.layers[0]).__name__
    if architecture not in ("auto", own_class):
        raise ValueError(f"{where(source)}: transformer_layer_architecture is {architecture!r}, but a "
                         f"{type(layer_config).__name__} has {own_class} layers; draft_head builds a config's own "
                         "decoder layer")
    assign(head, state, (("fusion_fc.", "fc."), ("transformer.", "decoder.layers.0."),
                         ("embedding_layernorm.", "embedding_norm."), ("pre_lm_head_layernorm.", "output_norm.")),
           source, "speculators eagle", verifier)
    return head.eval()
