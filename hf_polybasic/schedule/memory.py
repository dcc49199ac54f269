"""What one call learned about a group of models, for the next call of the same group.

A value is kept under a tuple of models, each held weakly: it is found only by the same models (by
identity, in the same order, as many) and goes when the first of them is collected. One lock guards
it, so calls in threads may share it.
"""

from __future__ import annotations

import threading
import weakref


class ModelMemory:
    """Values keyed by a tuple of models (`get`, `put`), each model weakly held."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_first: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first -> [(refs of the rest, value)]

    def get(self, models: tuple):
        """The value last put under ``models``, else None."""
        first, *rest = models
        with self._lock:
            for refs, value in self._by_first.get(first, ()):
                if len(refs) == len(rest) and all(ref() is model for ref, model in zip(refs, rest)):
                    return value
        return None

    def put(self, models: tuple, value) -> None:
        """Keep ``value`` under ``models`` (replacing what was there; entries whose models are gone are dropped)."""
        first, *rest = models
        with self._lock:
            kept = [(refs, old) for refs, old in self._by_first.get(first, ())
                    if all(ref() is not None for ref in refs)
                    and not (len(refs) == len(rest) and all(ref() is model for ref, model in zip(refs, rest)))]
            self._by_first[first] = [*kept, ([weakref.ref(model) for model in rest], value)]
