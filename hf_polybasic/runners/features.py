"""The hidden states a runner's forwards computed, kept per row and position for a draft head below it.

A trained draft head (`hf_polybasic.heads`) drafts from the hidden states of the level right above it.
That level's runner computes them anyway in every forward it runs (verifications, its own drafting,
a prompt's prefill); with a `FeatureStore` attached (`RunnerBase.capture_features`) each forward also
asks the model for its hidden states and keeps the ones the head reads (``layers``), concatenated,
at the positions it fed. Rollbacks cut them with the cache, so the store always holds the features
of a prefix of each row's current sequence: position ``p``'s feature is the state after reading the
token at ``p``, whatever forward computed it. Nothing is read back from the device.
"""

from __future__ import annotations

import torch


class FeatureStore:
    """Per row, ``[positions, F]`` features of a stretch of the row's sequence (F: the selected
    layers' widths together), on the device of the model that computed them.

    Invariant: the row's features are those of positions ``known_from(row) .. length(row) - 1``,
    and the runner that writes them holds no more of the row than ``length(row)`` tokens. Positions
    before ``known_from`` were cached before the store was attached (a cache the caller handed in):
    their features are not known."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = tuple(layers)
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (first position, [n, F])

    def select(self, hidden_states) -> torch.Tensor:
        """The features in transformers' ``hidden_states`` tuple ``(L + 1) x [B, n, d]``: the layers
        `layers` names, concatenated ``[B, n, F]``."""
        return torch.cat([hidden_states[layer] for layer in self.layers], dim=-1)

    def known_from(self, row: int) -> int:
        """The first position whose feature is held (0 unless the row's cache came filled)."""
        return self._rows[row][0] if row in self._rows else 0

    def length(self, row: int) -> int:
        """One past the last position whose feature is held."""
        if row not in self._rows:
            return 0
        first, values = self._rows[row]
        return first + int(values.shape[0])

    def write(self, row: int, start: int, features: torch.Tensor) -> None:
        """Features ``[m, F]`` of positions ``start .. start + m - 1`` of the row (what a forward fed
        from ``start``, the length its cache held); those held from ``start`` on are replaced. A
        forward that does not continue what is held (the first, after a filled cache) starts anew."""
        if row in self._rows:
            first, values = self._rows[row]
            if first <= start <= first + values.shape[0]:
                self._rows[row] = (first, torch.cat([values[: start - first], features]))
                return
        self._rows[row] = (start, features)

    def truncate(self, row: int, length: int) -> None:
        """Forget the row's features of positions ``length`` and after (a rollback)."""
        if row in self._rows:
            first, values = self._rows[row]
            self._rows[row] = (first, values[: max(length - first, 0)])

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """``[end - start, F]`` the features of positions ``start .. end - 1`` (all held)."""
        first, values = self._rows[row]
        return values[start - first : end - first]

    def release(self, row: int) -> None:
        """The row is done: its features go."""
        self._rows.pop(row, None)
