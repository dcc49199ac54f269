"""Lemma 3.1, the time model of a chain: as printed (one cost per model) and with cost curves T_i(k).

Notation: T_i the cost of a forward of M_i (the paper's), T_i(k) that cost when it scores k new
tokens (measured, `hf_polybasic.costs`), L_i acceptance lengths (tau convention, or N / F_i),
b_i the mean drafts per verification of M_i, beta the drafter's forwards per verification of the
model above it, N the tokens generated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from ..costs.curve import interpolate_cost
from .checks import ArrayLike, acceptance_length, as_result, nonnegative, positive, scalar

if TYPE_CHECKING:
    from ..stats import PolybasicStats


def _chain(costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike):
    costs = positive("costs", costs)
    lengths = acceptance_length("acceptance_lengths", acceptance_lengths)
    beta = nonnegative("beta", beta)
    if costs.ndim == 0 or costs.shape[-1] < 2:
        raise ValueError(f"costs needs one T_i per model of the chain, at least 2 (target and drafter), got {costs!r}")
    if lengths.ndim == 0 or lengths.shape[-1] != costs.shape[-1] - 1:
        raise ValueError(
            f"acceptance_lengths needs one L_i per verifying model (n - 1 = {costs.shape[-1] - 1} for "
            f"{costs.shape[-1]} costs), got {acceptance_lengths!r}"
        )
    return costs, lengths, beta


def polybasic_time_per_token(costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike) -> float | np.ndarray:
    """Lemma 3.1 divided by N: sum_{i<n} T_i / L_i + beta T_n / L_{n-1}.

    Args:
        costs: T_1 .. T_n along the last axis (target first, drafter last), each > 0.
        acceptance_lengths: L_1 .. L_{n-1} along the last axis, each >= 1 (tau convention).
        beta: drafter forwards per verification of M_{n-1}, >= 0.
    """
    costs, lengths, beta = _chain(costs, acceptance_lengths, beta)
    verifiers = (costs[..., :-1] / lengths).sum(-1)
    drafter = beta * costs[..., -1] / lengths[..., -1]
    return as_result(verifiers + drafter)


def polybasic_time(
    num_tokens: ArrayLike, costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike
) -> float | np.ndarray:
    """Lemma 3.1: time for a chain M1 > ... > Mn to generate N tokens.

        T = sum_{i=1}^{n-1} (N / L_i) T_i  +  beta (N / L_{n-1}) T_n

    Each verifying model M_i runs N / L_i forwards (one per verification, L_i tokens each) and the
    drafter runs beta forwards per verification of the model just above it. Read L_i as N / F_i,
    tokens of the final output per forward of M_i: that makes the lemma exact (see
    `TimeModelInputs`). This is the paper's Equation (3) as printed; it charges every forward of
    M_i the same T_i, however many tokens it scores (`polybasic_time_with_curves` does not).

    Args:
        num_tokens: N, tokens to generate (> 0).
        costs: T_1 .. T_n along the last axis (target first, drafter last), each > 0.
        acceptance_lengths: L_1 .. L_{n-1} along the last axis, each >= 1 (tau convention).
        beta: drafter forwards per verification of M_{n-1}, >= 0.
    """
    num_tokens = positive("num_tokens", num_tokens)
    return as_result(num_tokens * np.asarray(polybasic_time_per_token(costs, acceptance_lengths, beta)))


def polybasic_speedup(costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike) -> float | np.ndarray:
    """Speedup Lemma 3.1 predicts over plain decoding with the target alone: N T_1 / T.

    N cancels. For two models with beta = gamma and L_1 = `expected_tokens_per_verification` this
    is Leviathan et al.'s `improvement_factor`.

    Args:
        costs: T_1 .. T_n along the last axis (target first, drafter last), each > 0.
        acceptance_lengths: L_1 .. L_{n-1} along the last axis, each >= 1 (tau convention).
        beta: drafter forwards per verification of M_{n-1}, >= 0.
    """
    costs, _, _ = _chain(costs, acceptance_lengths, beta)
    return as_result(costs[..., 0] / np.asarray(polybasic_time_per_token(costs, acceptance_lengths, beta)))


@dataclass(frozen=True)
class TimeModelInputs:
    """The L_i and beta that make Lemma 3.1 exact for a run: L_i = N / F_i, beta = F_n / F_{n-1}.

    With these, `polybasic_time(N, costs, acceptance_lengths, beta)` equals sum_i F_i T_i exactly.

    For the target, N / F_1 is its mean acceptance length (up to the last, cut-short block). For an
    intermediate level it is **not** `LevelStats.mean_acceptance_length`: part of what an
    intermediate level verifies is later rejected by the levels above and never reaches the output
    (yet it cost forwards), while the tokens the levels above add themselves reach the output
    without it. Feeding the per-verification means into Lemma 3.1 mispredicts the forwards of every
    level below the target; with acceptance rates 0.8 (M1) and 0.7 (M2), K = 4 and mu = 8, M2 runs
    about twice as often as N / L_2 says (``tests/test_theory.py`` simulates it).

    Attributes:
        acceptance_lengths: L_1 .. L_{n-1}, tokens of the final output per forward of each
            verifying model.
        beta: drafter forwards per forward of the model above it.
        blocks: b_1 .. b_{n-1}, the mean drafts each verifying model received per verification
            (what `polybasic_time_with_curves` charges T_i(b_i + 1) for); empty when unknown.
    """

    acceptance_lengths: tuple[float, ...]
    beta: float
    blocks: tuple[float, ...] = ()

    @classmethod
    def from_counts(cls, new_tokens: int, forward_passes: ArrayLike) -> TimeModelInputs:
        """From N and F_1 .. F_n (target first, drafter last).

        Args:
            new_tokens: N, tokens generated, > 0.
            forward_passes: F_1 .. F_n; every verifying model (all but the last) must have run.
        """
        tokens = float(positive("new_tokens", new_tokens))
        passes = nonnegative("forward_passes", forward_passes)
        if passes.ndim != 1 or passes.shape[0] < 2:
            raise ValueError(f"forward_passes needs one F_i per model, at least 2, got {forward_passes!r}")
        if np.any(passes[:-1] <= 0):
            raise ValueError(f"every verifying model (all but the drafter) needs F_i > 0, got {forward_passes!r}")
        lengths = tuple(float(tokens / f) for f in passes[:-1])
        return cls(acceptance_lengths=lengths, beta=float(passes[-1] / passes[-2]))

    @classmethod
    def from_stats(cls, stats: PolybasicStats) -> TimeModelInputs:
        """From the statistics of a `generate` call (``new_tokens``, each level's F_i, and the
        mean drafts per verification of each verifying level)."""
        counted = cls.from_counts(stats.new_tokens, [level.forward_passes for level in stats.levels])
        blocks = tuple(level.drafted / level.verifications if level.verifications else 0.0 for level in stats.levels[:-1])
        return cls(counted.acceptance_lengths, counted.beta, blocks)


# --- Lemma 3.1 with cost curves ---------------------------------------------------------------------
CostCurveLike = Union[Callable[[float], float], Mapping[int, float], float, int]


def cost_curve(name: str, value: CostCurveLike) -> Callable[[float], float]:
    """T(k) as a function: a callable as is, ``{k: seconds}`` points interpolated
    (`hf_polybasic.costs.interpolate_cost`), or one number for a constant (the paper's T_i)."""
    if callable(value):
        return value
    if isinstance(value, Mapping):
        if not value or any(int(k) < 1 or not float(v) > 0 for k, v in value.items()):
            raise ValueError(f"{name} must map tokens k >= 1 to seconds > 0, got {value!r}")
        points = {int(k): float(v) for k, v in value.items()}
        return lambda k: interpolate_cost(points, k)
    constant = scalar(name, value, positive)
    return lambda k: constant


def polybasic_time_per_token_with_curves(
    curves: Sequence[CostCurveLike], acceptance_lengths: Sequence[float], blocks: Sequence[float], beta: float
) -> float:
    """Lemma 3.1 with forward costs that depend on the tokens scored, per generated token:

        sum_{i<n} T_i(b_i + 1) / L_i  +  beta T_n(1) / L_{n-1}

    A verification of M_i scores its b_i drafts plus one token, so it costs T_i(b_i + 1), not a
    constant T_i; the drafter scores one token per forward. Constant curves give
    `polybasic_time_per_token` (the paper's form). With L_i = N / F_i and b_i the mean drafts per
    verification (`TimeModelInputs.from_stats`) this is exact whenever each T_i is affine in k over
    the block sizes that occur (by Jensen's inequality, a convex T_i makes it a lower bound).

    Args:
        curves: T_1 .. T_n, target first: callables k -> seconds, ``{k: seconds}`` or numbers.
        acceptance_lengths: L_1 .. L_{n-1}, each > 0 (N / F_i for measured runs).
        blocks: b_1 .. b_{n-1}, mean drafts per verification of each verifying model, each >= 0.
        beta: drafter forwards per verification of M_{n-1}, >= 0.
    """
    if len(curves) < 2:
        raise ValueError(f"curves needs one T_i per model of the chain, at least 2, got {len(curves)}")
    functions = [cost_curve(f"curves[{i}]", c) for i, c in enumerate(curves)]
    lengths = [scalar(f"acceptance_lengths[{i}]", x, positive) for i, x in enumerate(acceptance_lengths)]
    drafts = [scalar(f"blocks[{i}]", x, nonnegative) for i, x in enumerate(blocks)]
    if len(lengths) != len(functions) - 1 or len(drafts) != len(functions) - 1:
        raise ValueError(
            f"acceptance_lengths and blocks need one value per verifying model ({len(functions) - 1}), "
            f"got {len(lengths)} and {len(drafts)}"
        )
    beta = scalar("beta", beta, nonnegative)
    verifiers = sum(f(b + 1) / length for f, b, length in zip(functions[:-1], drafts, lengths))
    return float(verifiers + beta * functions[-1](1) / lengths[-1])


def polybasic_time_with_curves(
    num_tokens: float, curves: Sequence[CostCurveLike], acceptance_lengths: Sequence[float], blocks: Sequence[float],
    beta: float,
) -> float:
    """`polybasic_time_per_token_with_curves` times N: the time to generate N tokens."""
    return scalar("num_tokens", num_tokens, positive) * polybasic_time_per_token_with_curves(
        curves, acceptance_lengths, blocks, beta
    )


def polybasic_speedup_with_curves(
    curves: Sequence[CostCurveLike], acceptance_lengths: Sequence[float], blocks: Sequence[float], beta: float
) -> float:
    """Speedup over plain decoding, which costs T_1(1) per token."""
    return cost_curve("curves[0]", curves[0])(1) / polybasic_time_per_token_with_curves(
        curves, acceptance_lengths, blocks, beta
    )
