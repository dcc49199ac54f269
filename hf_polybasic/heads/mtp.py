"""A model's native multi-token-prediction layers as a draft head, through transformers' own `MtpModel`.

Models that transformers gives ``num_mtp_layers`` (DeepSeek-V3, GLM-4.5 and others, transformers 5.24)
ship MTP layers: the model's last normed hidden state and the next token's embedding, normed and
projected (``eh_proj``), through one of the model's own decoder layers, then the model's own head.
`MtpHead` runs transformers' `MtpModel` (its layer, embedding, rotary embedding and projection to logits)
as a `DraftHead`; only the attention mask is built here, from the mask the runner gives, where
`MtpModel.forward_layer` assumes one unpadded row. Position ids count the token's position, as
transformers' `MTPCandidateGenerator` feeds them, so one layer drafts what it drafts. The first MTP
layer drafts every token (deeper layers, where a model has them, are not used: a head drafts by
feeding its own output back).
"""

from __future__ import annotations

import torch

from .. import compat
from .base import LAST_NORMED, DraftHead


class MtpHead(DraftHead):
    """The first of a model's MTP layers (``mtp``, a transformers `MtpModel` tied to the model) as a head."""

    feature_layers = (LAST_NORMED,)
    position_offset = 1

    def __init__(self, mtp):
        super().__init__()
        self.mtp = mtp
        self.decoder_config = mtp.config
        self.hidden_size = int(mtp.config.hidden_size)
        unpadded = getattr(mtp.config, "unpadded_vocab_size", None)
        self.vocab_size = int(unpadded or mtp.shared_head.weight.shape[0])

    def forward(self, input_ids, features, *, position_ids, attention_mask, cache, use_cache=True):
        mtp = self.mtp
        embeds = mtp.embed_tokens(input_ids).to(features.dtype)
        mask = compat.causal_mask(mtp.config, embeds, attention_mask, cache, position_ids)
        rotary = None if mtp.rotary_emb is None else mtp.rotary_emb(embeds, position_ids=position_ids)
        hidden = mtp.layers[0](embeds, features, position_embeddings=rotary, attention_mask=mask,
                               position_ids=position_ids, use_cache=use_cache, **compat.layer_cache_kwargs(cache))
        if mtp.use_shared_post_norm:
            hidden = mtp.shared_post_norm(hidden)
        return mtp._project_to_logits(hidden).float(), hidden


def mtp_head(model) -> MtpHead:
    """The MTP layers of ``model`` as a head: `MtpModel.from_pretrained(model)` reads them from the
    checkpoint ``model.config.name_or_path`` names (where transformers keeps them apart from the model)."""
    mtp_class = compat.mtp_model_class()
    if mtp_class is None:
        raise ValueError(f"draft_head('mtp') runs transformers' MtpModel, which transformers {compat.TRANSFORMERS_VERSION} "
                         f"lacks; it came with transformers {compat.MTP_SINCE}: upgrade transformers")
    config = model.config.get_text_config(decoder=True)
    if not getattr(config, "num_mtp_layers", None):
        raise ValueError(f"draft_head('mtp', verifier={type(model).__name__}): the model's config has no num_mtp_layers "
                         "(it ships no multi-token-prediction layers); use a trained head's checkpoint instead")
    device = next(model.get_decoder().layers[-1].parameters()).device
    return MtpHead(mtp_class.from_pretrained(model, device_map={"": device}).eval())
