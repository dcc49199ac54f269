"""What every trained draft head is to the rest of the package: tokens and features in, logits and
its own next feature out (`DraftHead`).

A head drafts from the hidden states of the model it drafts for, its *verifier* (EAGLE-1/2/3, native
MTP layers). Its positions are the sequence's shifted by one: head position ``j`` reads the token at
sequence position ``j + 1`` and the *feature* of position ``j`` (the verifier's hidden states there),
and predicts the token at position ``j + 2``; its own output at ``j`` (``hidden``) stands in for the
feature of position ``j + 1`` where the verifier has not run yet (the tokens the head itself drafted).

How a head is fed, cached and rolled back is not its concern (`hf_polybasic.runners.head`); a head only
says which of the verifier's hidden states make its feature, and computes one forward.
"""

from __future__ import annotations

import torch

# A feature layer is an index into transformers' ``output_hidden_states`` tuple of the verifier: 0 is
# the token embeddings, i the input of decoder layer i (the output of layer i - 1), and -1 the last
# hidden state after the final norm (what the LM head reads; so on every release we admit).
LAST_NORMED = -1


class DraftHead(torch.nn.Module):
    """A trained draft head (see the module docstring).

    Attributes:
        feature_layers: which of the verifier's hidden states make a *real* feature, concatenated in
            this order (indices as `LAST_NORMED` says): ``(-1,)`` for EAGLE-1/2 and MTP, three layers
            for EAGLE-3.
        hidden_size: the width of the features `forward` takes and of the ``hidden`` it returns.
        position_offset: the position id given to head position ``j`` is ``j + position_offset``
            (EAGLE counts head positions, 0; transformers' MTP layers count the token's, 1).
        decoder_config: the transformers config of the head's decoder layers (what a cache for it is
            laid out by: layer count, heads, attention implementation).
        vocab_size: the width of the logits: the verifier's vocabulary.
    """

    feature_layers: tuple[int, ...] = (LAST_NORMED,)
    hidden_size: int
    position_offset: int = 0
    decoder_config = None
    vocab_size: int

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Real features ``[..., len(feature_layers) * verifier hidden size]`` into the head's width
        ``[..., hidden_size]`` (EAGLE-3's ``fc``); the identity where they already are."""
        return features

    def forward(self, input_ids: torch.LongTensor, features: torch.Tensor, *, position_ids: torch.LongTensor,
                attention_mask: torch.Tensor | None, cache, use_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``input_ids`` ``[B, n]`` (the tokens at head positions, i.e. sequence
        positions + 1) with ``features`` ``[B, n, hidden_size]`` (real ones projected, or the head's
        own), at ``position_ids`` ``[B, n]``, masked by ``attention_mask`` (2-D over the cache's slots and
        these tokens, or 4-D, as transformers' decoder models take it), writing ``cache`` (a
        transformers `Cache` for ``decoder_config``). Returns ``(logits [B, n, vocab_size], hidden [B, n,
        hidden_size])``: the logits of the token after each head position's (ids the head cannot
        propose: -inf), and the feature it predicts for the next position."""
        raise NotImplementedError
