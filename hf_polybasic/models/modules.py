"""Replacing a model's submodules in place, one at a time (packing, int8 quantization), and views of
a module that share its submodules but not its tables (early exits, restricted output layers, the
few-row products of `hf_polybasic.models.few_rows`)."""

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


def view_replacing(module: torch.nn.Module, kind: type, convert: Callable[[torch.nn.Module], torch.nn.Module],
                   chosen: Callable[[torch.nn.Module], bool] = lambda _: True) -> torch.nn.Module:
    """A `module_view` of ``module`` in which every submodule whose type is exactly ``kind`` and that
    ``chosen`` accepts is ``convert(submodule)``, and every module on the way to one is a view too;
    subtrees without one are shared, and ``module``'s own tree is left as it was. ``module`` itself
    when nothing is replaced."""
    replaced = {}
    for name, child in module.named_children():
        if type(child) is kind and chosen(child):
            replaced[name] = convert(child)
        else:
            inner = view_replacing(child, kind, convert, chosen)
            if inner is not child:
                replaced[name] = inner
    if not replaced:
        return module
    view = module_view(module)
    for name, new in replaced.items():
        view._modules[name] = new
    return view
