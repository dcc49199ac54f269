"""A head's draft vocabulary: the ids its output layer scores, chosen by how often they occur in the
training texts, as EAGLE-3's ``d2t``/``t2d`` (speculators' ``build_vocab_mappings_from_distribution``:
the most frequent ids, ties broken by the lower id, topped up with the lowest unseen ids, sorted).

Why the chain stays exact with it: a head with a draft vocabulary S reports -inf at every id outside S
(`hf_polybasic.heads.eagle3.Eagle3Head`), so it proposes only ids of S and, sampling, reports its
distribution over S as q, with q = 0 outside S. The level above decides every token: greedy, its
argmax; sampling, speculative sampling against q, whose residual covers the ids outside S. A smaller S
changes how many drafts are accepted, never what is emitted: the argument of
`hf_polybasic.models.vocab_head` for restricted drafters, which a head's reduced output layer is.
"""

from __future__ import annotations

import torch

DEFAULT_DRAFT_VOCAB = 32000  # speculators' Eagle3SpeculatorConfig.draft_vocab_size


def draft_vocabulary_size(requested: int | None, vocab_size: int) -> int:
    """The draft vocabulary's size: ``requested``, or speculators' 32,000 (the whole vocabulary where it
    is smaller). Refuses a size outside 1 .. ``vocab_size``."""
    if requested is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab_size)
    if not 1 <= requested <= vocab_size:
        raise ValueError(f"train_head: draft_vocab_size is {requested}, but the model's vocabulary has {vocab_size} "
                         f"ids; pass a size in 1 .. {vocab_size} (or none: min({DEFAULT_DRAFT_VOCAB}, vocabulary))")
    return requested


def token_counts(windows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: how often each id occurs in ``windows`` ``[N, L]``."""
    return torch.bincount(windows.flatten().long(), minlength=vocab_size)[:vocab_size]


def draft_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` ids of the draft vocabulary, ascending ``[size]``, from ``counts`` ``[V]``: the most
    frequent seen ids (ties: the lower id first), then the lowest ids never seen."""
    seen = torch.nonzero(counts > 0).flatten()
    order = seen[torch.argsort(-counts[seen], stable=True)]  # by count, then by id (seen is ascending)
    chosen = order[:size]
    if chosen.numel() < size:
        unseen = torch.nonzero(counts == 0).flatten()
        chosen = torch.cat([chosen, unseen[: size - chosen.numel()]])
    return chosen.sort().values


def vocabulary_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [size], t2d [vocab_size])`` as EAGLE-3's publishers write them: the verifier's id of draft id
    i is ``i + d2t[i]``; ``t2d`` marks the verifier's ids in the draft vocabulary."""
    d2t = ids.long() - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d
