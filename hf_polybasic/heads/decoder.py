"""The decoder layers inside an EAGLE head, as transformers' own modules: a base model of the head's
config type (`LlamaModel`, `Qwen3Model`, ...) with no token embeddings and no final norm, so that its
masks, rotary embedding and caches (dynamic, static, compiled) are transformers' on every release.

A head feeds it ``inputs_embeds`` it built itself (EAGLE-1: ``fc(cat(embed, feature))``; EAGLE-3:
``cat(embed, fc(features))``). EAGLE-3's first layer reads twice the hidden size: `eagle3_first_layer`
makes the config's own decoder layer do so (its attention projections take ``2 * hidden``; its
residual is the feature half), as the EAGLE-3 publishers' ``midlayer`` does.

Modules are built on the meta device (nothing allocated, nothing initialised at random) and get
their weights by assignment from the checkpoint (`hf_polybasic.heads.weights.assign`); only the
rotary embedding, which no checkpoint holds, is built for real.
"""

from __future__ import annotations

import copy

import torch


def readable_fields(fields: dict) -> dict:
    """A head's config fields as every release we admit reads them: transformers 5 writes the RoPE base
    under ``rope_parameters`` only, which releases before 5 ignore (they read ``rope_theta`` and would
    build the default base, 10,000); it is copied to ``rope_theta``, which 5 ignores beside
    ``rope_parameters``."""
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in fields:
        return dict(fields, rope_theta=rope["rope_theta"])
    return fields


def head_config(config, layers: int):
    """A copy of ``config`` (a transformers config) describing ``layers`` decoder layers, attention by
    SDPA (what a cache for the head is laid out by; the publishers' configs may describe the whole
    verifier, as speculators' ``transformer_layer_config`` does for EAGLE-1)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    config._attn_implementation = "sdpa"
    return config


def decoder_stack(config, adjust=None) -> torch.nn.Module:
    """transformers' base model for ``config`` (``config.num_hidden_layers`` layers) without embeddings or
    final norm, built on the meta device; ``adjust(index, layer) -> layer`` changes or replaces each
    decoder layer. Raises a clear error for a config type transformers has no base model for."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        model_class = MODEL_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"the head's decoder is a {type(config).__name__} ({config.model_type!r}), for which this "
                         "transformers release has no model") from None
    with torch.device("meta"):
        model = model_class(config)
        model.embed_tokens = None
        model.norm = torch.nn.Identity()
        if adjust is not None:
            for index, layer in enumerate(list(model.layers)):
                model.layers[index] = adjust(index, layer)
    model.rotary_emb = type(model.rotary_emb)(config=config)  # computed from the config: in no checkpoint
    return model.eval()


class Eagle3FirstLayer:
    """EAGLE-3's first decoder layer over ``cat(embed, hidden)`` ``[B, n, 2 * hidden]``: the embedding
    normed by ``input_layernorm``, the hidden by ``hidden_norm``, both read by the attention (its q/k/v
    projections take ``2 * hidden``), the residual the hidden (normed where ``norm_before_residual``);
    then the layer's own MLP block. Mixed into the config's decoder-layer class (`eagle3_first_layer`)."""

    norm_before_residual = False

    def forward(self, hidden_states, *args, **kwargs):
        embeds, hidden = hidden_states.chunk(2, dim=-1)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attended, _ = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), *args, **kwargs)
        hidden_states = residual + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


_FIRST_LAYER_CLASSES: dict[type, type] = {}


def eagle3_first_layer(config, norm_before_residual: bool):
    """``(index, layer) -> layer`` for `decoder_stack`: turns the freshly built (meta) layer 0 of ``config``
    into EAGLE-3's first layer (`Eagle3FirstLayer`): q/k/v projections over ``2 * hidden`` (bias as
    ``config.attention_bias``) and a ``hidden_norm`` of the layer's own norm class; later layers stay
    the config's own."""

    def make(index, layer):
        if index:
            return layer
        width = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        attention = layer.self_attn
        attention.q_proj = torch.nn.Linear(2 * width, config.num_attention_heads * head_dim, bias=bias)
        attention.k_proj = torch.nn.Linear(2 * width, config.num_key_value_heads * head_dim, bias=bias)
        attention.v_proj = torch.nn.Linear(2 * width, config.num_key_value_heads * head_dim, bias=bias)
        layer.hidden_norm = type(layer.input_layernorm)(width, eps=config.rms_norm_eps)
        base = type(layer)
        if base not in _FIRST_LAYER_CLASSES:  # one class per decoder-layer class (compiled graphs guard on it)
            _FIRST_LAYER_CLASSES[base] = type(f"Eagle3{base.__name__}", (Eagle3FirstLayer, base), {})
        layer.__class__ = _FIRST_LAYER_CLASSES[base]
        layer.norm_before_residual = norm_before_residual
        return layer

    return make
