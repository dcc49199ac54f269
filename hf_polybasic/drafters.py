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
import time

import torch
from .chain import ChainLevel, length_through_eos
from .stats import LevelStats


class Drafter(abc.ABC):
    """A bottom level of a chain that is not a transformers model."""

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


PROBABILITY_SUM_TOLERANCE = 1e-3


def _check_proposal(name: str, tokens: torch.LongTensor, log_probs: torch.Tensor) -> None:
    """Raise unless ``log_probs`` [k, V] can be the distributions ``tokens`` [k] were drawn from:
    finite or -inf, each row summing to 1, and every proposed token with probability > 0 (a token
    reported with probability 0 cannot have been drawn, and losslessness rests on that)."""
    if log_probs.dim() != 2 or log_probs.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"{name}.propose must return log_probs of shape [k, V] for k = {tokens.shape[0]} tokens "
            f"(or None for deterministic drafts), got shape {tuple(log_probs.shape)}"
        )
    if tokens.numel() == 0:
        return
    values = log_probs.detach().double()
    if bool(torch.isnan(values).any()) or bool((values == float("inf")).any()):
        raise ValueError(f"{name}.propose returned log_probs with NaN or +inf; they must be log-probabilities")
    sums = values.exp().sum(-1)
    off = (sums - 1).abs() > PROBABILITY_SUM_TOLERANCE
    if bool(off.any()):
        row = int(off.nonzero()[0])
        raise ValueError(
            f"{name}.propose returned log_probs whose probabilities do not sum to 1 (row {row} sums to "
            f"{float(sums[row]):.4g}); return the log-probabilities of the distribution each token was drawn from"
        )
    width = values.shape[1]
    inside = tokens.to(values.device) < width
    picked = values.gather(1, tokens.to(values.device).clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    impossible = ~inside | (picked == float("-inf"))
    if bool(impossible.any()):
        position = int(impossible.nonzero()[0])
        raise ValueError(
            f"{name}.propose reported probability 0 for the token it proposed at position {position} "
            f"(id {int(tokens[position])}); a proposal must be the distribution the token was drawn from"
        )


class DrafterLevel(ChainLevel):
    """Adapts a `Drafter` to the chain's candidate-generator protocol (see `hf_polybasic.chain`)."""

    def __init__(self, drafter: Drafter, eos_token_ids: frozenset[int], stats: LevelStats):
        self.drafter = drafter
        self.eos_token_ids = eos_token_ids
        self.stats = stats

    def get_candidates(self, input_ids: torch.LongTensor, max_new_tokens: int | None = None):
        started = time.perf_counter()
        limit = max_new_tokens if max_new_tokens is not None else 1 << 30
        self._prefix_length = input_ids.shape[1]
        tokens, log_probs = self.drafter.propose(input_ids, limit)
        tokens, log_probs = self._checked(tokens, log_probs, limit)
        keep = length_through_eos(tokens, self.eos_token_ids)  # nothing after an EOS can be accepted
        tokens, log_probs = tokens[:keep], None if log_probs is None else log_probs[:keep]
        self.stats.proposed += tokens.shape[0]
        self.stats.seconds += time.perf_counter() - started
        candidates = torch.cat([input_ids, tokens.to(input_ids.device).unsqueeze(0)], dim=1)
        return candidates, None if log_probs is None else log_probs.unsqueeze(0)

    def _checked(self, tokens, log_probs, limit: int):
        name = type(self.drafter).__name__
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
            raise TypeError(f"{name}.propose must return a 1-D LongTensor of token ids, got {tokens!r}")
        if tokens.shape[0] > limit:
            raise ValueError(f"{name}.propose returned {tokens.shape[0]} tokens but max_new_tokens was {limit}")
        if log_probs is not None:
            _check_proposal(name, tokens, log_probs)
        return tokens, log_probs

    def rollback_to(self, length: int) -> None:
        self.drafter.rollback_to(length)

    def commit(self) -> None:
        self.drafter.commit()
