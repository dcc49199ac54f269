"""One forward that scores one-token branches beside the tokens it feeds: the attention mask, and the forward.

A verification feeds the text's new tokens and the drafts; where the round also offers the drafter's
next-best tokens (`hf_polybasic.decoding.alternatives`), each sits at the position of the draft it
stands in for and sees only what that draft would have seen, so its logits are the model's after the
text, the drafts before it and itself: the same as a forward of that sequence alone.
"""

from __future__ import annotations

import torch

from .. import compat


def branch_mask(past: int, fed: int, drafts: int, per_draft: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The additive attention mask ``[1, 1, fed + drafts * per_draft, past + fed + drafts * per_draft]``
    of one forward that feeds ``fed`` tokens after ``past`` cached ones (the last ``drafts`` of them
    drafts) and then ``per_draft`` alternatives for each draft: the fed tokens attend causally; the
    alternatives of draft j sit at its position and attend to every slot before it and to themselves."""
    branches = drafts * per_draft
    total = past + fed + branches
    blocked = torch.finfo(dtype).min
    mask = torch.full((fed + branches, total), blocked, dtype=dtype, device=device)
    columns = torch.arange(total, device=device)
    rows = torch.arange(fed, device=device)
    mask[:fed].masked_fill_(columns.unsqueeze(0) <= (past + rows).unsqueeze(1), 0.0)
    first_draft = past + fed - drafts  # the slot of draft 0
    depth = torch.arange(branches, device=device) // per_draft
    before = columns.unsqueeze(0) < (first_draft + depth).unsqueeze(1)
    itself = columns.unsqueeze(0) == (past + fed + torch.arange(branches, device=device)).unsqueeze(1)
    mask[fed:].masked_fill_(before | itself, 0.0)
    return mask.view(1, 1, fed + branches, total)


class BranchForward:
    """What a one-row `hf_polybasic.runners.dynamic.CachedModel` adds to score branches: one forward of its
    new tokens and of alternatives to its last drafts (`logits_with_alternatives`)."""

    @property
    def scores_alternatives(self) -> bool:
        """Whether `logits_with_alternatives` can run: one row on a cache, no recurrent state or kept
        features, attention that takes a 4-D mask (sdpa, eager) and no windowed layers (a 4-D mask
        would replace their window)."""
        return (self.rows == 1 and self.cache is not None and self.states is None and self.features is None
                and compat.attention_implementation(self.model) in ("sdpa", "eager")
                and not compat.windowed_layers(self.model))

    def logits_with_alternatives(self, sequence: torch.LongTensor, drafts: int,
                                 alternatives: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` of the only row for its last ``drafts + 1`` positions, and in the same forward the
        logits after each of ``alternatives`` ``[drafts, m]``, token i of row j in place of the j-th of
        the last ``drafts`` tokens of ``sequence`` (`alternatives.branch_mask`): ``([drafts + 1, V],
        [drafts, m, V])``. Afterwards the cache holds ``sequence`` as `logits` leaves it; the
        alternatives' slots are cut."""
        first_needed = sequence.shape[0] - drafts - 1
        if self.lengths[0] > first_needed:
            self.rollback_rows({0: first_needed})
        past, fed = self.lengths[0], sequence[self.lengths[0]:]
        per_draft = int(alternatives.shape[1])
        branches = alternatives.reshape(-1).to(fed.device)
        self._check_ids([fed, branches])
        count = int(fed.shape[0])
        inputs = torch.cat([fed, branches]).unsqueeze(0).to(self.device)
        depth = torch.arange(drafts, device=self.device).repeat_interleave(per_draft)
        positions = torch.cat([torch.arange(past, past + count, device=self.device),
                               sequence.shape[0] - drafts + depth]).unsqueeze(0)
        mask = branch_mask(past, count, drafts, per_draft, self.model.dtype, self.device)
        keep = drafts + 1 + int(branches.shape[0])
        kwargs = {"logits_to_keep": keep} if self._accepts_logits_to_keep else {}
        with self._timed_forward(int(inputs.shape[1]), 1), self._attention():
            outputs = self.model(input_ids=inputs, position_ids=positions, attention_mask=mask, use_cache=True,
                                 **{compat.cache_argument(self.model): self.cache}, **kwargs)
        compat.remove_last_tokens(self.cache, int(branches.shape[0]))
        self._slots[0].extend(range(past, past + count))
        self.lengths[0] = sequence.shape[0]
        logits = self._to_target_vocabulary(outputs.logits[0, -keep:, : self.vocab_limit].float())
        return logits[: drafts + 1], logits[drafts + 1 :].view(drafts, per_draft, -1)
