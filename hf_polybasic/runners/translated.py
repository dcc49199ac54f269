"""A translated level's runner: the runner protocol in the target's ids over a runner in the level's own.

`TranslatedRunner` serves `hf_polybasic.decoding.protocol.Runner` to the chain, so a `ModelDrafter`
drafts with a translated level and a `Verifier` verifies with one as with any model, and wraps an
ordinary runner (``inner``, a `CachedModel`) of the level's own model over its own ids:

1. each row's target sequence is translated to the level's own tokens (`OwnContext`: the prompt
   encoded once, each later token mapped to its twin or re-encoded through its text);
2. the inner runner scores the own positions that end where the asked target positions end (a
   target token that added no own token, such as a held incomplete character, scores where the
   previous one did), after cutting its cache back to what it shares with the row's own tokens;
3. the level's logits go to the target's ids (`SharedVocabulary.to_target`: the shared tokens at
   their twins, -inf elsewhere), so the chain's processors and draws run on the target's ids.

Rollbacks cut the row's translation at the target length and the inner cache at the matching own
length. ``route="text"`` levels use `hf_polybasic.runners.text_route.TextRouteRunner`.
"""

from __future__ import annotations

import torch

from ..translation.context import OwnContext
from ..translation.shared import SharedVocabulary


class TranslatedRunner:
    """The runner protocol in the target's ids over ``inner``, a runner of the level's own model (see the
    module docs). ``width``: the target's output width (the logits handed out have it). Lengths are the
    target's: tokens of a row's sequence translated and held."""

    states = None

    def __init__(self, inner, shared: SharedVocabulary, width: int):
        self.inner, self.shared, self.width = inner, shared, width
        self.model, self.role, self.device, self.rows = inner.model, inner.role, inner.device, inner.rows
        self.lengths = [0] * self.rows
        self.contexts: list[OwnContext | None] = [None] * self.rows
        self._held: list[list[int]] = [[] for _ in range(self.rows)]  # own ids in the inner cache, per row

    # --- what the chain reads of a runner -------------------------------------------------------------
    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    @property
    def live_rows(self) -> int:
        return self.inner.live_rows

    @property
    def checks_ids(self) -> bool:
        return False  # the level's own ids come from its own tokenizer

    @property
    def cost_observer(self):
        return self.inner.cost_observer

    @cost_observer.setter
    def cost_observer(self, observer) -> None:
        self.inner.cost_observer = observer

    def batch_rows(self) -> list[int]:
        return self.inner.batch_rows()

    # --- translation ----------------------------------------------------------------------------------
    def context(self, row: int, sequence: torch.LongTensor, first: int) -> OwnContext:
        """The row's own context, translated up to the end of ``sequence`` ``[L]`` (target ids); a row
        asked for the first time (or whose sequence changed within its prompt) starts from the prompt
        ``sequence[:first]``."""
        ids = sequence.tolist()
        context = self.contexts[row]
        if context is None or first < context.start or not context.follow(ids):
            if context is not None:  # a new prompt: nothing of the old one is kept
                self._cut_inner({row: 0})
            context = self.contexts[row] = OwnContext(self.shared, ids[:first])
            context.follow(ids)
        return context

    def _cut_inner(self, lengths: dict[int, int]) -> None:
        """Cut each row's inner cache to its own ``length`` (one rollback for all rows)."""
        cut = {row: length for row, length in lengths.items() if self.inner.lengths[row] > length}
        if cut:
            self.inner.rollback_rows(cut)
        for row, length in lengths.items():
            del self._held[row][length:]

    def _shared_prefix(self, row: int, own: list[int]) -> int:
        """How many of the row's own tokens in the inner cache ``own`` begins with."""
        held = self._held[row] = self._held[row][: self.inner.lengths[row]]
        same = min(len(held), len(own))
        if held[:same] != own[:same]:
            same = next(index for index, (a, b) in enumerate(zip(held, own)) if a != b)
        return same

    # --- the runner protocol --------------------------------------------------------------------------
    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """``{row: (sequence [L], num_positions)}`` (target ids) -> ``{row: [num_positions, V]}``, the
        level's logits on the target's ids at those positions, in one forward of its own model."""
        asked, picks, shared = {}, {}, {}
        for row, (sequence, count) in requests.items():
            first = sequence.shape[0] - count + 1  # the target length the first asked position follows
            context = self.context(row, sequence, first)
            ends = [context.own_length(first + j) for j in range(count)]  # own length where each position ends
            own = context.own[: ends[-1]]
            shared[row] = self._shared_prefix(row, own)
            asked[row] = (torch.tensor(own, dtype=torch.long, device=sequence.device), ends[-1] - ends[0] + 1)
            picks[row] = torch.tensor([end - ends[0] for end in ends], device=self.device)
        self._cut_inner(shared)
        logits = self.inner.logits_rows(asked)
        out = {}
        for row, (sequence, _) in requests.items():
            self.lengths[row] = sequence.shape[0]
            self._held[row] = self.contexts[row].own[: self.inner.lengths[row]]
            out[row] = self.shared.to_target(logits[row].index_select(0, picks[row].to(logits[row].device)), self.width)
        return out

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's target tokens past its length, and the own tokens they became."""
        cut = {}
        for row, length in lengths.items():
            context = self.contexts[row]
            if context is None or length >= self.lengths[row]:
                continue
            if length < context.start:  # before the prompt the level encoded: start again from nothing
                self.contexts[row], cut[row] = None, 0
            else:
                context.truncate(length)
                cut[row] = context.own_length(length)
            self.lengths[row] = length
        self._cut_inner(cut)

    def release_rows(self, rows) -> None:
        self.inner.release_rows(rows)
        for row in rows:
            self.contexts[row], self._held[row] = None, []

    def commit(self) -> None:
        self.inner.commit()

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Hold every row's prompt, in the level's own tokens, but its last own token; rows come in
        groups of ``repeats`` identical prompts (so are their translations)."""
        own = {}
        for row, prompt in prompts.items():
            context = self.contexts[row] = OwnContext(self.shared, prompt.tolist())
            own[row] = torch.tensor(context.own, dtype=torch.long, device=prompt.device)
        self.inner.prefill_repeated(own, repeats)
        for row, prompt in prompts.items():
            self.lengths[row] = int(prompt.shape[0]) - 1
            self._held[row] = self.contexts[row].own[: self.inner.lengths[row]]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
