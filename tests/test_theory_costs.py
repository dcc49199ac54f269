"""The theory with cost curves T_i(k), checked against simulation, and Theorem 3.3 as printed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import simulate_accepted, simulate_three_models

from hf_polybasic.planning import theory
from hf_polybasic.stats import LevelStats, PolybasicStats


# --- Theorem 3.3 as printed --------------------------------------------------------------------------
def test_the_printed_variance_is_negative_in_the_worked_example():
    """n = 2, alpha = 0.5: N is 1 or 2, each with probability 0.5, so Var(N) = 0.25; printed: -1."""
    assert theory.acceptance_length_variance_as_printed(0.5, 2) == pytest.approx(-1.0)
    assert theory.acceptance_length_variance(0.5, 1) == pytest.approx(0.25)
    rng = np.random.default_rng(0)
    emitted = simulate_accepted(rng, 0.5, 1, 200_000) + 1
    assert emitted.var() == pytest.approx(0.25, abs=0.005)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])  # (at alpha = 0.05 the two agree to 1e-3 from n = 5 on)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_printed_formula_is_what_is_printed_and_differs_from_the_variance(alpha, n):
    printed = theory.acceptance_length_variance_as_printed(alpha, n)
    simplified = (alpha - 2 * (n**2 - 1) * alpha ** (n + 1)) / (1 - alpha) ** 2
    assert printed == pytest.approx(simplified)
    right = theory.acceptance_length_variance(alpha, n - 1) if n > 1 else 0.0
    rng = np.random.default_rng(n)
    sampled = (simulate_accepted(rng, alpha, n - 1, 100_000) + 1).var() if n > 1 else 0.0
    assert sampled == pytest.approx(right, abs=0.01 + 0.02 * right)  # the simulation agrees with ours
    assert printed != pytest.approx(right, rel=1e-3)  # and not with the printed formula


def test_the_printed_formula_is_far_off_for_short_blocks():
    """Where the truncation matters (n small, alpha not small), the printed value is off by far more
    than sampling error: e.g. n = 3, alpha = 0.6 (two drafts)."""
    printed, right = theory.acceptance_length_variance_as_printed(0.6, 3), theory.acceptance_length_variance(0.6, 2)
    sampled = (simulate_accepted(np.random.default_rng(3), 0.6, 2, 100_000) + 1).var()
    assert sampled == pytest.approx(right, abs=0.01)
    assert abs(printed - right) > 1.0


def test_printed_formula_reaches_the_untruncated_variance_only_as_n_grows():
    alpha = 0.3
    untruncated = alpha / (1 - alpha) ** 2
    assert theory.acceptance_length_variance_as_printed(alpha, 60) == pytest.approx(untruncated)
    assert theory.acceptance_length_variance(alpha, 59) == pytest.approx(untruncated)


def test_variance_does_not_grow_as_acceptance_falls_to_zero():
    """Theorem 3.3's reading ("variance grows with smaller acceptance") fails near zero acceptance."""
    variances = [theory.acceptance_length_variance(alpha, 4) for alpha in (0.01, 0.1, 0.3)]
    assert variances == sorted(variances)  # rises with alpha here


def test_printed_formula_refuses_alpha_one():
    with pytest.raises(ValueError, match="alpha must be < 1"):
        theory.acceptance_length_variance_as_printed(1.0, 3)


# --- Lemma 3.1 with cost curves ----------------------------------------------------------------------
def test_constant_curves_give_the_printed_lemma():
    costs, lengths, beta = [1.0, 0.4, 0.05], [3.2, 2.1], 4.0
    printed = theory.polybasic_time_per_token(costs, lengths, beta)
    assert theory.polybasic_time_per_token_with_curves(costs, lengths, [6.0, 3.0], beta) == pytest.approx(printed)
    points = [{1: c, 16: c} for c in costs]
    assert theory.polybasic_time_per_token_with_curves(points, lengths, [6.0, 3.0], beta) == pytest.approx(printed)


def _simulated_seconds(run, k, curves):
    """Total simulated time of a three-model run whose forwards cost T_i(tokens scored)."""
    target, mid, draft = curves
    block, rounds = run["block"], run["forwards"][:, 1]
    # M1 scores the block + 1 per verification; M2 scores k + 1 per round; M3 one token per forward
    return float(sum(target(b + 1) for b in block) + rounds.sum() * mid(k + 1) + run["forwards"][:, 2].sum() * draft(1))


def _inputs(run, k):
    tokens = run["tokens"].sum()
    forwards = run["forwards"].sum(0)
    lengths = [tokens / forwards[0], tokens / forwards[1]]
    blocks = [run["block"].mean(), float(k)]
    return tokens, lengths, blocks, forwards[2] / forwards[1]


def test_lemma_with_curves_is_exact_for_affine_curves_on_a_simulated_chain():
    curves = (lambda k: 0.1 + 0.03 * k, lambda k: 0.02 + 0.01 * k, lambda k: 0.004)
    k = 3
    run = simulate_three_models(np.random.default_rng(1), p_top=0.8, p_mid=0.7, k=k, mu=6, cycles=4000)
    tokens, lengths, blocks, beta = _inputs(run, k)
    predicted = theory.polybasic_time_with_curves(tokens, curves, lengths, blocks, beta)
    assert predicted == pytest.approx(_simulated_seconds(run, k, curves), rel=1e-9)
    # the printed lemma with one cost per model (T_i(1)) underestimates such a chain badly
    printed = theory.polybasic_time(tokens, [c(1) for c in curves], lengths, beta)
    assert printed < 0.8 * predicted


def test_lemma_with_curves_is_a_close_lower_bound_for_convex_curves():
    curves = (lambda k: 0.1 + 0.004 * k**2, lambda k: 0.02 + 0.01 * k, lambda k: 0.004)
    k = 3
    run = simulate_three_models(np.random.default_rng(2), p_top=0.8, p_mid=0.7, k=k, mu=6, cycles=4000)
    tokens, lengths, blocks, beta = _inputs(run, k)
    predicted = theory.polybasic_time_with_curves(tokens, curves, lengths, blocks, beta)
    simulated = _simulated_seconds(run, k, curves)
    assert predicted <= simulated and predicted == pytest.approx(simulated, rel=0.05)


def test_time_model_inputs_read_blocks_from_stats():
    levels = [
        LevelStats("M1", "target", forward_passes=10, verifications=10, drafted=60, accepted=30),
        LevelStats("M2", "intermediate", forward_passes=25, verifications=25, drafted=75, accepted=40),
        LevelStats("M3", "drafter", forward_passes=75),
    ]
    inputs = theory.TimeModelInputs.from_stats(PolybasicStats(levels=levels, new_tokens=40))
    assert inputs.blocks == (6.0, 3.0) and inputs.acceptance_lengths == (4.0, 1.6) and inputs.beta == 3.0


# --- Theorem 3.2 with cost curves --------------------------------------------------------------------
def test_constant_curves_give_the_exact_printed_verdict():
    numbers = dict(l_i=2.5, l_i_new=5.0, l_new=3.0, beta=4.0)
    printed = theory.insertion_test(t_i=1.0, t_new=0.3, t_next=0.05, **numbers)
    curved = theory.insertion_test_with_curves(t_i=1.0, t_new=0.3, t_next=0.05, block_i=4, block_i_new=9, block_new=4,
                                               **numbers)
    assert curved.helps == printed.helps
    assert curved.time_saved_per_token == pytest.approx(printed.time_saved_per_token)
    assert not curved.constant_cost_misleads


def test_where_verification_costs_grow_with_k_the_printed_form_misleads():
    """T_i(k) = k T(1), as for a bf16 target on a CPU without bf16 units: a middle model makes the
    target's blocks longer, and the longer verifications eat the saving the printed form counts."""
    steep = lambda k: 0.1 * k  # noqa: E731
    verdict = theory.insertion_test_with_curves(
        t_i=steep, t_new=0.03, t_next=0.01, l_i=2.0, l_i_new=4.0, l_new=3.0, beta=4.0,
        block_i=4, block_i_new=9, block_new=4,
    )
    assert verdict.constant_cost.helps and not verdict.helps and verdict.constant_cost_misleads
    before = theory.polybasic_time_per_token_with_curves([steep, 0.01], [2.0], [4], 4.0)
    after = theory.polybasic_time_per_token_with_curves([steep, 0.03, 0.01], [4.0, 3.0], [9, 4], 4.0)
    assert verdict.time_saved_per_token == pytest.approx(before - after)


def test_curve_inputs_are_checked():
    with pytest.raises(ValueError, match="curves needs one T_i per model"):
        theory.polybasic_time_per_token_with_curves([1.0], [], [], 1.0)
    with pytest.raises(ValueError, match=r"curves\[1\] must map tokens"):
        theory.polybasic_time_per_token_with_curves([1.0, {0: 1.0}], [2.0], [3.0], 1.0)
    with pytest.raises(ValueError, match="one value per verifying model"):
        theory.polybasic_time_per_token_with_curves([1.0, 0.1], [2.0, 3.0], [3.0], 1.0)
