"""The vocabulary two tokenizers share: which token of one is a token of the other.

Two tokens are *twins* when they spell the same bytes (`hf_polybasic.translation.tokens.token_bytes`:
``Ġx`` of a byte-level BPE and ``▁x`` of a SentencePiece one both spell `` x``), or, for special
tokens, when their content strings are equal (``<|im_end|>`` in both); the target's EOS is also the
twin of the level's EOS when neither has a twin by content. Where several tokens of one side spell
the same bytes, the one its tokenizer produces is kept (a regular token before a single-byte
``<0xNN>`` one, then the lower id), so the map is one to one.

The shared vocabulary S is the level's tokens with a twin. A translated level scores S only: its
logits over S are written at the twins' ids of the target's width, every other id -inf
(`SharedVocabulary.to_target`).
"""

from __future__ import annotations

import torch

from .tokens import continuation_encoder, prepends_space, special_contents, token_bytes


def _first_spelling(spellings: list[bytes | None]) -> dict[bytes, int]:
    """bytes -> the id its tokenizer produces for them: a multi-character spelling's token before a
    single byte's, then the lowest id."""
    found: dict[bytes, int] = {}
    for index, spelled in enumerate(spellings):
        if spelled is not None and spelled not in found:
            found[spelled] = index
    return found


class SharedVocabulary:
    """The twins of a level's tokenizer (``own``) and the target's (``target``); see the module docs.

    Attributes:
        target_bytes, own_bytes: per id, the bytes it spells (None: a special token).
        target_to_own: per target id, its twin among the level's ids, or None.
        own_to_target: per level id, its twin among the target's ids, or None.
        own_ids, target_ids: ``[S]`` the shared tokens, aligned: ``own_ids[i]`` is the twin of
            ``target_ids[i]`` (one own id per target id).
        encode_own, encode_target: text in the middle of a text -> ids (`continuation_encoder`).
        target_prepends_space: whether the target's tokenizer puts a space before a text.
    """

    def __init__(self, own, target):
        self.own_tokenizer, self.target_tokenizer = own, target
        self.own_bytes, self.target_bytes = token_bytes(own), token_bytes(target)
        self.encode_own, self.encode_target = continuation_encoder(own), continuation_encoder(target)
        self.target_prepends_space = prepends_space(target)
        own_by_bytes, target_by_bytes = _first_spelling(self.own_bytes), _first_spelling(self.target_bytes)
        twins = {target_by_bytes[spelled]: own_id for spelled, own_id in own_by_bytes.items()
                 if spelled in target_by_bytes}
        own_special, target_special = special_contents(own), special_contents(target)
        twins.update({target_special[content]: own_id for content, own_id in own_special.items()
                      if content in target_special})
        target_eos, own_eos = getattr(target, "eos_token_id", None), getattr(own, "eos_token_id", None)
        if target_eos is not None and own_eos is not None and target_eos not in twins and own_eos not in twins.values():
            twins[int(target_eos)] = int(own_eos)
        self.target_to_own: list[int | None] = [None] * len(self.target_bytes)
        self.own_to_target: list[int | None] = [None] * len(self.own_bytes)
        for target_id, own_id in twins.items():
            self.target_to_own[target_id] = own_id
            self.own_to_target[own_id] = target_id
        pairs = sorted(twins.items())
        self.target_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        self.own_ids = torch.tensor([o for _, o in pairs], dtype=torch.long)
        self._placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        """How many tokens the two share."""
        return int(self.own_ids.shape[0])

    def to_target(self, logits: torch.Tensor, width: int) -> torch.Tensor:  # [n, V_own] -> [n, width]
        """The level's logits ``[n, V_own]`` on the target's ids: each shared token's at its twin's id,
        -inf at every other id (what the level samples from is its distribution over S)."""
        if logits.device not in self._placed:
            keep = self.target_ids < width
            self._placed[logits.device] = (self.own_ids[keep].to(logits.device),
                                           self.target_ids[keep].to(logits.device))
        own_ids, target_ids = self._placed[logits.device]
        out = logits.new_full((logits.shape[0], width), float("-inf"))
        return out.index_copy_(1, target_ids, logits.index_select(1, own_ids))
