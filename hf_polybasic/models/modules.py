"""Replacing a model's submodules in place, one at a time (packing, int8 quantization), and views of
a module that share its submodules but not its tables (early exits, restricted output layers)."""

from __future__ import annotations

import copy
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


def module_view(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object over the same submodules and tensors, with registries of its own: hooks
    later registered on ``module`` (e.g. a forward counter on the target) do not fire for the view."""
    view = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, dict):
            # submodule, parameter and buffer tables are copied (same objects inside); hook tables start empty
            setattr(view, name, type(value)() if "hook" in name else type(value)(value))
        elif isinstance(value, set):
            setattr(view, name, set(value))
    return view
