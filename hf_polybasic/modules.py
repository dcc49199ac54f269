"""Replacing a model's submodules in place, one at a time (packing, int8 quantization)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replace_modules(model: torch.nn.Module, kind: type, convert: Callable[[torch.nn.Module], torch.nn.Module]) -> int:
    """Replace every submodule whose type is exactly ``kind`` (subclasses are left alone) by
    ``convert(module)``, in place, one at a time: each is converted and set before the next is
    read, so a caller can release the old one's memory inside ``convert``. Returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, convert(child))
                replaced += 1
    return replaced
