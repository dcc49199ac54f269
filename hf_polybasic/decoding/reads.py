"""What one read from the device carries: named pieces, packed into one buffer, read back once.

Where a read waits for the device (a GPU) each one stalls the host until the device's queue has run, so
a round reads once: a verifier's decisions for every row, the drafts a drafter left on the device for it
(`hf_polybasic.decoding.protocol.Deferred`), the rounds of an intermediate level decided on the device
(`hf_polybasic.decoding.device_blocks`). Each adds its pieces to one `HostRead` under names of its own and
finds them under the same names once read; nobody counts offsets.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch


class HostRead:
    """Named 1-D tensors to read back together (`read`), as float64: ids, counts and flags are exact
    as floats up to 2^53, probabilities keep their float32 values."""

    def __init__(self, pieces: Iterable[tuple[Hashable, torch.Tensor]] = ()):
        self._pieces: list[tuple[Hashable, torch.Tensor]] = []
        for name, values in pieces:
            self.add(name, values)

    def add(self, name: Hashable, values: torch.Tensor) -> None:
        """Read ``values`` (any shape, flattened; on any device) under ``name``."""
        self._pieces.append((name, values.reshape(-1)))

    def extend(self, pieces: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        for name, values in pieces:
            self.add(name, values)

    @property
    def pieces(self) -> list[tuple[Hashable, torch.Tensor]]:
        return list(self._pieces)

    def read(self) -> dict[Hashable, list[float]]:
        """Every piece on the host, in one read: ``{name: [values]}``."""
        if not self._pieces:
            return {}
        device = self._pieces[0][1].device
        flat = torch.cat([values.to(device=device, dtype=torch.float64) for _, values in self._pieces]).tolist()
        host, start = {}, 0
        for name, values in self._pieces:
            host[name] = flat[start : start + values.numel()]
            start += values.numel()
        return host
