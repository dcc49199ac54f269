"""What a value the package keeps per model between calls was built from (`fingerprint`), and a store
that finds a value only while its model still is that (`PerModel`).

A chain keeps a few things per model object from one call to the next: the drafter's
restricted-vocabulary view (`hf_polybasic.models.vocab_head.drafting_view`), the probes' verdicts
(`hf_polybasic.runners.probe`), the static runner's pooled caches and compiled forwards
(`hf_polybasic.runners.static`), the recurrent layers found (`hf_polybasic.runners.recurrent`). Each
was built from the model as it was then: its weights' dtypes, devices and storage, its modules and
its attention implementation. Between two calls a user may change any of them in place
(``model.to(torch.bfloat16)``, ``model.set_attn_implementation("flex_attention")``,
``quantize_dynamic(model, inplace=True)``); such a value then no longer describes the model (a view
over fp32 rows of a bf16 model, a cache of the old dtype, a verdict for another attention), so it is
never found again: the next call builds it afresh.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


def fingerprint(model: torch.nn.Module) -> tuple:
    """What a value kept for ``model`` depends on: its attention implementation (the config's), its
    modules (by identity and class: an in-place quantization or packing replaces some) and each
    parameter's dtype and storage (``.to`` a dtype or a device and loading with ``assign=True`` give
    it a new one; loading values in place does not). A parameter on the meta device (accelerate's
    offloaded weights between forwards) has no storage: it counts by its dtype. One walk over the
    module tree (about 0.3 ms for a 24-layer model)."""
    found: list = [getattr(getattr(model, "config", None), "_attn_implementation", None)]
    stack = [model]
    while stack:
        module = stack.pop()
        found.append((id(module), type(module)))
        found.extend((parameter.dtype, _storage(parameter))
                     for parameter in module._parameters.values() if parameter is not None)
        stack.extend(child for child in module._modules.values() if child is not None)
    return tuple(found)


def _storage(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s values live (0 on the meta device); a tensor subclass without a single
    storage (a quantized weight of torchao's) counts by its identity."""
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


class PerModel:
    """Values kept per model object (weakly: a value goes with its model), each found only while the
    model's `fingerprint` is the one it was kept under; a stale one is dropped when it is looked up.
    Thread-safe; building a value (``make`` in `setdefault`) runs outside the lock."""

    def __init__(self):
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (fingerprint, value)
        self._lock = threading.Lock()

    def get(self, model: torch.nn.Module, default: Any = None) -> Any:
        """The value kept for ``model`` as it is now, else ``default``."""
        found = fingerprint(model)
        with self._lock:
            kept = self._kept.get(model)
            if kept is None:
                return default
            if kept[0] != found:
                del self._kept[model]
                return default
            return kept[1]

    def put(self, model: torch.nn.Module, value: Any) -> None:
        """Keep ``value`` for ``model`` as it is now (replacing what was kept)."""
        found = fingerprint(model)
        with self._lock:
            self._kept[model] = (found, value)

    def setdefault(self, model: torch.nn.Module, make: Callable[[], Any]) -> Any:
        """The value kept for ``model`` as it is now, else ``make()``, kept (a value another thread
        kept meanwhile wins)."""
        missing = object()
        value = self.get(model, missing)
        if value is not missing:
            return value
        made = make()
        found = fingerprint(model)
        with self._lock:
            kept = self._kept.get(model)
            if kept is not None and kept[0] == found:
                return kept[1]
            self._kept[model] = (found, made)
        return made

    def __contains__(self, model: torch.nn.Module) -> bool:
        missing = object()
        return self.get(model, missing) is not missing

    def __getitem__(self, model: torch.nn.Module) -> Any:
        missing = object()
        value = self.get(model, missing)
        if value is missing:
            raise KeyError(model)
        return value
