"""Drafters that are not transformers models: the bottom of a chain, behind one small interface.

To plug in your own drafter (an n-gram cache, an EAGLE-style head, a retrieval index, ...),
subclass `Drafter` and implement `propose`; put the instance last in ``assistant_models``.

The one rule that keeps every chain lossless: the proposal a drafter reports must be exactly the
distribution it drew its tokens from. Deterministic drafters (like `PromptLookup`) report ``None``
(a point mass); the level above then accepts a draft token only when its own sampled (or argmax)
token equals it, which leaves the output distribution untouched.
"""

from __future__ import annotations

import abc

import torch


class Drafter(abc.ABC):
    """A bottom level of a chain that is not a transformers model.

    Attributes:
        stateless: True if `propose` depends on its arguments only (no state kept between calls,
            `rollback_to` and `commit` do nothing): then one instance can serve every row of a
            batch, which is decoded with shared forwards. False (the default): a batch is decoded
            row by row.
    """

    stateless: bool = False

    @abc.abstractmethod
    def propose(self, sequence: torch.LongTensor, max_new_tokens: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft tokens to follow ``sequence``.

        Args:
            sequence: ``[1, L]`` token ids so far (prompt and generated tokens).
            max_new_tokens: draft at most this many tokens (may be 0).

        Returns:
            ``(tokens, log_probs)``: ``tokens`` ``[k]`` with ``k <= max_new_tokens`` (k = 0 is fine:
            the level above then decodes one token by itself), and either ``None`` for deterministic
            drafts or ``[k, V]`` log-probabilities of the distribution each token was drawn from.
        """

    def rollback_to(self, length: int) -> None:
        """Forget any state about tokens past ``length`` (stateless drafters need nothing)."""

    def commit(self) -> None:
        """Tokens so far are final (called after each target verification)."""


class PromptLookup(Drafter):
    """Model-free drafting by n-gram lookup in the prompt and the text generated so far.

    Finds the most recent earlier occurrence of the sequence's last ``n`` tokens (longest ``n``
    from ``max_ngram`` down to ``min_ngram``) and proposes the ``num_tokens`` tokens that followed
    it. Deterministic, so proposals are point masses. Costs a vectorised scan of the sequence per
    round; pays off on code editing, summarisation and retrieval-augmented prompts, where outputs
    copy from the input.
    """

    stateless = True

    def __init__(self, max_ngram: int = 3, num_tokens: int = 8, min_ngram: int = 1):
        for name, value in (("max_ngram", max_ngram), ("num_tokens", num_tokens), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PromptLookup.{name} must be an int >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"PromptLookup.min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.num_tokens = num_tokens
        self.min_ngram = min_ngram

    def __repr__(self) -> str:
        return f"PromptLookup(max_ngram={self.max_ngram}, num_tokens={self.num_tokens}, min_ngram={self.min_ngram})"

    def propose(self, sequence: torch.LongTensor, max_new_tokens: int):
        ids = sequence[0]
        length = ids.shape[0]
        limit = min(self.num_tokens, max_new_tokens)
        if limit <= 0:
            return ids[:0], None
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows ids[s : s + n] for s = 0 .. length - 1 - n all have a following token
            windows = ids[: length - 1].unfold(0, n, 1)  # [length - n, n]
            hits = (windows == ids[length - n :]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return ids[start : start + limit], None
        return ids[:0], None


class AddedPromptLookup(PromptLookup):
    """The `PromptLookup` that `PolybasicConfig.prompt_lookup` puts below the bottom model (not one
    the caller gave: the mu of the level above it is the schedule's own)."""
