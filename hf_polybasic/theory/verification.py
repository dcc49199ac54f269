"""One verification: how many tokens it emits when each draft is accepted with probability p.

The accepted drafts A of one verification of n drafts are a geometric variable truncated at n
(each draft accepted with probability p, independently, until the first rejection); the
acceptance length in our tau convention is A + 1. Also Leviathan et al.'s two-model formulas and
the paper's Theorem 3.3 as printed (which is wrong, see `acceptance_length_variance_as_printed`).
"""

from __future__ import annotations

import numpy as np

from .checks import ArrayLike, as_result, count, positive, probability


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
    p = probability("p", p)
    n_ = count("n", n, minimum=1)
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
    p = probability("p", p)
    n = count("n", n, minimum=1)
    mean, _ = _accepted_moments(p, n)
    return as_result(mean + 1 if include_bonus else mean)


def acceptance_length_variance(p: ArrayLike, n: ArrayLike) -> float | np.ndarray:
    """Variance of the acceptance length of one verification of n drafted tokens (cf. Theorem 3.3).

    The bonus token is a constant shift, so the variance is the same with or without it:

        Var[A] = (p - (2n + 1)(1 - p) p^(n+1) - p^(2n+2)) / (1 - p)^2     (0 at p = 1)

    Sanity checks that any formula for this variance must pass: it tends to 0 like p as p -> 0
    (Var = p + 2 p^2 + O(p^3) for n >= 2), equals p (1 - p) for n = 1 (a single Bernoulli draft),
    is 0 at p = 1, grows with n towards the untruncated geometric variance p / (1 - p)^2, and never
    exceeds n^2 / 4 (a variable confined to [0, n]).

    The paper's Theorem 3.3 prints another formula for this variance; it is wrong for every finite
    n and can even be negative (`acceptance_length_variance_as_printed`). This one is derived here
    from the truncated geometric distribution and checked against simulation. The value is
    computed by summing over the distribution (O(n) work per value) rather than from the closed
    form above, which loses all precision when 1 - p is tiny (the tests check the two agree elsewhere).

    Args:
        p: per-token acceptance probability in [0, 1].
        n: drafted tokens (K), integer >= 1. Broadcast with p.
    """
    p = probability("p", p)
    n = count("n", n, minimum=1)
    _, variance = _accepted_moments(p, n)
    return as_result(variance)


# --- Leviathan et al. 2023: two models ---------------------------------------------------------
def expected_tokens_per_verification(alpha: ArrayLike, gamma: ArrayLike) -> float | np.ndarray:
    """Leviathan et al. (2023): tokens one target forward emits, (1 - alpha^(gamma+1)) / (1 - alpha).

    The same quantity as `expected_acceptance_length` with the bonus token, except that gamma = 0
    (no drafts: plain decoding, exactly 1 token) is allowed.

    Args:
        alpha: per-token acceptance rate in [0, 1].
        gamma: draft length, integer >= 0.
    """
    alpha = probability("alpha", alpha)
    gamma = count("gamma", gamma, minimum=0)
    mean, _ = _accepted_moments(alpha, gamma)
    return as_result(mean + 1)


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
    alpha = probability("alpha", alpha)
    gamma = count("gamma", gamma, minimum=0)
    cost_ratio = positive("cost_ratio", cost_ratio)
    mean, _ = _accepted_moments(alpha, gamma)
    return as_result((mean + 1) / (gamma * cost_ratio + 1))


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
    alpha = probability("alpha", alpha)
    cost_ratio = positive("cost_ratio", cost_ratio)
    cap = int(count("max_draft_length", max_draft_length, minimum=1))
    alpha, cost_ratio = np.broadcast_arrays(alpha, cost_ratio)
    gammas = np.arange(cap + 1)
    # tokens per verification for every gamma at once: cumulative sums of alpha^k
    tokens = np.cumsum(alpha[..., None] ** gammas, axis=-1)
    factor = tokens / (gammas * cost_ratio[..., None] + 1)
    return as_result(np.argmax(factor, axis=-1))


# --- Theorem 3.3 as printed ----------------------------------------------------------------------
def acceptance_length_variance_as_printed(alpha: ArrayLike, n: ArrayLike) -> float | np.ndarray:
    """Theorem 3.3 exactly as printed in the paper; **not** the variance of the acceptance length.

    The paper states, for "acceptance probability p_i = 1 - alpha"::

        sigma^2 = (alpha [1 - (n^2 - 1) alpha^n] - (n^2 - 1) alpha^(n+1)) / (1 - alpha)^2

    Its proof defines N, "the acceptance length, allowing up to n tokens", by P(N = k) =
    p (1 - p)^(k-1) for k < n and P(N = n) = (1 - p)^(n-1), so the run goes on with probability
    1 - p = alpha: alpha is the per-token acceptance probability (the statement's "p_i = 1 - alpha"
    mislabels it) and N counts the tokens a verification emits with at most n - 1 drafts, our
    acceptance length with K = n - 1. Its variance is ``acceptance_length_variance(alpha, n - 1)``.

    What the printed formula gets wrong (``tests/test_theory.py`` checks each):

    * it simplifies to (alpha - 2 (n^2 - 1) alpha^(n+1)) / (1 - alpha)^2 and is **negative** for
      moderate alpha: n = 2, alpha = 0.5 gives -1.0, where N is 1 or 2 with P(N = 2) = 0.5 and the
      variance is 0.25;
    * the proof's E[N^2] is wrong too: for n = 1 (N = 1 always, E[N^2] = 1) it gives
      (1 - 2 alpha) / (1 - alpha)^2; E[N] = (1 - alpha^n) / (1 - alpha) is right;
    * only as n -> infinity does it reach the right value, alpha / (1 - alpha)^2 (the untruncated
      geometric variance);
    * the theorem's claim that the variance grows as acceptance falls does not hold near 0: the
      true variance tends to 0 with alpha (nothing is ever accepted, so every N is 1).

    Args:
        alpha: per-token acceptance probability in [0, 1).
        n: the largest acceptance length (drafts + 1), integer >= 1. Broadcast with alpha.
    """
    alpha = probability("alpha", alpha)
    n = count("n", n, minimum=1).astype(np.float64)
    if np.any(alpha >= 1):
        raise ValueError(f"alpha must be < 1 (the printed formula divides by (1 - alpha)^2), got {alpha!r}")
    squares = n**2 - 1
    return as_result((alpha * (1 - squares * alpha**n) - squares * alpha ** (n + 1)) / (1 - alpha) ** 2)
