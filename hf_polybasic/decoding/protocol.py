"""The protocol between the levels of a chain: a `Level` proposes, the level above verifies.

A chain M1 > M2 > ... > Mn is a stack of levels; data flows one way, proposals up and rollbacks
down. Every level below the target implements `Level`:

* ``propose({row: (sequence, budget)}, schedules=None) -> {row: Proposal}``: tokens to follow each
  row's ``sequence`` (at most its ``budget``), under the level's own schedules or the ``schedules``
  the level above passes for this round; the rows share the level's forwards;
* ``verified({row: kept}, seconds)``: the level above kept the first ``kept`` tokens of each row's
  last proposal (each row's share of the verification took ``seconds``); the level rolls itself and everything below
  back to them and updates each row's schedule;
* ``rollback_rows({row: length})`` / ``commit()``: forget each row's tokens past ``length`` /
  everything so far is final (the target verified it), here and below;
* ``release_rows(rows)``: these rows are done; they leave every later forward, here and below.

A level that runs a model drives it through a `Runner`: the model and the cache it decodes on, fed
incrementally along each row's token sequence. Two kinds serve the same protocol, and the chain
does not know which it has: `hf_polybasic.runners.dynamic.CachedModel` (a `DynamicCache`, rolled back by
cutting its tail) and `hf_polybasic.runners.static.StaticRunner` (a preallocated cache, padded widths,
compiled forwards).

Vocabulary (the same everywhere in the package):

* **proposal**: the tokens a level hands to the level above in one call, ``tokens`` ``[m]``, and
  the distribution each was drawn from, ``probs`` ``[m, V]``, or ``None`` when every token is a
  point mass (greedy levels, n-gram drafters);
* **block**: a proposal being built: the drafter adds one token per step, an intermediate level
  one verification round at a time. `Block.extend` is the one place a proposal is cut: after the
  first EOS (nothing after it can ever be emitted) and at the length budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..stats import LevelStats


@dataclass(frozen=True)
class Proposal:
    """Tokens handed up and the distribution each was drawn from.

    Attributes:
        tokens: ``[m]`` token ids (m may be 0: the level above then decodes one token alone).
        probs: ``[m, V]`` the processed distribution each token was drawn from, or None for point
            masses. Losslessness rests on this being exactly what the token was drawn from.
    """

    tokens: torch.LongTensor
    probs: torch.Tensor | None = None
    ids: list[int] | None = None  # the tokens as host ints, when the level read them back
    deferred: Deferred | None = None  # where the level left its read to the level above
    # per token, the drafter's next-best ids there, greedy (`hf_polybasic.decoding.alternatives`); else None
    alternatives: list[list[int]] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Deferred:
    """A proposal whose end is still on the device: where a read waits for the device, a model
    drafter hands up every token it drafted without reading them back, and the level above reads
    ``pieces`` (named tensors, `hf_polybasic.decoding.reads.HostRead`) with its own decision, in its one
    read; ``settle`` then takes what that read returned (``{name: [values]}``) and returns each row's
    settled proposal, a prefix of the drafted tokens (cut after an invalid draw, an EOS, or where the drafter's schedule stops).
    Every proposal of one ``propose`` call shares the same `Deferred`; ``late_seconds`` says which
    part of the level above's read was the drafter's work still running.

    The level above verifies all the drafted tokens and keeps ``min(accepted, settled)`` of them,
    then its own token at that position: where it accepted more than the settled prefix, that is the
    next drafted token, which the acceptance test at that position emitted as a sample of the
    verifier's distribution. Exact because the prefix's length depends only on the tokens inside it
    (a stopping time of the drafts), never on the verification."""

    pieces: list  # what the level above's read must carry (`hf_polybasic.decoding.reads.HostRead` pieces)
    settle: Callable[[dict], dict[int, Proposal]]
    # after `settle`: seconds of the drafting that ran on the device past the drafter's own span,
    # which the level above waited for in its read (they are the drafter's, not the verifier's)
    late_seconds: Callable[[], float] = lambda: 0.0


class Block:
    """A proposal under construction, at most ``budget`` tokens, closed after an EOS.

    Every piece must come with probabilities or none must (a level either samples or does not).
    """

    def __init__(self, eos_token_ids: frozenset[int], budget: int, device: torch.device | str = "cpu"):
        self.eos_token_ids = eos_token_ids
        self.budget = max(int(budget), 0)
        self._tokens: list[torch.LongTensor] = [torch.empty(0, dtype=torch.long, device=device)]
        self._ids: list[int] = []  # the same tokens on the host
        self._probs: list[torch.Tensor] = []
        self._alternatives: list[list[int]] = []  # per token, where the level offers alternatives
        self.size = 0
        self.ended = False  # an EOS was added
        self._sampled: bool | None = None  # whether pieces come with probabilities

    @property
    def closed(self) -> bool:
        """Nothing more can be added: the budget is used up or the block ends with an EOS."""
        return self.ended or self.size >= self.budget

    @property
    def tokens(self) -> torch.LongTensor:
        """``[size]`` the tokens so far."""
        if len(self._tokens) > 1:
            self._tokens = [torch.cat(self._tokens)]
        return self._tokens[0]

    def extend(self, tokens: torch.LongTensor, probs: torch.Tensor | None = None, ids: list[int] | None = None,
               alternatives: list[list[int]] | None = None) -> int:
        """Add ``tokens`` ``[j]`` (and their ``probs`` ``[j, V]``), cut after the first EOS and at
        the budget; returns how many were kept. ``ids``: the same tokens as host ints, when the
        caller has them (else they are read back here, to find an EOS); ``alternatives``: each
        token's next-best ids (`hf_polybasic.decoding.alternatives`), kept with it."""
        if self.closed or tokens.shape[0] == 0:
            return 0
        if self._sampled is None:
            self._sampled = probs is not None
        elif self._sampled != (probs is not None):
            raise ValueError("a block takes probabilities for every piece or for none")
        keep = min(int(tokens.shape[0]), self.budget - self.size)
        ids = (tokens[:keep].tolist() if ids is None else ids)[:keep]
        for index, token in enumerate(ids):
            if token in self.eos_token_ids:
                keep = index + 1
                self.ended = True
                break
        self._tokens.append(tokens[:keep].to(self._tokens[0].device))
        self._ids.extend(ids[:keep])
        if alternatives is not None:
            self._alternatives.extend(alternatives[:keep])
        if probs is not None:
            self._probs.append(probs[:keep])
        self.size += keep
        return keep

    def truncate(self, size: int) -> None:
        """Keep only the first ``size`` tokens (a level that decides, from the tokens up to one of
        them, to end its proposal there; what follows was not looked at, so dropping it is exact)."""
        if size >= self.size:
            return
        self._tokens = [self.tokens[:size]]
        del self._ids[size:]
        del self._alternatives[size:]
        if self._probs:
            self._probs = [torch.cat(self._probs)[:size]]
        self.size = size
        self.ended = bool(size) and self._ids[-1] in self.eos_token_ids

    @property
    def ids(self) -> list[int]:
        """``[size]`` the tokens so far, as host ints."""
        return list(self._ids)

    def proposal(self) -> Proposal:
        probs = torch.cat(self._probs) if self._probs else None
        alternatives = list(self._alternatives) if len(self._alternatives) == self.size and self.size else None
        return Proposal(self.tokens, probs, list(self._ids), alternatives=alternatives)


class Runner(Protocol):
    """One model and its cache for the rows of a batch (see the module docstring).

    Attributes: ``model``, ``role`` (its name in messages), ``lengths`` (per row, tokens of its
    current sequence held in the cache), ``forward_passes``, ``live_rows`` (rows not released),
    ``cost_observer`` (told ``observe(tokens, seconds, rows)`` after forwards, when set), ``states``
    (a hybrid model's recurrent-state copies, else None).
    """

    model: torch.nn.Module
    role: str
    lengths: list[int]
    forward_passes: int
    cost_observer: object | None
    states: object | None

    @property
    def live_rows(self) -> int: ...

    def logits(self, sequence: torch.LongTensor, num_positions: int) -> torch.Tensor:
        """Float32 logits ``[num_positions, V]`` for the last positions of ``sequence`` (row 0)."""
        ...

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """``{row: (sequence [L], num_positions)}`` -> ``{row: [num_positions, V]}``, one forward; row j
        of a result predicts the token after ``sequence[:L - num_positions + 1 + j]``."""
        ...

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's tokens past its length (no-op where fewer are held)."""
        ...

    def release_rows(self, rows) -> None: ...

    def commit(self) -> None:
        """Everything held is final: nothing before it will be rolled back."""
        ...

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Hold every row's prompt but its last token; rows come in groups of ``repeats`` identical prompts."""
        ...


class Level(Protocol):
    """A level below the target (see the module docstring), serving every row of a batch: requests
    and answers are ``{row: ...}`` for the rows concerned."""

    stats: LevelStats

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]],
                schedules: dict | None = None) -> dict[int, Proposal]: ...

    def proposed(self, row: int) -> int: ...

    def verified(self, kept: dict[int, int], seconds: float, more: int = 0) -> None: ...

    def rollback_rows(self, lengths: dict[int, int]) -> None: ...

    def commit(self) -> None: ...

    def release_rows(self, rows) -> None: ...
