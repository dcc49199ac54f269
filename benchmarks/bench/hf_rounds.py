"""transformers' own counts of an assisted ``generate``: per round, the tokens its candidate generator
drafted and how many of them the target accepted, the same quantities as our target level's
``drafted``, ``accepted`` and ``verifications`` (`hf_polybasic.stats`), so the report can say whether a
difference in tokens per target forward comes from longer blocks or from more accepted drafts.

`counting_rounds` wraps the candidate generator transformers builds for the call (its
``get_candidates`` and ``update_candidate_strategy``, public methods of every `CandidateGenerator`)
through the model's ``_get_candidate_generator``, set on the instance for the call only and removed
after it; where a release does not have that hook the counts are left empty (None), never guessed.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def counting_rounds(target: torch.nn.Module):
    """Count the rounds of the assisted ``generate`` called on ``target`` inside the block: yields a
    dict that holds, after the call, ``verifications``, ``drafted`` and ``accepted`` (sums over rounds);
    all None where the hook is missing (another transformers release)."""
    make = getattr(type(target), "_get_candidate_generator", None)
    if make is None:
        yield {"verifications": None, "drafted": None, "accepted": None}
        return
    counts = {"verifications": 0, "drafted": 0, "accepted": 0}
    pending: list[int] = []  # drafted tokens of the round whose verification is still to come

    def wrapped_make(*args, **kwargs):
        generator = make(target, *args, **kwargs)
        get_candidates, update = generator.get_candidates, generator.update_candidate_strategy

        def counted_candidates(input_ids, *rest, **more):
            candidates = get_candidates(input_ids, *rest, **more)
            pending.append(candidates[0].shape[-1] - input_ids.shape[-1])
            return candidates

        def counted_update(input_ids, scores, num_matches, *rest, **more):
            counts["verifications"] += 1
            counts["drafted"] += pending.pop() if pending else 0
            counts["accepted"] += int(num_matches)  # an int or a 0-d tensor
            return update(input_ids, scores, num_matches, *rest, **more)

        generator.get_candidates, generator.update_candidate_strategy = counted_candidates, counted_update
        return generator

    target._get_candidate_generator = wrapped_make
    try:
        yield counts
    finally:
        del target._get_candidate_generator
