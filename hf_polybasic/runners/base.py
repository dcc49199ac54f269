"""What every runner shares (`hf_polybasic.decoding.protocol.Runner`): one model fed incrementally
along the token sequences of ``rows`` rows, its per-row lengths, the id check and vocabulary padding
that put an assistant on the target's vocabulary, and the timer that reports each forward's cost.

`RunnerBase` holds that half; `hf_polybasic.runners.dynamic.CachedModel` (a `DynamicCache`) and
`hf_polybasic.runners.static.StaticRunner` (a preallocated, compiled cache) add how they feed, roll
back and release rows.
"""

from __future__ import annotations

import contextlib

import torch

from .attention import attention_for
from .features import FeatureStore
from ..timing import DEFAULT_CLOCK, Clock, ForwardTimer, cuda_devices
from ..vocabulary import input_vocabulary_size


def to_target_vocabulary(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """An assistant's logits ``[positions, V']`` at the target's output width ``vocab_limit``: ids it
    lacks (padding rows of the target's output layer) get -inf, so they are never proposed."""
    if vocab_limit is not None and logits.shape[-1] < vocab_limit:
        logits = torch.nn.functional.pad(logits, (0, vocab_limit - logits.shape[-1]), value=-float("inf"))
    return logits


def check_ids(new_ids: torch.LongTensor, input_vocabulary: int, role: str) -> None:
    """A clear error, not an IndexError in the embedding, for an id of ``new_ids`` ``[n]`` a model cannot
    embed (an assistant whose vocabulary lacks a few of the target's padding rows, see
    `hf_polybasic.vocabulary`)."""
    largest = int(new_ids.max()) if new_ids.numel() else -1
    if largest >= input_vocabulary:
        raise ValueError(
            f"token id {largest} was generated but {role} has only {input_vocabulary} token "
            "ids; every model of a chain must use the target's tokenizer (its vocabulary must cover every id "
            "the target emits)"
        )


class RunnerBase:
    """A causal LM fed incrementally along the token sequences of ``rows`` rows.

    Invariant: ``lengths[row]`` tokens of the row's current sequence are held in the cache; a forward
    feeds only the tokens past it, a rollback lowers it. Logits handed out are float32 at the target's
    output width ``vocab_limit``: cut to it (an assistant whose output layer is padded beyond the
    target's must never propose an id the target does not have) or padded to it with -inf, so every
    level's processors see the target's vocabulary.

    Attributes:
        lengths: per row, tokens of its current sequence held in the cache.
        forward_passes: forward calls made (F_i in the paper; one per batched forward).
        cost_observer: told ``observe(tokens computed, seconds, rows)`` after timed forwards, when set
            (a `hf_polybasic.costs.CostEstimate` following what forwards cost on this machine now); on
            a GPU the seconds come from CUDA events read once the work has run (no forward waits).
        states: the copies of a hybrid model's recurrent state that a rollback restores
            (`hf_polybasic.runners.recurrent.StateHistory`); None for a model without recurrent state.
    """

    states = None  # set by a runner whose model has recurrent layers (`CachedModel`, one row)
    features: FeatureStore | None = None  # set by `capture_features`: a draft head below reads them

    def __init__(self, model: torch.nn.Module, role: str, vocab_limit: int | None, clock: Clock = DEFAULT_CLOCK,
                 rows: int = 1, first: int = 0):
        self.model, self.role, self.vocab_limit, self.clock, self.rows = model, role, vocab_limit, clock, rows
        self.device = model.device
        self.cuda_devices = cuda_devices(model)
        self.lengths = [first] * rows
        self.forward_passes = 0
        self.cost_observer = None
        self.input_vocabulary = input_vocabulary_size(model)
        # ids reaching a model come from the prompt and the target's output: only an assistant that
        # embeds fewer ids than the target emits can meet one it lacks (the target itself fails on
        # an id beyond its embedding exactly as plain generate does)
        self._ids_need_check = vocab_limit is not None and self.input_vocabulary < vocab_limit
        # forwards are timed for the cost observer without waiting for the GPU (CUDA events, read later)
        self._timer = ForwardTimer(self.device, clock, self.cuda_devices)
        # forwards of changing shapes: attention kernels that plan per shape (cuDNN) are left out on a GPU
        self._attention = attention_for(self.device, fixed_shapes=False)

    def capture_features(self, layers: tuple[int, ...]) -> FeatureStore:
        """From now on every forward also keeps the hidden states ``layers`` selects (indices into
        transformers' ``output_hidden_states`` tuple) at the positions it feeds, rolled back with the
        cache (`hf_polybasic.runners.features`); returns the store a draft head reads."""
        if self.features is None:
            self.features = FeatureStore(layers)
        elif self.features.layers != tuple(layers):
            raise ValueError(f"{self.role} already feeds a draft head the hidden states of layers "
                             f"{self.features.layers}; a second head asks for {tuple(layers)}")
        return self.features

    def _feature_kwargs(self) -> dict:
        """What a forward passes the model so that it returns its hidden states, when they are kept."""
        return {} if self.features is None else {"output_hidden_states": True}

    def _cut_features(self, row: int, length: int | None) -> None:
        """The row's kept features follow its cache: cut to ``length`` (a rollback), or dropped (None: released)."""
        if self.features is None:
            return
        if length is None:
            self.features.release(row)
        else:
            self.features.truncate(row, length)

    def batch_rows(self) -> list[int]:
        """The row at each index of the batch a forward feeds (the live rows, in order)."""
        return self._live_rows()

    def _selected(self, outputs) -> torch.Tensor | None:
        """The kept layers' hidden states ``[B, width, F]`` of a forward's ``outputs``, when kept."""
        return None if self.features is None else self.features.select(outputs.hidden_states)

    def _keep_features(self, selected: torch.Tensor | None, placements: dict[int, tuple[int, int, int]]) -> None:
        """Keep the features ``selected`` ``[B, width, F]`` of a forward: ``placements`` ``{row: (batch
        index, first column, count)}``, each row's fed tokens in those columns of the forward's inputs,
        written from the position its cache held before (`FeatureStore.write`)."""
        if self.features is None:
            return
        for row, (index, column, count) in placements.items():
            self.features.write(row, self.lengths[row], selected[index, column : column + count])

    @property
    def checks_ids(self) -> bool:
        """Whether ids fed to the model are checked on the host first (it embeds fewer than the target emits)."""
        return self._ids_need_check

    @property
    def length(self) -> int:
        """Cached tokens of the only row (a one-row runner)."""
        return self.lengths[0]

    @property
    def live_rows(self) -> int:
        """Rows not released yet."""
        return len(self._live_rows())

    def _live_rows(self) -> list[int]:
        """The rows not released yet, in order."""
        raise NotImplementedError

    def logits(self, sequence: torch.LongTensor, num_positions: int) -> torch.Tensor:
        """Float32 logits ``[num_positions, V]`` for the last positions of ``sequence`` ``[L]`` (row 0).

        Row j predicts the token after ``sequence[:L - num_positions + 1 + j]``. Only tokens not
        yet cached are fed; afterwards all L tokens are cached.
        """
        return self.logits_rows({0: (sequence, num_positions)})[0]

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        raise NotImplementedError

    def _check_ids(self, pieces) -> None:
        """Refuse ids the model cannot embed among ``pieces`` (tensors ``[n_i]``), where it can meet any."""
        if self._ids_need_check:
            check_ids(torch.cat(list(pieces)), self.input_vocabulary, self.role)

    def _to_target_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:  # [positions, V'] -> [positions, V]
        return to_target_vocabulary(logits, self.vocab_limit)

    @contextlib.contextmanager
    def _timed_forward(self, tokens: int, rows: int, observed: bool = True):
        """One forward computing ``tokens`` tokens over ``rows`` rows runs inside: it is counted, and
        timed into the cost observer unless not ``observed`` (a forward that compiles a graph)."""
        self._timer.start()
        yield
        self._timer.stop(tokens, rows, self.cost_observer if observed else None)
        self.forward_passes += 1
