"""One model with its own `DynamicCache`: feed tokens, read logits, roll back, commit.

Invariant of `CachedModel`: its cache holds the keys/values of ``sequence[:length]`` for whatever
sequence the chain passes next; callers keep it true by calling `rollback_to` whenever they discard
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
from .attention import attention_for
from .transfer import upload
from ..labels import model_label
from ..vocabulary import input_vocabulary_size
from ..timing import DEFAULT_CLOCK, Clock, ForwardTimer, cuda_devices


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


def to_target_vocabulary(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """An assistant's logits at the target's output width: ids it lacks (padding rows of the
    target's output layer) get -inf, so they are never proposed."""
    if vocab_limit is not None and logits.shape[-1] < vocab_limit:
        logits = torch.nn.functional.pad(logits, (0, vocab_limit - logits.shape[-1]), value=-float("inf"))
    return logits


def check_ids(new_ids: torch.LongTensor, input_vocabulary: int, role: str) -> None:
    """A clear error, not an IndexError in the embedding, for an id a model cannot embed (an
    assistant whose vocabulary lacks a few of the target's padding rows, see `hf_polybasic.vocabulary`)."""
    largest = int(new_ids.max()) if new_ids.numel() else -1
    if largest >= input_vocabulary:
        raise ValueError(
            f"token id {largest} was generated but {role} has only {input_vocabulary} token "
            "ids; every model of a chain must use the target's tokenizer (its vocabulary must cover every id "
            "the target emits)"
        )


# A batch's cache is compacted (every row's tokens moved next to each other, holes dropped) once it
# holds more than this many slots per token of its longest row
COMPACT_RATIO = 1.25


class CachedModel:
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

    ``vocab_limit`` is the target's output width: an assistant's logits are cut to it (an assistant
    whose output layer is padded beyond the target's must never propose an id the target does not
    have) or padded to it with -inf, so every level's processors see the target's vocabulary.

    Attributes:
        lengths: per row, tokens of its current sequence whose keys/values are cached.
        forward_passes: forward calls made (F_i in the paper; one per batched forward).
        cost_observer: told ``observe(tokens computed, seconds, rows)`` after every forward, when set
            (a `hf_polybasic.costs.CostEstimate` following what forwards cost on this machine now).
        compactions: times a batch's cache was compacted.
        states: for a model with recurrent layers (one row), the copies of their state that a
            rollback restores (`hf_polybasic.runners.recurrent.StateHistory`: its length may then drop below
            the one asked, and the next forward re-feeds the difference); else None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        role: str,
        vocab_limit: int | None = None,
        clock: Clock = DEFAULT_CLOCK,
        rows: int = 1,
    ):
        self.model = model
        self.vocab_limit = vocab_limit
        self.cache = cache
        self.role = role
        self.clock = clock
        self.rows = rows
        self.device = model.device
        self.cuda_devices = cuda_devices(model)
        # forwards are timed for the cost observer without waiting for the GPU (CUDA events, read later)
        self._timer = ForwardTimer(self.device, clock, self.cuda_devices)
        # shapes change every forward: attention kernels that plan per shape (cuDNN) are left out on a GPU
        self._attention = attention_for(self.device, fixed_shapes=False)
        if cache is not None:
            check_rollback_support(model, cache, role)
            compat.record_past_states(cache)
        self.states = recurrent.StateHistory.of(model, cache, rows, role)  # hybrid models: recurrent state copies
        if rows > 1 and (cache is None or compat.cached_tokens(cache) > 0):
            raise ValueError(f"{role}: a batch of rows needs an empty cache of its own")
        first = compat.cached_tokens(cache) if cache is not None else 0
        self.lengths = [first] * rows
        self._slots = [list(range(first)) for _ in range(rows)]  # physical slot of each cached token
        # a batch: each live row's index in the cache's batch (None once released), and which slots hold a
        # token of that row ([live rows, slots], the attention mask)
        self._batch_index: list[int | None] = list(range(rows))
        self._valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.forward_passes = 0
        self.compactions = 0
        self.cost_observer = None
        self.input_vocabulary = input_vocabulary_size(model)
        # ids reaching a model come from the prompt and the target's output: only an assistant that
        # embeds fewer ids than the target emits can meet one it lacks (the target itself fails on
        # an id beyond its embedding exactly as plain generate does)
        self._ids_need_check = vocab_limit is not None and self.input_vocabulary < vocab_limit
        self._accepts_logits_to_keep = compat.accepts_logits_to_keep(model)

    @property
    def length(self) -> int:
        """Cached tokens of the only row (a one-row runner)."""
        return self.lengths[0]

    @property
    def live_rows(self) -> int:
        """Rows not released yet (the width of a batched forward)."""
        return sum(index is not None for index in self._batch_index)

    @property
    def slots(self) -> int:
        """Physical slots of the cache (a batch: holes included)."""
        return self._valid.shape[1] if self.rows > 1 else self.lengths[0]

    def logits(self, sequence: torch.LongTensor, num_positions: int) -> torch.Tensor:
        """Float32 logits ``[num_positions, V]`` for the last positions of ``sequence`` ``[L]`` (row 0).

        Row j predicts the token after ``sequence[:L - num_positions + 1 + j]``. Only tokens not
        yet cached are fed; afterwards all L tokens are cached.
        """
        return self.logits_rows({0: (sequence, num_positions)})[0]

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """`logits` for several rows in one forward: ``{row: (sequence [L], num_positions)}`` ->
        ``{row: [num_positions, V]}``; live rows not asked feed nothing (their slots of this forward
        are holes)."""
        fed = {}
        for row, (sequence, num_positions) in requests.items():
            first_needed = sequence.shape[0] - num_positions
            if self.lengths[row] > first_needed:
                self.rollback_rows({row: first_needed})
            if self.states is not None:  # hybrid model: copy its recurrent state first
                self.states.before_forward(self, sequence[:first_needed])
            fed[row] = sequence[0 if self.cache is None else self.lengths[row] :]
        if self._ids_need_check:
            self._check_ids(torch.cat(list(fed.values())))
        keep = max(n for _, n in requests.values())
        kwargs = {"logits_to_keep": keep} if self._accepts_logits_to_keep else {}
        self._timer.start()
        with self._attention():
            if self.rows == 1:
                (row,) = requests
                logits = {row: self._forward_one(fed[row], requests[row][1], kwargs)}
                computed, batch = int(fed[row].shape[0]), 1
            else:
                logits, computed, batch = self._forward_rows(fed, {r: n for r, (_, n) in requests.items()}, kwargs)
        self._timer.stop(computed, batch, self.cost_observer)
        self.forward_passes += 1
        for row, (sequence, _) in requests.items():
            self.lengths[row] = sequence.shape[0]
        return {row: self._to_target_vocabulary(value) for row, value in logits.items()}

    def _forward_one(self, fed: torch.LongTensor, num_positions: int, kwargs: dict) -> torch.Tensor:
        inputs = fed.unsqueeze(0).to(self.device)
        if self.cache is None:
            outputs = self.model(input_ids=inputs, use_cache=False, **kwargs)
        else:
            start = self.lengths[0]
            positions = torch.arange(start, start + fed.shape[0], device=self.device).unsqueeze(0)
            forward = self.model if self.states is None else self.states.forward(self.model)  # hybrid model
            outputs = forward(
                input_ids=inputs, position_ids=positions, use_cache=True,
                **{compat.cache_argument(self.model): self.cache}, **kwargs
            )
            self._slots[0].extend(range(start, start + fed.shape[0]))
        return outputs.logits[0, -num_positions:, : self.vocab_limit].float()

    def _forward_rows(self, fed: dict, num_positions: dict, kwargs: dict) -> tuple[dict, int, int]:
        """One forward of every live row's new tokens, left-padded to the widest (pads are holes);
        (logits per row asked, tokens computed, rows of the forward)."""
        self._compact_if_sparse()
        width = max(int(tokens.shape[0]) for tokens in fed.values())
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
            input_ids=inputs, position_ids=upload(positions, self.device),
            attention_mask=self._valid.long(), use_cache=True, **{compat.cache_argument(self.model): self.cache}, **kwargs,
        )
        logits = {
            row: outputs.logits[self._batch_index[row], -n:, : self.vocab_limit].float() for row, n in num_positions.items()
        }
        return logits, batch * width, batch

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Cache every row's prompt but its last token, computing each distinct prompt once: rows come
        in groups of ``repeats`` identical prompts (``num_return_sequences``); the groups' caches are
        then repeated (``batch_repeat_interleave``)."""
        rows = sorted(prompts)
        if self.rows == 1 or self.cache is None or any(self.lengths) or len(rows) != self.rows or self.rows % repeats:
            raise ValueError(f"{self.role}: prefill_repeated needs an empty runner of {len(rows)} rows")
        firsts = [prompts[row][:-1] for row in rows[::repeats]]
        width = max(int(tokens.shape[0]) for tokens in firsts)
        if width == 0:
            return
        if self._ids_need_check:
            self._check_ids(torch.cat(firsts))
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
            self.model(input_ids=inputs, position_ids=positions.to(self.device),
                       attention_mask=valid.long(), use_cache=True, **{compat.cache_argument(self.model): self.cache}, **kwargs)
        self.forward_passes += 1
        self.cache.batch_repeat_interleave(repeats)
        self._valid = valid.repeat_interleave(repeats, dim=0)
        for row in rows:
            count = int(firsts[row // repeats].shape[0])
            self._slots[row] = list(range(width - count, width))
            self.lengths[row] = count

    def _to_target_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        return to_target_vocabulary(logits, self.vocab_limit)

    def _check_ids(self, new_ids: torch.LongTensor) -> None:
        check_ids(new_ids, self.input_vocabulary, self.role)

    def rollback_to(self, length: int) -> None:
        """Forget the only row's cached tokens past ``length`` (no-op if fewer are cached)."""
        self.rollback_rows({0: length})

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's cached tokens past its ``length`` (no-op where fewer are cached, and for
        rows already released)."""
        if self.rows == 1:
            length = lengths.get(0, self.lengths[0])
            if length < self.lengths[0]:
                if self.cache is not None:
                    if self.states is not None:  # hybrid model: back to a copy of its recurrent state
                        length = self.states.restore(length)  # (at most `length` tokens: the next forward re-feeds)
                    compat.remove_last_tokens(self.cache, self.lengths[0] - length)
                    del self._slots[0][length:]
                self.lengths[0] = length
            return
        for row, length in lengths.items():
            index = self._batch_index[row]
            if index is None or length >= self.lengths[row]:
                continue
            dropped = self._slots[row][length:]
            self._valid[index, dropped] = False
            del self._slots[row][length:]
            self.lengths[row] = length
        self._cut_unused_tail()

    def release_rows(self, rows) -> None:
        """Rows that are done leave the cache's batch: every later forward is as wide as the rows
        still live (one ``batch_select_indices``)."""
        if self.rows == 1 or self.cache is None:
            return
        gone = {row for row in rows if self._batch_index[row] is not None}
        if not gone:
            return
        live = [row for row in range(self.rows) if self._batch_index[row] is not None and row not in gone]
        keep = [self._batch_index[row] for row in live]
        if live:
            keep = upload(torch.tensor(keep), self.device)
            compat.select_batch_rows(self.cache, keep)
            self._valid = self._valid[keep]
        for row in gone:
            self._batch_index[row] = None
            self._slots[row] = []
        for index, row in enumerate(live):
            self._batch_index[row] = index
        if live:
            self._cut_unused_tail()

    def _live_rows(self) -> list[int]:
        return [row for row in range(self.rows) if self._batch_index[row] is not None]

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
