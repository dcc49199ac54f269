"""EAGLE-3 heads (Li et al. 2025): the verifier's hidden states at three (or more) layers, concatenated and
projected by ``fc`` into the head's *feature*, read beside the next token's embedding by a first decoder
layer over both (`hf_polybasic.heads.decoder.Eagle3FirstLayer`); then the head's own norm and LM head over
a reduced draft vocabulary, whose ids ``d2t`` maps to the verifier's (target = draft + d2t[draft]). The
head's output before that norm predicts the next position's feature (after it, under speculators'
EAGLE-3.1 ``norm_output``). Its logits come back in the verifier's width, -inf where it cannot propose.

Which hidden states: the *inputs* of the verifier's layers 2, L//2 and L-3 by default (SafeAILab's
``modeling_llama_kv.py``; SGLang and vLLM alike), in the order the layers run (every engine collects them
in its layer loop, whatever order a config lists them in). Read from the layouts their publishers write
(`hf_polybasic.heads.formats` finds which):

* **SafeAILab** (SafeAILab/EAGLE ``eagle/model/cnets.py``, class ``Model``, loaded by ``ea_model.py``): a
  Llama config with ``draft_vocab_size`` (``target_hidden_size`` where the verifier is wider); weights
  ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, ``embed_tokens.weight``
  where shipped.
* **SpecForge** (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``,
  ``LlamaForCausalLMEagle3``): the same keys, plus ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layers
  whose *outputs* are read: SGLang captures the input of id + 1), EAGLE-3.1's ``fc_norm`` (an RMSNorm per
  layer's states before ``fc``, keys ``fc_norm.<i>.weight``) and ``norm_output`` (default true; false:
  logits from the un-normed output).
* **speculators** (vllm-project/speculators ``src/speculators/models/eagle3/``: ``core.py``
  ``Eagle3DraftModel``, ``config.py``, ``model_definitions.py``): ``speculators_model_type: "eagle3"``,
  ``transformer_layer_config`` (Llama or Qwen3, ``num_hidden_layers`` layers, the first EAGLE-3's),
  ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` (layers whose *inputs* are read, as vLLM
  captures them), ``norm_before_residual``, ``norm_before_fc`` (``input_norm`` over all states),
  ``fc_norm``, ``norm_output`` (feed the normed output back); weights ``layers.<i>.*``, ``fc.weight``,
  ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``, ``d2t``/``t2d``, ``input_norm.weight``,
  ``fc_norm.<i>.weight``.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, LlamaConfig

from .. import compat
from .base import DraftHead
from .decoder import decoder_stack, eagle3_first_layer, head_config, readable_fields
from .weights import VerifierShape, assign, draft_to_target, must_equal, shared_or_own_embedding, where

SPECULATORS_LAYER_TYPES = ("llama", "qwen3")  # speculators' model_definitions.model_classes


class Eagle3Head(DraftHead):
    """An EAGLE-3 head (see the module docstring). ``shared``: the verifier's embeddings, read and never
    a submodule; ``own_embedding`` replaces them where the checkpoint ships its own."""

    def __init__(self, config, verifier: VerifierShape, feature_layers: tuple[int, ...], *, draft_vocab: int,
                 fc_norm: bool = False, input_norm: bool = False, normed_logits: bool = True,
                 feeds_back_normed: bool = False, norm_before_residual: bool = False):
        super().__init__()
        width, count = config.hidden_size, len(feature_layers)
        self.feature_layers, self.hidden_size, self.decoder_config = tuple(feature_layers), width, config
        self.vocab_size, self.normed_logits, self.feeds_back_normed = verifier.output_width, normed_logits, feeds_back_normed
        self.decoder = decoder_stack(config, eagle3_first_layer(config, norm_before_residual))
        norm = type(self.decoder.layers[0].post_attention_layernorm)
        states, eps = verifier.hidden_size, config.rms_norm_eps
        with torch.device("meta"):
            self.input_norm = norm(count * states, eps=eps) if input_norm else None
            self.fc_norm = torch.nn.ModuleList([norm(states, eps=eps) for _ in range(count)]) if fc_norm else None
            self.fc = torch.nn.Linear(count * states, width, bias=False)
            self.norm = norm(width, eps=eps)
            self.lm_head = torch.nn.Linear(width, draft_vocab, bias=False)
        self.own_embedding = None
        self._cache_argument = compat.cache_argument(self.decoder)  # the release's name (read once: not in a graph)
        # [draft_vocab] the verifier's id of each draft id (None: the same ids); computed, in no state dict
        self.register_buffer("target_ids", None, persistent=False)
        self._shared = (verifier.embeddings,)

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [..., count * states] -> [..., hidden]
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def forward(self, input_ids, features, *, position_ids, attention_mask, cache, use_cache=True):
        logits, hidden = self.draft_forward(input_ids, features, position_ids=position_ids,
                                            attention_mask=attention_mask, cache=cache, use_cache=use_cache)
        return self._in_verifier_ids(logits.float()), hidden

    def draft_forward(self, input_ids, features, *, position_ids, attention_mask, cache, use_cache=True):
        """`forward` before the logits are laid out in the verifier's ids: ``(logits [B, n, draft_vocab]``
        over the draft vocabulary (draft id i is the verifier's ``draft_ids[i]``), in the head's dtype,
        ``hidden [B, n, hidden_size])`` (what training reads: no verifier-wide tensor)."""
        (embeddings,) = self._shared
        embeds = (embeddings if self.own_embedding is None else self.own_embedding)(input_ids).to(features.dtype)
        hidden = self.decoder(inputs_embeds=torch.cat([embeds, features], dim=-1), position_ids=position_ids,
                              attention_mask=attention_mask, use_cache=use_cache,
                              **{self._cache_argument: cache}).last_hidden_state
        normed = self.norm(hidden)
        logits = self.lm_head(normed if self.normed_logits else hidden)  # [B, n, draft_vocab]
        return logits, normed if self.feeds_back_normed else hidden

    @property
    def draft_ids(self) -> torch.Tensor:
        """``[draft_vocab]``: the verifier's id of each draft id."""
        if self.target_ids is not None:
            return self.target_ids
        return torch.arange(self.lm_head.weight.shape[0], device=self.lm_head.weight.device)

    def _in_verifier_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, n, draft_vocab]`` -> ``[B, n, vocab_size]``: each draft id's logit at its verifier id, -inf
        at the ids the head cannot propose."""
        if self.target_ids is None and logits.shape[-1] == self.vocab_size:
            return logits
        ids = self.target_ids if self.target_ids is not None else torch.arange(logits.shape[-1], device=logits.device)
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), -float("inf"))
        return out.index_copy(-1, ids, logits)


def feature_layers(ids, key: str, shift: int, verifier: VerifierShape, source) -> tuple[int, ...]:
    """The verifier's hidden states (`hf_polybasic.heads.base` indices) a head reads: ``ids`` as a config
    writes them under ``key``, shifted by ``shift`` (1 where ids name layers whose output is read), in
    the order the layers run; the default inputs of layers 2, L//2, L-3 where ``ids`` is None."""
    count = verifier.num_layers
    if ids is None:
        layers = (2, count // 2, count - 3)
        if len(set(layers)) < 3 or min(layers) < 0:
            raise ValueError(f"{where(source)}: config.json names no {key}, and EAGLE-3's default layers (the inputs of "
                             f"2, L//2 and L-3) are three distinct layers only from 7 layers on; the verifier has {count}")
        return layers
    if len(set(ids)) != len(ids) or not all(0 <= int(layer) <= count - 1 - shift for layer in ids):
        raise ValueError(f"{where(source)}: {key} is {list(ids)}: it must name distinct layers among the verifier's "
                         f"{count} (0 .. {count - 1 - shift}); the head was trained for a deeper model")
    return tuple(sorted(int(layer) + shift for layer in ids))


def _finish(head: Eagle3Head, state: dict, config, draft_vocab: int, verifier: VerifierShape, source, kind: str,
            renames, ignored=()) -> Eagle3Head:
    head.target_ids = draft_to_target(state, draft_vocab, verifier, source)
    own_embedding = shared_or_own_embedding(state, verifier, config.hidden_size, source)
    assign(head, state, renames, source, kind, verifier, ignored)
    head.own_embedding = own_embedding
    return head.eval()


def safeailab_eagle3(config: dict, state: dict, verifier: VerifierShape, source) -> Eagle3Head:
    """An EAGLE-3 head from SafeAILab's or SpecForge's layout (see the module docstring)."""
    llama = LlamaConfig(**readable_fields(config))
    must_equal(source, "config.json vocab_size", llama.vocab_size, verifier.vocab_size, "the verifier's vocab_size")
    states = config.get("target_hidden_size") or llama.hidden_size
    key = "target_hidden_size" if "target_hidden_size" in config else "hidden_size"
    must_equal(source, f"config.json {key}", states, verifier.hidden_size, "the verifier's hidden size")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = feature_layers(ids, "eagle_config.eagle_aux_hidden_state_layer_ids", 1, verifier, source)
    draft_vocab = int(config.get("draft_vocab_size", llama.vocab_size))
    head = Eagle3Head(head_config(llama, 1), verifier, layers, draft_vocab=draft_vocab,
                      fc_norm=bool(config.get("fc_norm", False)), normed_logits=bool(config.get("norm_output", True)))
    return _finish(head, state, llama, draft_vocab, verifier, source, "SafeAILab/SpecForge EAGLE-3",
                   (("midlayer.", "decoder.layers.0."),), ignored=("rotary_emb.inv_freq",))


def speculators_eagle3(config: dict, state: dict, verifier: VerifierShape, source) -> Eagle3Head:
    """An EAGLE-3 head from speculators' layout (see the module docstring)."""
    head, layer_config, draft_vocab = speculators_eagle3_skeleton(config, verifier, source)
    return _finish(head, state, layer_config, draft_vocab, verifier, source, "speculators eagle3",
                   SPECULATORS_RENAMES, ignored=("verifier_norm.weight", "verifier_lm_head.weight"))


SPECULATORS_RENAMES = (("layers.", "decoder.layers."),)  # (speculators' key prefix, the head's)


def speculators_eagle3_skeleton(config: dict, verifier: VerifierShape, source) -> tuple[Eagle3Head, object, int]:
    """``(head on the meta device, its transformers layer config, draft vocabulary size)`` that speculators'
    ``config.json`` ``config`` describes for ``verifier``, checked against it; no weight yet (what
    `speculators_eagle3` assigns them to, and what `hf_polybasic.training` initialises)."""
    layer_config = dict(config.get("transformer_layer_config") or {})
    kind = layer_config.setdefault("model_type", "qwen3")  # speculators' default config class
    if kind not in SPECULATORS_LAYER_TYPES:
        raise ValueError(f"{where(source)}: transformer_layer_config.model_type is {kind!r}; speculators' EAGLE-3 "
                         f"builds {' or '.join(SPECULATORS_LAYER_TYPES)} layers only")
    layer_config = AutoConfig.for_model(**readable_fields(layer_config))
    must_equal(source, "transformer_layer_config.vocab_size", layer_config.vocab_size, verifier.vocab_size,
               "the verifier's vocab_size")
    must_equal(source, "transformer_layer_config.hidden_size", layer_config.hidden_size, verifier.hidden_size,
               "the verifier's hidden size")
    layers = feature_layers(config.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", 0,
                            verifier, source)
    draft_vocab = int(config.get("draft_vocab_size", 32000))
    head = Eagle3Head(head_config(layer_config, layer_config.num_hidden_layers), verifier, layers,
                      draft_vocab=draft_vocab, fc_norm=bool(config.get("fc_norm", False)),
                      input_norm=bool(config.get("norm_before_fc", False)),
                      feeds_back_normed=bool(config.get("norm_output", False)),
                      norm_before_residual=bool(config.get("norm_before_residual", False)))
    return head, layer_config, draft_vocab
