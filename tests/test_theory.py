"""`hf_polybasic.theory` against Monte Carlo simulation, and the places where the paper's statements
(as we have them) do not hold exactly.

Every simulation is seeded numpy. A simulated estimate must lie within Z standard errors of the
formula, the standard error coming from the sampling distribution itself: the exact moments of the
distribution under test for means and variances, the ratio-estimator (delta-method) error for times
per token. With Z = 5 a correct formula fails with probability below 1e-6 per check, so a failure
means the formula (or the simulation) is wrong, not bad luck. Goodness of fit uses a chi-square test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import leading_true, simulate_accepted, simulate_three_models
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from hf_polybasic.planning import theory
from hf_polybasic.stats import LevelStats, PolybasicStats
from hf_polybasic.decoding.acceptance import speculative_decision

Z = 5.0
CHI_SQUARE_ALPHA = 1e-4
QUICK = settings(max_examples=40, deadline=None, derandomize=True)
SIMULATED = settings(max_examples=25, deadline=None, derandomize=True)


# --- simulators (leading_true, simulate_accepted, simulate_three_models: helpers.py) ---------------
def simulate_speculative_sampling(rng, target: np.ndarray, proposal: np.ndarray, n: int, size: int) -> np.ndarray:
    """Accepted drafts when x ~ q is kept with probability min(1, p(x) / q(x)), the same p, q at every position."""
    drafts = rng.choice(len(proposal), size=(size, n), p=proposal)
    keep = rng.random((size, n)) * proposal[drafts] <= target[drafts]
    return leading_true(keep)


def simulate_two_models(rng, p: float, k: int, cycles: int) -> dict[str, np.ndarray]:
    """Per verification of M1: tokens emitted and forwards of M1 (1) and of the drafter (k)."""
    tokens = simulate_accepted(rng, p, k, cycles) + 1
    return {"tokens": tokens, "forwards": np.stack([np.ones(cycles), np.full(cycles, k)], axis=-1)}


def ratio_estimate(numerator: np.ndarray, denominator: np.ndarray) -> tuple[float, float]:
    """sum(numerator) / sum(denominator) over i.i.d. cycles and its delta-method standard error."""
    ratio = numerator.sum() / denominator.sum()
    residual = numerator - ratio * denominator
    se = np.sqrt((residual**2).sum() / (len(residual) * (len(residual) - 1))) / denominator.mean()
    return float(ratio), float(se)


def time_per_token(run: dict[str, np.ndarray], costs) -> tuple[float, float]:
    return ratio_estimate(run["forwards"] @ np.asarray(costs, dtype=float), run["tokens"])


def exact_moments(p: float, n: int) -> tuple[float, float, float]:
    """Mean, variance and fourth central moment of the accepted drafts, from the pmf."""
    pmf = theory.acceptance_length_distribution(p, n)
    k = np.arange(n + 1)
    mean = (k * pmf).sum()
    return mean, (((k - mean) ** 2) * pmf).sum(), (((k - mean) ** 4) * pmf).sum()


def variance_z_score(accepted: np.ndarray, p: float, n: int, variance: float) -> float:
    """(sample variance - variance) in standard errors of the sample variance (exact moments)."""
    _, exact_variance, fourth = exact_moments(p, n)
    size = len(accepted)
    # exact variance of the unbiased sample variance; the large-sample (mu4 - sigma^4) / N alone is
    # 0 for a fair coin (p = 0.5, n = 1), where the sample variance still varies at order 1/N^2
    se = np.sqrt((fourth - (size - 3) / (size - 1) * exact_variance**2) / size)
    return float((accepted.var(ddof=1) - variance) / se)


def assert_moments_match(accepted: np.ndarray, p: float, n: int) -> None:
    """Sample mean and variance within Z standard errors of `theory`'s mean and variance."""
    mean_se = np.sqrt(exact_moments(p, n)[1] / len(accepted))
    expected_mean = theory.expected_acceptance_length(p, n, include_bonus=False)
    assert abs(accepted.mean() - expected_mean) <= Z * mean_se, (accepted.mean(), expected_mean, mean_se)
    assert abs((accepted + 1).mean() - theory.expected_acceptance_length(p, n)) <= Z * mean_se
    assert abs(variance_z_score(accepted, p, n, theory.acceptance_length_variance(p, n))) <= Z


def chi_square_pvalue(accepted: np.ndarray, pmf: np.ndarray) -> float:
    """Goodness of fit of the counts 0 .. n; the tail is pooled until every bin expects >= 5."""
    counts = np.bincount(accepted, minlength=len(pmf)).astype(float)
    expected = pmf * len(accepted)
    while len(expected) > 2 and expected[-1] < 5:
        expected = np.append(expected[:-2], expected[-2:].sum())
        counts = np.append(counts[:-2], counts[-2:].sum())
    return float(chisquare(counts, expected).pvalue)


# --- one verification: distribution, mean, variance ---------------------------------------------------
@pytest.mark.parametrize("p, n", [(0.05, 6), (0.3, 1), (0.6, 4), (0.8, 8), (0.97, 12)])
def test_distribution_matches_simulation(p, n):
    accepted = simulate_accepted(np.random.default_rng(n), p, n, 20_000)
    assert chi_square_pvalue(accepted, theory.acceptance_length_distribution(p, n)) > CHI_SQUARE_ALPHA


@SIMULATED
@given(p=st.floats(0.01, 0.99), n=st.integers(1, 16))
def test_mean_and_variance_match_simulation(p, n):
    rng = np.random.default_rng([round(p * 1e9), n])
    assert_moments_match(simulate_accepted(rng, p, n, 20_000), p, n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_sampling_acceptance_is_truncated_geometric_with_alpha_one_minus_tv(seed):
    """The i.i.d. acceptance model holds for real speculative sampling with alpha = sum min(p, q)."""
    rng = np.random.default_rng(seed)
    target, proposal = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    alpha = float(np.minimum(target, proposal).sum())
    accepted = simulate_speculative_sampling(rng, target, proposal, 5, 20_000)
    assert chi_square_pvalue(accepted, theory.acceptance_length_distribution(alpha, 5)) > CHI_SQUARE_ALPHA
    assert_moments_match(accepted, alpha, 5)


def test_our_verification_rule_follows_the_theory():
    """`hf_polybasic.decoding.acceptance.speculative_decision` itself: mean acceptance length as predicted."""
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(1.5 * torch.randn(8, generator=generator), -1)
    proposal = torch.softmax(1.5 * torch.randn(8, generator=generator), -1)
    alpha = float(torch.minimum(target, proposal).sum())
    k, trials = 4, 2_000
    targets, proposals = target.expand(k + 1, -1), proposal.expand(k, -1)
    lengths = []
    for _ in range(trials):
        draft = torch.multinomial(proposal, k, replacement=True, generator=generator)
        num_accepted, _ = speculative_decision(draft, proposals, targets, generator).tolist()
        lengths.append(num_accepted + 1)
    se = np.sqrt(theory.acceptance_length_variance(alpha, k) / trials)
    assert abs(np.mean(lengths) - theory.expected_acceptance_length(alpha, k)) <= Z * se


@pytest.mark.parametrize(
    "name, wrong_variance",
    [
        ("untruncated geometric p / (1 - p)^2", lambda p, n: p / (1 - p) ** 2),
        ("cap off by one (n - 1 drafts)", lambda p, n: theory.acceptance_length_variance(p, n - 1)),
        ("cap off by one (n + 1 drafts)", lambda p, n: theory.acceptance_length_variance(p, n + 1)),
    ],
)
def test_the_simulation_check_rejects_plausible_wrong_variances(name, wrong_variance):
    """Negative controls: the check above has the power to reject a wrong formula. (A printed
    formula can be added here; at small p simulation cannot separate formulas that differ by
    O(p^n), so also compare it with `test_variance_at_the_edges_and_for_small_p`.)"""
    p, n = 0.8, 4
    accepted = simulate_accepted(np.random.default_rng(0), p, n, 20_000)
    assert abs(variance_z_score(accepted, p, n, theory.acceptance_length_variance(p, n))) <= Z
    assert abs(variance_z_score(accepted, p, n, wrong_variance(p, n))) > Z, name


def closed_form_variance(p: float, n: int) -> float:
    """The textbook closed form quoted in `acceptance_length_variance`'s docstring."""
    return (p - (2 * n + 1) * (1 - p) * p ** (n + 1) - p ** (2 * n + 2)) / (1 - p) ** 2


@QUICK
@given(p=st.floats(0.0, 0.99), n=st.integers(1, 64))
def test_closed_forms_equal_the_sums(p, n):
    assert theory.expected_acceptance_length(p, n) == pytest.approx((1 - p ** (n + 1)) / (1 - p), rel=1e-12)
    assert theory.expected_acceptance_length(p, n, include_bonus=False) == pytest.approx(
        p * (1 - p**n) / (1 - p), rel=1e-12, abs=1e-15
    )
    assert theory.acceptance_length_variance(p, n) == pytest.approx(closed_form_variance(p, n), rel=1e-9, abs=1e-15)


@QUICK
@given(p=st.floats(0.0, 1.0), n=st.integers(1, 40))
def test_variance_sanity_checks(p, n):
    """The properties `acceptance_length_variance` documents, which any variance formula must have."""
    variance = theory.acceptance_length_variance(p, n)
    assert 0 <= variance <= n**2 / 4 + 1e-12
    assert theory.acceptance_length_variance(p, n + 1) >= variance - 1e-12  # grows with the cap
    if p < 1:
        assert variance <= p / (1 - p) ** 2 + 1e-12  # below the untruncated geometric
    assert theory.acceptance_length_variance(p, 1) == pytest.approx(p * (1 - p), abs=1e-15)


def test_variance_at_the_edges_and_for_small_p():
    assert theory.acceptance_length_variance(0.0, 5) == 0
    assert theory.acceptance_length_variance(1.0, 5) == 0
    assert theory.expected_acceptance_length(1.0, 5) == 6
    assert theory.expected_acceptance_length(0.0, 5) == 1
    for p in (1e-2, 1e-3, 1e-4):  # Var = p + 2 p^2 + O(p^3) for n >= 2
        assert abs(theory.acceptance_length_variance(p, 6) - (p + 2 * p**2)) < 10 * p**3


def test_variance_is_accurate_where_the_closed_form_is_not():
    """Near p = 1 the closed form cancels catastrophically; the sum over the pmf does not."""
    q, n = 1e-9, 10
    # to first order in q, n - A takes each value j = 1 .. n with probability q
    first_order = q * sum(j**2 for j in range(1, n + 1))
    assert theory.acceptance_length_variance(1 - q, n) == pytest.approx(first_order, rel=1e-6)
    assert closed_form_variance(1 - q, n) != pytest.approx(first_order, rel=1e-2)


def test_vectorised_over_p_and_n():
    p = np.array([[0.2], [0.9]])
    n = np.array([1, 4, 8])
    means = theory.expected_acceptance_length(p, n)
    assert means.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert means[i, j] == pytest.approx(theory.expected_acceptance_length(float(p[i, 0]), int(n[j])))
            assert theory.acceptance_length_variance(p, n)[i, j] == pytest.approx(
                theory.acceptance_length_variance(float(p[i, 0]), int(n[j]))
            )
    assert theory.acceptance_length_distribution([0.2, 0.9], 3).shape == (2, 4)
    assert isinstance(theory.expected_acceptance_length(0.5, 3), float)


# --- Leviathan et al. 2023 -------------------------------------------------------------------------
def test_expected_tokens_per_verification_is_the_mean_with_bonus():
    assert theory.expected_tokens_per_verification(0.7, 0) == 1
    assert theory.expected_tokens_per_verification(0.7, 5) == pytest.approx(theory.expected_acceptance_length(0.7, 5))
    assert theory.improvement_factor(0.7, 0, 0.2) == 1


@pytest.mark.parametrize("alpha, gamma, cost_ratio", [(0.8, 1, 0.05), (0.8, 8, 0.05), (0.6, 3, 0.2), (0.9, 12, 0.02)])
def test_improvement_factor_matches_simulation(alpha, gamma, cost_ratio):
    run = simulate_two_models(np.random.default_rng(gamma), alpha, gamma, 20_000)
    seconds, se = time_per_token(run, [1.0, cost_ratio])
    speedup, speedup_se = 1 / seconds, se / seconds**2  # plain decoding costs 1 per token
    assert abs(speedup - theory.improvement_factor(alpha, gamma, cost_ratio)) <= Z * speedup_se


@QUICK
@given(alpha=st.floats(0.0, 0.99), cost_ratio=st.floats(0.001, 2.0))
def test_optimal_draft_length_is_the_argmax(alpha, cost_ratio):
    best = theory.optimal_draft_length(alpha, cost_ratio, max_draft_length=60)
    factors = [theory.improvement_factor(alpha, g, cost_ratio) for g in range(61)]
    assert factors[best] == pytest.approx(max(factors), rel=1e-12)


def test_optimal_draft_length_examples():
    assert theory.optimal_draft_length(0.8, 0.05) == 8
    assert theory.improvement_factor(0.8, 8, 0.05) == pytest.approx(3.0921, abs=1e-4)
    assert theory.optimal_draft_length(0.9, 0.3) == 5
    assert theory.optimal_draft_length(0.1, 0.5) == 0  # drafting does not pay
    assert theory.optimal_draft_length(1.0, 0.1, max_draft_length=32) == 32  # unbounded: the cap
    assert list(theory.optimal_draft_length([0.8, 0.9], [0.05, 0.3])) == [8, 5]


# --- Lemma 3.1 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, k, costs", [(0.7, 5, [1.0, 0.1]), (0.9, 8, [1.0, 0.03])])
def test_two_model_time_model_matches_simulation(p, k, costs):
    run = simulate_two_models(np.random.default_rng(k), p, k, 20_000)
    seconds, se = time_per_token(run, costs)
    predicted = theory.polybasic_time_per_token(costs, [theory.expected_acceptance_length(p, k)], beta=k)
    assert abs(seconds - predicted) <= Z * se
    total = theory.polybasic_time(1000, costs, [theory.expected_acceptance_length(p, k)], k)
    assert total == pytest.approx(1000 * predicted)


@QUICK
@given(alpha=st.floats(0.0, 1.0), gamma=st.integers(1, 20), cost_ratio=st.floats(0.001, 1.0))
def test_two_model_speedup_is_leviathans_improvement_factor(alpha, gamma, cost_ratio):
    tokens = theory.expected_tokens_per_verification(alpha, gamma)
    assert theory.polybasic_speedup([1.0, cost_ratio], [tokens], gamma) == pytest.approx(
        theory.improvement_factor(alpha, gamma, cost_ratio), rel=1e-12
    )


def test_lemma_is_exact_with_time_model_inputs():
    run = simulate_three_models(np.random.default_rng(0), 0.8, 0.7, 4, 8, 5_000)
    costs = np.array([1.0, 0.3, 0.02])
    tokens, forwards = run["tokens"].sum(), run["forwards"].sum(0)
    inputs = theory.TimeModelInputs.from_counts(tokens, forwards)
    assert inputs.beta == 4
    assert inputs.acceptance_lengths[0] == pytest.approx(run["tokens"].mean())  # the target's own mean
    assert theory.polybasic_time(tokens, costs, inputs.acceptance_lengths, inputs.beta) == pytest.approx(
        forwards @ costs, rel=1e-12
    )


def test_per_verification_lengths_undercount_intermediate_forwards():
    """Discrepancy in how L_i can be read: M2's mean acceptance length per verification (what
    `LevelStats.mean_acceptance_length` reports) in Lemma 3.1 predicts N / L_2 forwards of M2, but
    M2 also verifies tokens that M1 later rejects: it runs about twice as often here."""
    k, mu = 4, 8
    run = simulate_three_models(np.random.default_rng(1), 0.8, 0.7, k, mu, 20_000)
    # M2 emits `block` tokens per cycle over `rounds` verifications: per-verification mean L_2
    per_verification_l2 = run["block"].sum() / run["forwards"][:, 1].sum()
    # F_2 / (N / L_2) = tokens M2 emitted / tokens in the output: a ratio over i.i.d. cycles
    undercount, se = ratio_estimate(run["block"].astype(float), run["tokens"].astype(float))
    assert run["forwards"][:, 1].sum() == pytest.approx(undercount * run["tokens"].sum() / per_verification_l2)
    assert undercount - 1 > Z * se  # significantly more forwards than the per-verification reading says
    assert abs(undercount - 2.0) < 0.2  # the "about 2x" quoted in TimeModelInputs' docstring


def test_time_model_inputs_from_stats():
    levels = [LevelStats("M1", "target", forward_passes=50), LevelStats("M2", "intermediate", forward_passes=200),
              LevelStats("M3", "drafter", forward_passes=800)]
    inputs = theory.TimeModelInputs.from_stats(PolybasicStats(levels=levels, new_tokens=400))
    assert inputs.acceptance_lengths == (8.0, 2.0)
    assert inputs.beta == 4.0


# --- Theorem 3.2 -----------------------------------------------------------------------------------
@QUICK
@given(
    t=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0), st.floats(0.001, 1.0), st.floats(0.001, 1.0)),
    lengths=st.tuples(st.floats(1.0, 10.0), st.floats(1.0, 10.0), st.floats(1.0, 10.0), st.floats(1.0, 10.0)),
    beta=st.floats(0.0, 10.0),
)
def test_insertion_verdict_is_lemma_31_before_minus_after(t, lengths, beta):
    t_i, t_new, t_next, t_last = t
    l_i, l_i_new, l_new, l_last = lengths
    verdict = theory.insertion_test(
        t_i=t_i, t_new=t_new, t_next=t_next, l_i=l_i, l_i_new=l_i_new, l_new=l_new, beta=beta
    )
    before = theory.polybasic_time_per_token([t_i, t_next], [l_i], beta)
    after = theory.polybasic_time_per_token([t_i, t_new, t_next], [l_i_new, l_new], beta)
    assert verdict.time_saved_per_token == pytest.approx(before - after, rel=1e-9, abs=1e-12)
    assert verdict.helps == (verdict.time_saved_per_token > 0)
    if abs(verdict.new_cost_per_token - verdict.upper_saving_per_token) > 1e-9:
        assert verdict.condition_1 == (verdict.new_cost_per_token < verdict.upper_saving_per_token)
    if abs(verdict.new_cost_per_token - verdict.lower_saving_per_token) > 1e-9:
        assert verdict.condition_2 == (verdict.new_cost_per_token < verdict.lower_saving_per_token)
    # one level higher up a longer chain (M_{i+1} verifies M_last): only the upper saving counts
    higher = theory.insertion_test(
        t_i=t_i, t_new=t_new, t_next=t_next, l_i=l_i, l_i_new=l_i_new, l_new=l_new, beta=beta, next_is_drafter=False
    )
    before = theory.polybasic_time_per_token([t_i, t_next, t_last], [l_i, l_last], beta)
    after = theory.polybasic_time_per_token([t_i, t_new, t_next, t_last], [l_i_new, l_new, l_last], beta)
    assert higher.time_saved_per_token == pytest.approx(before - after, rel=1e-9, abs=1e-12)


def insert_by_simulation(p_before, p_top, p_mid, k, mu, costs, seed):
    """Simulate M1 > M3 and M1 > M2 > M3; the verdict from measured inputs and the simulated times."""
    t_top, t_mid, t_drafter = costs
    rng = np.random.default_rng(seed)
    before = simulate_two_models(rng, p_before, k, 20_000)
    after = simulate_three_models(rng, p_top, p_mid, k, mu, 20_000)
    measured_before = theory.TimeModelInputs.from_counts(before["tokens"].sum(), before["forwards"].sum(0))
    measured_after = theory.TimeModelInputs.from_counts(after["tokens"].sum(), after["forwards"].sum(0))
    verdict = theory.insertion_test(
        t_i=t_top, t_new=t_mid, t_next=t_drafter, l_i=measured_before.acceptance_lengths[0],
        l_i_new=measured_after.acceptance_lengths[0], l_new=measured_after.acceptance_lengths[1], beta=k,
    )
    seconds_before, se_before = time_per_token(before, [t_top, t_drafter])
    seconds_after, se_after = time_per_token(after, costs)
    return verdict, seconds_before - seconds_after, np.hypot(se_before, se_after)


def test_insertion_pays_although_neither_printed_condition_holds():
    """Discrepancy with Theorem 3.2 as stated ("helps iff condition 1 or condition 2"): the
    conditions are not necessary. Target accepts the drafter at 0.6; a middle model accepted by the
    target at 0.9 and accepting the drafter at 0.7, costing 0.4 target forwards, K = 8, mu = 1."""
    verdict, saved, se = insert_by_simulation(0.6, 0.9, 0.7, 8, 1, (1.0, 0.4, 0.05), seed=0)
    assert not verdict.condition_1 and not verdict.condition_2 and not verdict.paper_says_helps
    assert verdict.helps
    assert saved > Z * se  # the simulated chain really is faster with the middle model
    assert verdict.time_saved_per_token == pytest.approx(saved, rel=1e-9)


def test_printed_condition_holds_but_insertion_costs_time():
    """Nor are the conditions sufficient when a saving is negative: here the middle model accepts
    the drafter at 0.4, less than the target did (0.8), so the drafter's share grows."""
    verdict, saved, se = insert_by_simulation(0.8, 0.95, 0.4, 8, 4, (1.0, 0.05, 0.1), seed=1)
    assert verdict.condition_1 and verdict.paper_says_helps
    assert verdict.lower_saving_per_token < 0
    assert not verdict.helps
    assert -saved > Z * se  # the simulated chain really is slower with the middle model


# --- input validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: theory.expected_acceptance_length(1.2, 4), "p is a probability"),
        (lambda: theory.expected_acceptance_length(-0.1, 4), "p is a probability"),
        (lambda: theory.acceptance_length_variance(float("nan"), 4), "p must be finite"),
        (lambda: theory.acceptance_length_variance(0.5, 0), "n must be an integer >= 1"),
        (lambda: theory.acceptance_length_variance(0.5, 2.5), "n must be an integer >= 1"),
        (lambda: theory.expected_acceptance_length(0.5, True), "n must be an integer"),
        (lambda: theory.acceptance_length_distribution(0.5, [2, 3]), "n must be a single int"),
        (lambda: theory.expected_acceptance_length("0.5", 4), "p must be a number"),
        (lambda: theory.expected_tokens_per_verification(0.5, -1), "gamma must be an integer >= 0"),
        (lambda: theory.improvement_factor(0.5, 3, 0.0), "cost_ratio must be > 0"),
        (lambda: theory.optimal_draft_length(0.5, 0.1, max_draft_length=0), "max_draft_length"),
        (lambda: theory.polybasic_time(100, [1.0, 0.0], [2.0], 4), "costs must be > 0"),
        (lambda: theory.polybasic_time(0, [1.0, 0.1], [2.0], 4), "num_tokens must be > 0"),
        (lambda: theory.polybasic_time(100, [1.0, 0.1], [0.5], 4), "tau convention"),
        (lambda: theory.polybasic_time(100, [1.0, 0.1], [2.0, 2.0], 4), "one L_i per verifying model"),
        (lambda: theory.polybasic_time(100, [1.0], [], 4), "at least 2"),
        (lambda: theory.polybasic_speedup([1.0, 0.1], [2.0], -1), "beta must be >= 0"),
        (lambda: theory.TimeModelInputs.from_counts(100, [0, 10]), "F_i > 0"),
        (lambda: theory.insertion_test(t_i=1, t_new=-1, t_next=0.1, l_i=2, l_i_new=3, l_new=3, beta=4), "t_new"),
        (lambda: theory.insertion_test(t_i=1, t_new=0.2, t_next=0.1, l_i=0.0, l_i_new=3, l_new=3, beta=4), "l_i"),
        (lambda: theory.insertion_test(t_i=[1, 2], t_new=0.2, t_next=0.1, l_i=2, l_i_new=3, l_new=3, beta=4), "single"),
    ],
)
def test_invalid_inputs_are_rejected_with_a_clear_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()
