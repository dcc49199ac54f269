"""Input checks shared by the theory functions: numbers or numpy arrays, each argument named in errors."""

from __future__ import annotations

from typing import Union

import numpy as np

ArrayLike = Union[float, int, np.ndarray, list, tuple]


def floats(name: str, value: ArrayLike) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name} must be a number or an array of numbers, got {value!r}")
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return array


def probability(name: str, value: ArrayLike) -> np.ndarray:
    array = floats(name, value)
    if np.any((array < 0) | (array > 1)):
        raise ValueError(f"{name} is a probability and must lie in [0, 1], got {value!r}")
    return array


def positive(name: str, value: ArrayLike) -> np.ndarray:
    array = floats(name, value)
    if np.any(array <= 0):
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return array


def nonnegative(name: str, value: ArrayLike) -> np.ndarray:
    array = floats(name, value)
    if np.any(array < 0):
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return array


def acceptance_length(name: str, value: ArrayLike) -> np.ndarray:
    array = floats(name, value)
    if np.any(array < 1):
        raise ValueError(
            f"{name} is a mean acceptance length in the tau convention (accepted drafts + 1, so >= 1), "
            f"got {value!r}; if you have accepted drafts per verification, add 1"
        )
    return array


def count(name: str, value: ArrayLike, minimum: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    array = array.astype(np.int64)
    if np.any(array < minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return array


def scalar(name: str, value: float, check) -> float:
    """One number, passed through one of the checks above."""
    array = check(name, value)
    if array.ndim:
        raise ValueError(f"{name} must be a single number, got an array of shape {array.shape}")
    return float(array)


def as_result(array: np.ndarray) -> float | int | np.ndarray:
    """A Python scalar for a 0-d result, the array otherwise."""
    array = np.asarray(array)
    return array.item() if array.ndim == 0 else array
