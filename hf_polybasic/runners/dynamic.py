"""One model with its own `DynamicCache`: feed tokens, read logits, roll back, commit.

Invariant of `CachedModel`: its cache holds the keys/values of ``sequence[:length]`` for whatever
sequence the chain passes next; callers keep it true by calling `rollback_rows` whenever they discard
tokens. Rollbacks only go down the chain (a verifier rolls back the level below it) and never
re-prefill from scratch: they cut the tail of the cache.

Rollback across several verification rounds: an intermediate level's block is verified by the
level above only after several of its own rounds, so its cache must be able to drop tokens older
than its last round. Sliding-window layers therefore keep their past states until `commit` (called
once the target has verified a block, when no rollback can reach before it) restricts them to the
window; how that is done for each transformers release lives in `hf_polybasic.compat`.
"""

from __future__ import annotations

import torch

from .. import compat
from . import recurrent
from .base import RunnerBase
from .branches import BranchForward
from .transfer import upload
from ..timing import DEFAULT_CLOCK, Clock


def check_rollback_support(model: torch.nn.Module, cache, role: str) -> None:
    """Raise a clear error if ``cache`` cannot be rolled back token by token.

    ``role`` names the model in messages, e.g. "target M1 LlamaForCausalLM".
    """
    layers = recurrent.recurrent_layers(model)
    if layers:  # hybrid models: hf_polybasic.runners.recurrent checks them
        recurrent.check_rollback_support(model, cache, role, layers)
        return
    if compat.is_stateful(model):
        raise ValueError(
            f"{role} is stateful (recurrent/SSM state); its state cannot be rolled back after a rejected draft, "
            "so it cannot be part of a speculative chain"
        )
    if not compat.is_dynamic_cache(cache):
        raise ValueError(
            f"{role} uses a {type(cache).__name__}, which cannot be rolled back token by token "
            "(static and quantized caches have no exact crop); use the default DynamicCache "
            "(do not set cache_implementation / pass another cache type)"
        )
    unsupported = compat.unrollable_layer(cache)
    if unsupported is not None:
        index, name = unsupported
        raise ValueError(
            f"{role}: cache layer {index} is a {name} (recurrent or linear-attention state), "
            "which cannot be rolled back after a rejected draft; such models cannot be part of a speculative chain"
        )


# A batch's cache is compacted (every row's tokens moved next to each other, holes dropped) once it
# holds more than this many slots per token of its longest row
COMPACT_RATIO = 1.25


class CachedModel(BranchForward, RunnerBase):
    """A causal LM plus its own cache, fed incrementally along the token sequences of ``rows`` rows.

    One row: the cache holds exactly the row's cached tokens, and a rollback cuts its tail.
    Several rows (a batch): one forward feeds every live row its own new tokens at once. Each row's
    new tokens are left-padded to the widest row's count; pads and rolled-back tokens are *holes*,
    physical slots the attention mask hides, so rows that accepted different numbers of tokens are
    not realigned every round; each row's positions count its own tokens only. Trailing slots that
    no row uses any more are cut, and once the slots outnumber the longest row's tokens by
    `COMPACT_RATIO` the cache is compacted (one gather per layer), so memory, attention and the mask
    grow with the text, not with the history of rejections. Rows that are done leave the cache's
    batch (`release_rows`): later forwards are as wide as the live rows. Sliding-window layers
    cannot skip holes (their window counts slots), so a batch of such a model is decoded row by row
    (`hf_polybasic.runners.probe.rows_problem`).

    The one-row path is kept apart from the batch path (``_forward_one_row``, ``_rollback_one_row``):
    no mask, no padding, no uploads per forward. ``cache=None`` (one row) feeds the whole sequence
    every time. ``vocab_limit``: the target's output width (`RunnerBase`).

    Attributes (beside `RunnerBase`'s):
        compactions: times a batch's cache was compacted.
        states: for a model with recurrent layers (one row), the copies of their state that a
            rollback restores: its length may then drop below the one asked, and the next forward
            re-feeds the difference; else None.
    """

    def __init__(self, model: torch.nn.Module, cache, role: str, vocab_limit: int | None = None,
                 clock: Clock = DEFAULT_CLOCK, rows: int = 1):
        self.cache = cache
        if cache is not None:
            check_rollback_support(model, cache, role)
            compat.record_past_states(cache)
        self.states = recurrent.StateHistory.of(model, cache, rows, role)  # hybrid models: recurrent state copies
        if rows > 1 and (cache is None or compat.cached_tokens(cache) > 0):
            raise ValueError(f"{role}: a batch of rows needs an empty cache of its own")
        first = compat.cached_tokens(cache) if cache is not None else 0
        super().__init__(model, role, vocab_limit, clock, rows, first)
        self._slots = [list(range(first)) for _ in range(rows)]  # physical slot of each cached token
        # a batch: each live row's index in the cache's batch (None once released), and which slots hold a
        # token of that row ([live rows, slots], the attention mask)
        self._batch_index: list[int | None] = list(range(rows))
        self._valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.compactions = 0
        self._accepts_logits_to_keep = compat.accepts_logits_to_keep(model)

    @property
    def slots(self) -> int:
        """Physical slots of the cache (a batch: holes included)."""
        return self._valid.shape[1] if self.rows > 1 else self.lengths[0]

    def _live_rows(self) -> list[int]:
        return [row for row in range(self.rows) if self._batch_index[row] is not None]

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """`logits` for several rows in one forward: ``{row: (sequence [L], num_positions)}`` ->
        ``{row: [num_positions, V]}``; live rows not asked feed nothing (their slots of this forward
        are holes)."""
        fed = {}  # row -> [new tokens]
        for row, (sequence, num_positions) in requests.items():
            first_needed = sequence.shape[0] - num_positions
            if self.lengths[row] > first_needed:
                self.rollback_rows({row: first_needed})
            if self.states is not None:  # hybrid model: copy its recurrent state first
                self.states.before_forward(self, sequence[:first_needed])
            fed[row] = sequence[0 if self.cache is None else self.lengths[row] :]
        self._check_ids(fed.values())
        keep = max(n for _, n in requests.values())
        kwargs = {"logits_to_keep": keep} if self._accepts_logits_to_keep else {}
        if self.rows == 1:
            ((row, tokens),) = fed.items()
            with self._timed_forward(int(tokens.shape[0]), 1), self._attention():
                logits = {row: self._forward_one_row(tokens, requests[row][1], kwargs)}
        else:
            width, batch = max(int(tokens.shape[0]) for tokens in fed.values()), self._valid.shape[0]
            with self._timed_forward(batch * width, batch), self._attention():
                logits = self._forward_batch(fed, width, {row: n for row, (_, n) in requests.items()}, kwargs)
        for row, (sequence, _) in requests.items():
            self.lengths[row] = sequence.shape[0]
        return {row: self._to_target_vocabulary(value) for row, value in logits.items()}

    def _forward_one_row(self, fed: torch.LongTensor, num_positions: int, kwargs: dict) -> torch.Tensor:
        """Logits ``[num_positions, V]`` of one forward of the only row's new tokens ``fed`` ``[n]``
        (without a cache: of the whole sequence)."""
        inputs = fed.unsqueeze(0).to(self.device)
        kwargs = {**kwargs, **self._feature_kwargs()}
        if self.cache is None:
            outputs = self.model(input_ids=inputs, use_cache=False, **kwargs)
            self.lengths[0] = 0  # the whole sequence was fed
            self._keep_features(self._selected(outputs), {0: (0, 0, int(fed.shape[0]))})
        else:
            start = self.lengths[0]
            positions = torch.arange(start, start + fed.shape[0], device=self.device).unsqueeze(0)
            forward = self.model if self.states is None else self.states.forward(self.model)  # hybrid model
            outputs = forward(
                input_ids=inputs, position_ids=positions, use_cache=True,
                **{compat.cache_argument(self.model): self.cache}, **kwargs
            )
            self._slots[0].extend(range(start, start + fed.shape[0]))
            self._keep_features(self._selected(outputs), {0: (0, 0, int(fed.shape[0]))})
        return outputs.logits[0, -num_positions:, : self.vocab_limit].float()

    def _forward_batch(self, fed: dict, width: int, num_positions: dict, kwargs: dict) -> dict:
        """Logits ``{row: [num_positions[row], V]}`` of one forward of every live row's new tokens
        ``fed[row]`` ``[n_row]``, left-padded to ``width`` (the widest; pads are holes)."""
        self._compact_if_sparse()
        batch, slots = self._valid.shape
        # token ids stay where they are (no read back to the host); positions and the mask are host
        # bookkeeping, sent in one copy each that the host does not wait for
        inputs = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, width, dtype=torch.long)
        new_valid = torch.zeros(batch, width, dtype=torch.bool)
        for row, tokens in fed.items():
            count, index = int(tokens.shape[0]), self._batch_index[row]
            if count == 0:
                continue
            inputs[index, width - count :] = tokens.to(self.device)
            positions[index, width - count :] = torch.arange(self.lengths[row], self.lengths[row] + count)
            new_valid[index, width - count :] = True
            self._slots[row].extend(range(slots + width - count, slots + width))
        self._valid = torch.cat([self._valid, upload(new_valid, self.device)], dim=1)
        outputs = self.model(
            input_ids=inputs, position_ids=upload(positions, self.device), attention_mask=self._valid.long(),
            use_cache=True, **{compat.cache_argument(self.model): self.cache}, **kwargs, **self._feature_kwargs(),
        )
        self._keep_features(self._selected(outputs), {row: (self._batch_index[row], width - int(tokens.shape[0]),
                                                            int(tokens.shape[0])) for row, tokens in fed.items()})
        return {row: outputs.logits[self._batch_index[row], -n:, : self.vocab_limit].float()
                for row, n in num_positions.items()}

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Cache every row's prompt ``[L_row]`` but its last token, computing each distinct prompt once:
        rows come in groups of ``repeats`` identical prompts (``num_return_sequences``); the groups'
        caches are then repeated (``batch_repeat_interleave``)."""
        rows = sorted(prompts)
        if self.rows == 1 or self.cache is None or any(self.lengths) or len(rows) != self.rows or self.rows % repeats:
            raise ValueError(f"{self.role}: prefill_repeated needs an empty runner of {len(rows)} rows")
        firsts = [prompts[row][:-1] for row in rows[::repeats]]
        width = max(int(tokens.shape[0]) for tokens in firsts)
        if width == 0:
            return
        self._check_ids(firsts)
        inputs = torch.zeros(len(firsts), width, dtype=torch.long, device=self.device)
        positions = torch.zeros(len(firsts), width, dtype=torch.long)
        valid = torch.zeros(len(firsts), width, dtype=torch.bool)
        for group, tokens in enumerate(firsts):
            count = int(tokens.shape[0])
            inputs[group, width - count :] = tokens.to(self.device)
            positions[group, width - count :] = torch.arange(count)
            valid[group, width - count :] = True
        kwargs = {"logits_to_keep": 1} if self._accepts_logits_to_keep else {}
        valid = valid.to(self.device)
        with self._attention():
            outputs = self.model(input_ids=inputs, position_ids=positions.to(self.device), attention_mask=valid.long(),
                                 use_cache=True, **{compat.cache_argument(self.model): self.cache}, **kwargs,
                                 **self._feature_kwargs())
        counts = {row: int(firsts[row // repeats].shape[0]) for row in rows}
        self._keep_features(self._selected(outputs), {row: (row // repeats, width - counts[row], counts[row]) for row in rows})
        self.forward_passes += 1
        self.cache.batch_repeat_interleave(repeats)
        self._valid = valid.repeat_interleave(repeats, dim=0)
        for row in rows:
            count = int(firsts[row // repeats].shape[0])
            self._slots[row] = list(range(width - count, width))
            self.lengths[row] = count

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's cached tokens past its ``length`` (no-op where fewer are cached, and for
        rows already released)."""
        if self.rows == 1:
            self._rollback_one_row(lengths.get(0, self.lengths[0]))
        else:
            self._rollback_batch(lengths)

    def _rollback_one_row(self, length: int) -> None:
        """Cut the cache's tail (a hybrid model: back to a copy of its recurrent state, which may hold
        fewer than ``length`` tokens; the next forward re-feeds them)."""
        if length >= self.lengths[0]:
            return
        if self.cache is not None:
            if self.states is not None:
                length = self.states.restore(length)
            compat.remove_last_tokens(self.cache, self.lengths[0] - length)
            del self._slots[0][length:]
        self.lengths[0] = length
        self._cut_features(0, length)

    def _rollback_batch(self, lengths: dict[int, int]) -> None:
        """Turn each row's dropped slots into holes, then cut the trailing slots no row uses."""
        for row, length in lengths.items():
            index = self._batch_index[row]
            if index is None or length >= self.lengths[row]:
                continue
            self._valid[index, self._slots[row][length:]] = False
            del self._slots[row][length:]
            self.lengths[row] = length
            self._cut_features(row, length)
        self._cut_unused_tail()

    def release_rows(self, rows) -> None:
        """Rows that are done leave the cache's batch: every later forward is as wide as the rows
        still live (one ``batch_select_indices``). A one-row runner keeps its row."""
        if self.rows == 1 or self.cache is None:
            return
        gone = {row for row in rows if self._batch_index[row] is not None}
        if not gone:
            return
        live = [row for row in self._live_rows() if row not in gone]
        keep = [self._batch_index[row] for row in live]
        if live:
            keep = upload(torch.tensor(keep), self.device)
            compat.select_batch_rows(self.cache, keep)
            self._valid = self._valid[keep]
        for row in gone:
            self._batch_index[row] = None
            self._slots[row] = []
            self._cut_features(row, None)
        for index, row in enumerate(live):
            self._batch_index[row] = index
        if live:
            self._cut_unused_tail()

    def _cut_unused_tail(self) -> None:
        """Cut the trailing slots no row uses any more (the common case: every row rejected its tail)."""
        keep = max((self._slots[row][-1] + 1 for row in self._live_rows() if self._slots[row]), default=0)
        excess = self._valid.shape[1] - keep
        if excess > 0:
            compat.remove_last_tokens(self.cache, excess)
            self._valid = self._valid[:, :keep]

    def _compact_if_sparse(self) -> None:
        """Move every live row's cached tokens next to each other, right-aligned (as left padding
        would), once the slots outnumber the longest row's tokens by `COMPACT_RATIO`."""
        live = self._live_rows()
        longest = max((self.lengths[row] for row in live), default=0)
        if self._valid.shape[1] <= COMPACT_RATIO * longest or not live:
            return
        index = torch.zeros(len(live), longest, dtype=torch.long)  # new slot j of a row <- its old slot
        valid = torch.zeros(len(live), longest, dtype=torch.bool)
        for row in live:
            count, batch = len(self._slots[row]), self._batch_index[row]
            if count:
                index[batch, longest - count :] = torch.tensor(self._slots[row])
                valid[batch, longest - count :] = True
            self._slots[row] = list(range(longest - count, longest))
        compat.gather_slots(self.cache, upload(index, self.device))
        self._valid = upload(valid, self.device)
        self.compactions += 1

    def commit(self) -> None:
        """Everything cached is final: let sliding layers drop states outside their window, and
        compact a sparse batch."""
        if self.cache is not None:
            compat.restrict_sliding_layers(self.cache)
            if self.rows > 1:
                self._compact_if_sparse()
        if self.states is not None:
            self.states.commit()
