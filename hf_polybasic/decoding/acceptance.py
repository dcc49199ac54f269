"""Pure acceptance math: where a drafted token is accepted, for every level of every chain.

Vocabulary used throughout the package:

* **draft**: the k tokens a level below proposes, ``draft_ids`` ``[k]``.
* **proposal** q: the distribution each draft token was actually drawn from, ``draft_probs``
  ``[k, V]``; ``None`` means the drafts are deterministic (a point mass: greedy levels, n-gram
  drafters).
* **target** p: the verifier's *processed* distribution at the k draft positions plus one more,
  ``target_probs`` / ``target_scores`` ``[k + 1, V]``.
* **accepted**: the leading draft tokens kept, ``num_accepted`` in ``0..k``.
* **next token**: the one token the verifier adds itself after the accepted ones: the *recovered*
  token after a rejection, or the *bonus* token when all k were accepted.

Every ``*_decision`` function returns the tensor ``[num_accepted, next_token]`` on the scores'
device (a level reads the decisions of all its rows back in one go); the level emits
``draft_ids[:num_accepted] + [next_token]``.

Why the output is distributed exactly as p (Leviathan et al. 2023, Thm. 1): at a position with
proposal q, the token x ~ q is kept with probability min(1, p(x)/q(x)), otherwise a token is drawn
from norm(max(p - q, 0)); the kept-or-redrawn token then has probability
min(q(x), p(x)) + max(p(x) - q(x), 0) = p(x). A point mass q = 1[x = d] gives the point-mass rule:
draw y ~ p and keep d iff y = d, else emit y, which again emits y ~ p. Positions are handled left to
right with fresh randomness, so the emitted sequence is an autoregressive sample of p, whatever the
block length (it depends only on tokens already emitted). Greedy: the verifier's argmax is emitted
at every position, so the result is the verifier's own greedy continuation.
"""

from __future__ import annotations

import torch


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of a 1-D bool tensor, as a 0-d long tensor on
    ``mask``'s device (no read back to the host)."""
    return (~mask).cumsum(-1).eq(0).sum()


def _gather_draft_probability(probs: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """probs[i, draft_ids[i]] for each i; 0 where a draft id lies outside probs' vocabulary.

    probs: [k, V]; draft_ids: [k] -> [k]
    """
    vocab = probs.shape[-1]
    inside = draft_ids < vocab
    picked = probs.gather(-1, draft_ids.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def align_vocabulary(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Probabilities over ``vocab_size`` ids: extra ids dropped (not renormalised), missing ids 0.

    Models that share a tokenizer may pad their output layers to different sizes; the mass a
    proposal puts on ids the verifier does not have is simply never accepted.
    probs: [k, V_draft] -> [k, vocab_size]
    """
    width = probs.shape[-1]
    if width == vocab_size:
        return probs
    if width > vocab_size:
        return probs[..., :vocab_size]
    return torch.nn.functional.pad(probs, (0, vocab_size - width))


# --- decisions as tensors: ``[2]`` = (num_accepted, next_token), computed where the scores are -------
def greedy_decision(draft_ids: torch.Tensor, target_scores: torch.Tensor) -> torch.Tensor:
    """Greedy match: accept drafts while they equal the verifier's argmax.

    draft_ids: [k]; target_scores: [k + 1, V] (processed logits or probabilities) -> [2].
    """
    choice = target_scores.argmax(-1)  # [k + 1]
    k = draft_ids.shape[0]
    num_accepted = leading_true(draft_ids.to(choice.device) == choice[:k])
    return torch.stack([num_accepted, choice[num_accepted]])


def point_mass_decision(
    draft_ids: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Lossless rule for deterministic drafts: draw y ~ p at each position, keep d while y == d.

    draft_ids: [k]; target_probs: [k + 1, V] -> [2].
    """
    drawn = torch.multinomial(target_probs, 1, generator=generator).squeeze(-1)  # [k + 1]
    k = draft_ids.shape[0]
    num_accepted = leading_true(draft_ids.to(drawn.device) == drawn[:k])
    return torch.stack([num_accepted, drawn[num_accepted]])


def speculative_decision(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1); ``draft_probs=None`` is a point mass.

    draft_ids: [k]; draft_probs: [k, V_draft] or None; target_probs: [k + 1, V] -> [2].
    The proposal must be exactly the distribution the drafts were drawn from (processed, not raw).
    Branch-free: the next token is drawn from row ``num_accepted`` of max(p - q', 0) with q' = q and
    a zero row appended (so all k accepted leaves the bonus row p[k]), or of p itself when p == q up
    to rounding leaves no residual mass.
    """
    if draft_probs is None:
        return point_mass_decision(draft_ids, target_probs, generator)
    k = draft_ids.shape[0]
    vocab = target_probs.shape[-1]
    draft_ids = draft_ids.to(target_probs.device)
    q = align_vocabulary(draft_probs.to(target_probs.device), vocab)  # [k, V]
    p_draft = _gather_draft_probability(target_probs[:k], draft_ids)  # [k]
    q_draft = _gather_draft_probability(draft_probs.to(target_probs.device), draft_ids)  # [k]
    coins = torch.rand(k, device=target_probs.device, dtype=target_probs.dtype, generator=generator)
    # accept iff u < p/q, written without the division. A token drawn from q has q > 0; one reported
    # with q = 0 cannot have been drawn from it and is rejected (so is any token with p = 0)
    num_accepted = leading_true((q_draft > 0) & (coins * q_draft < p_draft))
    at = num_accepted.view(1)
    p_row = target_probs.index_select(0, at)[0]  # [V]
    q_row = torch.cat([q, q.new_zeros(1, vocab)]).index_select(0, at)[0]
    residual = (p_row - q_row).clamp_min(0)
    next_distribution = torch.where(residual.sum() > 0, residual, p_row)
    next_token = torch.multinomial(next_distribution, 1, generator=generator)[0]
    return torch.stack([num_accepted, next_token])


def emitted_tokens(drafts: torch.Tensor, accepted: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """What a verification emits at each position, on the device: the j-th draft while j <
    ``accepted``, then the verifier's ``own`` token at every later position.

    drafts: [..., k]; accepted: [...]; own: [..., 1] -> [..., k + 1].
    """
    positions = torch.arange(drafts.shape[-1] + 1, device=drafts.device)
    return torch.where(positions < accepted.unsqueeze(-1), torch.cat([drafts, own], -1), own)
