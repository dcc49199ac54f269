"""The paper's theory as plain functions: acceptance lengths, the time model, the insertion test.

Notation (Wang et al., ICML 2025, "Polybasic Speculative Decoding Through a Theoretical
Perspective", arXiv 2510.26527), for a chain M1 > M2 > ... > Mn (M1 the target, Mn the drafter):

* **T_i**: the cost of one forward pass of M_i (seconds, or any unit shared by all levels).
* **L_i**: the mean acceptance length of M_i's verifications, in our **tau convention** (see
  `hf_polybasic.stats`): accepted drafts **plus** the one token the verifier adds itself, so
  L_i >= 1. Only M1 .. M(n-1) verify, so there are n - 1 of them.
* **F_i**: forward passes of M_i. **N**: tokens generated.
* **beta**: forward passes of the drafter Mn per verification of M(n-1) (K for a model drafter
  that drafts K tokens one forward at a time).
* **p** (or Leviathan's **alpha**): the probability that the verifier accepts one drafted token,
  taken as the same for every position and independent of the others. Under speculative sampling
  with proposal q and target p it is alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q).
* **n** (Leviathan's **gamma**, our **K**): the number of drafted tokens, i.e. the cap on the
  accepted drafts of one verification; the acceptance length is then at most n + 1.

What could be checked against the paper (only its abstract and third-party summaries were
reachable when this module was written, not the paper's text):

* Lemma 3.1 (time model): its formula matches a third-party summary of the paper; see
  `polybasic_time`. It is exact when L_i is read as N / F_i, which for the intermediate levels is
  *not* the per-verification mean that `LevelStats.mean_acceptance_length` reports; see
  `TimeModelInputs`.
* Theorem 3.2 (insertion test): implemented from the statement given in our issue, not checked
  against the paper; see `insertion_test` for how the subscripts are read and what exactly holds.
* Theorem 3.3 (variance of the acceptance length): the printed formula was **not** available, so
  this module does not reproduce it. `acceptance_length_variance` is derived here from first
  principles (a truncated geometric distribution) and checked against simulation.
* Leviathan et al. (ICML 2023), expected tokens per verification and the walltime improvement
  factor: standard formulas, checked against simulation in ``tests/test_theory.py``.

Every function takes numbers or numpy arrays (broadcast together) and returns a Python scalar
for scalar inputs, an array otherwise. Invalid inputs raise `ValueError` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    from ..stats import PolybasicStats

ArrayLike = Union[float, int, np.ndarray, list, tuple]


# --- input checks ----------------------------------------------------------------------------------
def _floats(name: str, value: ArrayLike) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name} must be a number or an array of numbers, got {value!r}")
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return array


def _probability(name: str, value: ArrayLike) -> np.ndarray:
    array = _floats(name, value)
    if np.any((array < 0) | (array > 1)):
        raise ValueError(f"{name} is a probability and must lie in [0, 1], got {value!r}")
    return array


def _positive(name: str, value: ArrayLike) -> np.ndarray:
    array = _floats(name, value)
    if np.any(array <= 0):
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return array


def _nonnegative(name: str, value: ArrayLike) -> np.ndarray:
    array = _floats(name, value)
    if np.any(array < 0):
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return array


def _acceptance_length(name: str, value: ArrayLike) -> np.ndarray:
    array = _floats(name, value)
    if np.any(array < 1):
        raise ValueError(
            f"{name} is a mean acceptance length in the tau convention (accepted drafts + 1, so >= 1), "
            f"got {value!r}; if you have accepted drafts per verification, add 1"
        )
    return array


def _count(name: str, value: ArrayLike, minimum: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    array = array.astype(np.int64)
    if np.any(array < minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return array


def _scalar(name: str, value: float, check) -> float:
    """One number, passed through one of the checks above."""
    array = check(name, value)
    if array.ndim:
        raise ValueError(f"{name} must be a single number, got an array of shape {array.shape}")
    return float(array)


def _out(array: np.ndarray) -> float | int | np.ndarray:
    """A Python scalar for a 0-d result, the array otherwise."""
    array = np.asarray(array)
    return array.item() if array.ndim == 0 else array


# --- one verification: the truncated geometric acceptance length ---------------------------------
def _accepted_distribution(p: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k, pmf): pmf[..., k] = P(k drafts accepted), k = 0 .. max(n); zero beyond each n.

    P(A = k) = p^k (1 - p) for k < n, P(A = n) = p^n: acceptance runs until the first rejection
    or until the n drafts are used up.
    """
    p, n = np.broadcast_arrays(p, n)
    top = int(n.max()) if n.size else 0
    k = np.arange(top + 1)
    p_, n_ = p[..., None], n[..., None]
    powers = p_**k  # 0**0 == 1: with p = 0 nothing is accepted
    pmf = np.where(k < n_, powers * (1 - p_), np.where(k == n_, powers, 0.0))
    return k, pmf


def _accepted_moments(p: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of the accepted drafts, summed over the pmf (stable for p near 1)."""
    k, pmf = _accepted_distribution(p, n)
    mean = (k * pmf).sum(-1)
    variance = (((k - mean[..., None]) ** 2) * pmf).sum(-1)
    return mean, variance


def acceptance_length_distribution(p: ArrayLike, n: int) -> np.ndarray:
    """Distribution of the outcome of one verification of n drafted tokens (truncated geometric).

    Each draft is accepted with probability p, independently, until the first rejection; the
    accepted count A is a geometric variable truncated at n: P(A = k) = p^k (1 - p) for k < n and
    P(A = n) = p^n. The acceptance length in our tau convention is A + 1 (1 .. n + 1).

    Args:
        p: per-token acceptance probability, in [0, 1] (any shape).
        n: drafted tokens (K), an int >= 1.

    Returns:
        Array of shape ``p.shape + (n + 1,)``: entry k is P(A = k) = P(acceptance length = k + 1).
    """
    p = _probability("p", p)
    n_ = _count("n", n, minimum=1)
    if n_.ndim:
        raise ValueError(f"n must be a single int here (the length of the last axis), got {n!r}")
    return _accepted_distribution(p, n_)[1]


def expected_acceptance_length(p: ArrayLike, n: ArrayLike, *, include_bonus: bool = True) -> float | np.ndarray:
    """Mean acceptance length E[L] of one verification of n drafted tokens (truncated geometric).

    With the bonus token (our tau convention, and Leviathan et al.'s expected tokens per
    verification with gamma = n):

        E[A + 1] = (1 - p^(n+1)) / (1 - p)        (n + 1 at p = 1)

    without it (accepted drafts only): E[A] = p (1 - p^n) / (1 - p)  (n at p = 1).

    Args:
        p: per-token acceptance probability in [0, 1].
        n: drafted tokens (K), integer >= 1. Broadcast with p.
        include_bonus: count the verifier's own token (True, the default) or not.
    """
    p = _probability("p", p)
    n = _count("n", n, minimum=1)
    mean, _ = _accepted_moments(p, n)
    return _out(mean + 1 if include_bonus else mean)


def acceptance_length_variance(p: ArrayLike, n: ArrayLike) -> float | np.ndarray:
    """Variance of the acceptance length of one verification of n drafted tokens (cf. Theorem 3.3).

    The bonus token is a constant shift, so the variance is the same with or without it:

        Var[A] = (p - (2n + 1)(1 - p) p^(n+1) - p^(2n+2)) / (1 - p)^2     (0 at p = 1)

    Sanity checks that any formula for this variance must pass: it tends to 0 like p as p -> 0
    (Var = p + 2 p^2 + O(p^3) for n >= 2), equals p (1 - p) for n = 1 (a single Bernoulli draft),
    is 0 at p = 1, grows with n towards the untruncated geometric variance p / (1 - p)^2, and never
    exceeds n^2 / 4 (a variable confined to [0, n]).

    This is derived here, not copied from the paper: the printed statement of Theorem 3.3 could not
    be read when this was written, so it is not reproduced or compared. The value is computed by
    summing over the distribution (O(n) work per value) rather than from the closed form above,
    which loses all precision when 1 - p is tiny (the tests check the two agree elsewhere).

    Args:
        p: per-token acceptance probability in [0, 1].
        n: drafted tokens (K), integer >= 1. Broadcast with p.
    """
    p = _probability("p", p)
    n = _count("n", n, minimum=1)
    _, variance = _accepted_moments(p, n)
    return _out(variance)


# --- Leviathan et al. 2023: two models ---------------------------------------------------------
def expected_tokens_per_verification(alpha: ArrayLike, gamma: ArrayLike) -> float | np.ndarray:
    """Leviathan et al. (2023): tokens one target forward emits, (1 - alpha^(gamma+1)) / (1 - alpha).

    The same quantity as `expected_acceptance_length` with the bonus token, except that gamma = 0
    (no drafts: plain decoding, exactly 1 token) is allowed.

    Args:
        alpha: per-token acceptance rate in [0, 1].
        gamma: draft length, integer >= 0.
    """
    alpha = _probability("alpha", alpha)
    gamma = _count("gamma", gamma, minimum=0)
    mean, _ = _accepted_moments(alpha, gamma)
    return _out(mean + 1)


def improvement_factor(alpha: ArrayLike, gamma: ArrayLike, cost_ratio: ArrayLike) -> float | np.ndarray:
    """Leviathan et al. (2023): expected walltime speedup of speculative decoding over plain decoding.

        (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1)),   c = T_draft / T_target

    Assumes a verification costs one target forward whatever its length, the drafter runs gamma
    forwards per verification, and nothing else costs time. It is `polybasic_speedup` for a chain
    of two models with beta = gamma.

    Args:
        alpha: per-token acceptance rate in [0, 1].
        gamma: draft length, integer >= 0 (0 gives 1: plain decoding).
        cost_ratio: c = T_draft / T_target, > 0.
    """
    alpha = _probability("alpha", alpha)
    gamma = _count("gamma", gamma, minimum=0)
    cost_ratio = _positive("cost_ratio", cost_ratio)
    mean, _ = _accepted_moments(alpha, gamma)
    return _out((mean + 1) / (gamma * cost_ratio + 1))


def optimal_draft_length(alpha: ArrayLike, cost_ratio: ArrayLike, *, max_draft_length: int = 128) -> int | np.ndarray:
    """The draft length gamma in 0 .. max_draft_length that maximises `improvement_factor`.

    0 means drafting does not pay (roughly alpha <= c). Ties go to the shorter draft. The search
    is exhaustive over the range, so the answer is exact within it; at alpha = 1 (and c < 1) the
    factor grows without bound in gamma and the cap is returned.

    Args:
        alpha: per-token acceptance rate in [0, 1].
        cost_ratio: c = T_draft / T_target, > 0.
        max_draft_length: the largest gamma considered (int >= 1).

    Returns:
        An int (an int array for array inputs).
    """
    alpha = _probability("alpha", alpha)
    cost_ratio = _positive("cost_ratio", cost_ratio)
    cap = int(_count("max_draft_length", max_draft_length, minimum=1))
    alpha, cost_ratio = np.broadcast_arrays(alpha, cost_ratio)
    gammas = np.arange(cap + 1)
    # tokens per verification for every gamma at once: cumulative sums of alpha^k
    tokens = np.cumsum(alpha[..., None] ** gammas, axis=-1)
    factor = tokens / (gammas * cost_ratio[..., None] + 1)
    return _out(np.argmax(factor, axis=-1))


# --- Lemma 3.1: the time model of a chain ------------------------------------------------------
def _chain(costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike):
    costs = _positive("costs", costs)
    lengths = _acceptance_length("acceptance_lengths", acceptance_lengths)
    beta = _nonnegative("beta", beta)
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
    return _out(verifiers + drafter)


def polybasic_time(
    num_tokens: ArrayLike, costs: ArrayLike, acceptance_lengths: ArrayLike, beta: ArrayLike
) -> float | np.ndarray:
    """Lemma 3.1: time for a chain M1 > ... > Mn to generate N tokens.

        T = sum_{i=1}^{n-1} (N / L_i) T_i  +  beta (N / L_{n-1}) T_n

    Each verifying model M_i runs N / L_i forwards (one per verification, L_i tokens each) and the
    drafter runs beta forwards per verification of the model just above it. Read L_i as N / F_i,
    tokens of the final output per forward of M_i: that makes the lemma exact (see
    `TimeModelInputs`). The formula matches a third-party summary of the paper; the paper's own
    text was not checked.

    Args:
        num_tokens: N, tokens to generate (> 0).
        costs: T_1 .. T_n along the last axis (target first, drafter last), each > 0.
        acceptance_lengths: L_1 .. L_{n-1} along the last axis, each >= 1 (tau convention).
        beta: drafter forwards per verification of M_{n-1}, >= 0.
    """
    num_tokens = _positive("num_tokens", num_tokens)
    return _out(num_tokens * np.asarray(polybasic_time_per_token(costs, acceptance_lengths, beta)))


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
    return _out(costs[..., 0] / np.asarray(polybasic_time_per_token(costs, acceptance_lengths, beta)))


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
    """

    acceptance_lengths: tuple[float, ...]
    beta: float

    @classmethod
    def from_counts(cls, new_tokens: int, forward_passes: ArrayLike) -> TimeModelInputs:
        """From N and F_1 .. F_n (target first, drafter last).

        Args:
            new_tokens: N, tokens generated, > 0.
            forward_passes: F_1 .. F_n; every verifying model (all but the last) must have run.
        """
        tokens = float(_positive("new_tokens", new_tokens))
        passes = _nonnegative("forward_passes", forward_passes)
        if passes.ndim != 1 or passes.shape[0] < 2:
            raise ValueError(f"forward_passes needs one F_i per model, at least 2, got {forward_passes!r}")
        if np.any(passes[:-1] <= 0):
            raise ValueError(f"every verifying model (all but the drafter) needs F_i > 0, got {forward_passes!r}")
        lengths = tuple(float(tokens / f) for f in passes[:-1])
        return cls(acceptance_lengths=lengths, beta=float(passes[-1] / passes[-2]))

    @classmethod
    def from_stats(cls, stats: PolybasicStats) -> TimeModelInputs:
        """From the statistics of a `generate` call (``new_tokens`` and each level's F_i)."""
        return cls.from_counts(stats.new_tokens, [level.forward_passes for level in stats.levels])


# --- Theorem 3.2: does a middle model pay? ---------------------------------------------------------
@dataclass(frozen=True)
class InsertionVerdict:
    """Theorem 3.2 for inserting M_new between M_i and M_{i+1}, with the numbers behind it.

    All ``*_per_token`` values are time per generated token (the unit of the costs), from Lemma 3.1.

    Attributes:
        helps: the exact answer under Lemma 3.1: ``time_saved_per_token > 0``.
        condition_1: the paper's first condition, T_new / T_i < L_new (1 / L_i - 1 / L_{i-new});
            equivalent to ``new_cost_per_token < upper_saving_per_token``.
        condition_1_lhs, condition_1_rhs: its two sides.
        condition_2: the paper's second condition, T_new / T_{i+1} < beta (L_new / L_i - 1);
            equivalent to ``new_cost_per_token < beta T_{i+1} (1 / L_i - 1 / L_new)``.
        condition_2_lhs, condition_2_rhs: its two sides.
        new_cost_per_token: T_new / L_new, what running M_new costs.
        upper_saving_per_token: T_i (1 / L_i - 1 / L_{i-new}), saved at M_i because it now
            verifies M_new (longer acceptances) instead of M_{i+1}.
        lower_saving_per_token: beta T_{i+1} (1 / L_i - 1 / L_new) when M_{i+1} is the drafter
            (it now drafts for M_new), else 0: a model that still verifies the same level below
            costs the same.
        time_saved_per_token: upper + lower saving - new cost; > 0 means the insertion pays.
    """

    helps: bool
    condition_1: bool
    condition_1_lhs: float
    condition_1_rhs: float
    condition_2: bool
    condition_2_lhs: float
    condition_2_rhs: float
    new_cost_per_token: float
    upper_saving_per_token: float
    lower_saving_per_token: float
    time_saved_per_token: float

    @property
    def paper_says_helps(self) -> bool:
        """The theorem as stated in our issue: condition 1 or condition 2."""
        return self.condition_1 or self.condition_2


def insertion_test(
    *,
    t_i: float,
    t_new: float,
    t_next: float,
    l_i: float,
    l_i_new: float,
    l_new: float,
    beta: float,
    next_is_drafter: bool = True,
) -> InsertionVerdict:
    """Theorem 3.2: does inserting M_new between M_i and M_{i+1} shorten generation?

    How the subscripts are read (the statement was taken from our issue, not checked against the
    paper's text):

    | argument  | paper       | meaning                                                      |
    |-----------|-------------|--------------------------------------------------------------|
    | `t_i`     | T_i         | cost of one forward of M_i, the model above the insertion    |
    | `t_new`   | T_new       | cost of one forward of M_new                                  |
    | `t_next`  | T_{i+1}     | cost of one forward of M_{i+1}, the model below              |
    | `l_i`     | L_i         | acceptance length of M_i verifying M_{i+1}, before insertion |
    | `l_i_new` | L_{i-new}   | acceptance length of M_i verifying M_new, after insertion    |
    | `l_new`   | L_new = L_{new-(i+1)} | acceptance length of M_new verifying M_{i+1}       |
    | `beta`    | beta        | drafter forwards per verification of the model above it      |

    Acceptance lengths are in the tau convention; any positive value is accepted, since the N / F
    reading below falls under 1 for a middle level that runs more forwards than tokens reach the
    output (its per-verification mean is still >= 1). Measured values should be read as in
    `TimeModelInputs` (N / F).

    What holds exactly (subtracting Lemma 3.1 before and after; only M_i's term, the new term and,
    if M_{i+1} is the drafter, the drafter's term change):

        insertion helps  <=>  T_new / L_new  <  T_i (1/L_i - 1/L_{i-new}) + [beta T_{i+1} (1/L_i - 1/L_new)]

    The paper's condition 1 asks the first saving alone to cover T_new / L_new, condition 2 the
    second alone. So "condition 1 or condition 2" is sufficient when both savings are >= 0, but it
    is not necessary (both can fail while their sum pays), and when one saving is negative (e.g.
    M_new accepts fewer of the drafter's tokens than M_i did) one condition can hold while the
    insertion costs time. ``helps`` is the exact answer; both printed conditions are reported too.
    Condition 2 is only meaningful when M_{i+1} is the drafter; it is computed as printed either way.

    Args:
        t_i: T_i, forward cost of M_i, > 0.
        t_new: T_new, forward cost of M_new, > 0.
        t_next: T_{i+1}, forward cost of M_{i+1}, > 0.
        l_i: L_i, > 0.
        l_i_new: L_{i-new}, > 0.
        l_new: L_new, > 0.
        beta: drafter forwards per verification of the model above it, >= 0.
        next_is_drafter: whether M_{i+1} is the bottom model Mn (the case of a three-model chain
            built from a two-model one).
    """
    t_i, t_new = _scalar("t_i", t_i, _positive), _scalar("t_new", t_new, _positive)
    t_next = _scalar("t_next", t_next, _positive)
    l_i, l_i_new = _scalar("l_i", l_i, _positive), _scalar("l_i_new", l_i_new, _positive)
    l_new, beta = _scalar("l_new", l_new, _positive), _scalar("beta", beta, _nonnegative)

    condition_1_lhs, condition_1_rhs = t_new / t_i, l_new * (1 / l_i - 1 / l_i_new)
    condition_2_lhs, condition_2_rhs = t_new / t_next, beta * (l_new / l_i - 1)
    new_cost = t_new / l_new
    upper_saving = t_i * (1 / l_i - 1 / l_i_new)
    lower_saving = beta * t_next * (1 / l_i - 1 / l_new) if next_is_drafter else 0.0
    saved = upper_saving + lower_saving - new_cost
    return InsertionVerdict(
        helps=bool(saved > 0),
        condition_1=bool(condition_1_lhs < condition_1_rhs),
        condition_1_lhs=condition_1_lhs,
        condition_1_rhs=condition_1_rhs,
        condition_2=bool(condition_2_lhs < condition_2_rhs),
        condition_2_lhs=condition_2_lhs,
        condition_2_rhs=condition_2_rhs,
        new_cost_per_token=new_cost,
        upper_saving_per_token=upper_saving,
        lower_saving_per_token=lower_saving,
        time_saved_per_token=saved,
    )
