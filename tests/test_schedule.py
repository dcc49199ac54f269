"""Schedules that move K and mu during generation: their rules in isolation, the cost-aware policy
on simulated machines (deterministic: a simulated clock charges each forward a given cost), and
losslessness.

Greedy equality with every schedule runs in `test_greedy_equality`; here the exact-distribution
test runs with the schedules that vary the proposal length and with rounds that propose nothing
(back-off), next to a negative control: a drafter that decides its length *after* seeing its
draft (it drops a trailing low-probability token) is lossy, and the test catches it.
"""

import dataclasses

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from helpers import (
    ALPHA,
    assert_every_level_took_part,
    assert_target_could_sample,
    chi_square_p_value,
    left_padded,
    sample_counts,
)

from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.config import PolybasicConfig
from hf_polybasic.costs import CostCurves, cost_key
from hf_polybasic.decoding.round import ModelDrafter, draw_spread
from hf_polybasic.generation import make_generate
from hf_polybasic.levels import early_exit
from hf_polybasic.decoding.protocol import Proposal
from hf_polybasic.schedule.backoff import MAX_BACKOFF_ROUNDS
from hf_polybasic.schedule import calibration as calibration_module
from hf_polybasic.schedule.calibration import BIN_EDGES
from hf_polybasic.schedule.rates import best_proposal, best_round_rate, more_drafts_pay
from hf_polybasic.schedule.batch_gate import BLIND_LENGTH, PLAIN_FIRST_ROUNDS
from hf_polybasic.schedule import batch_gate, cost_aware
from hf_polybasic.schedule import (
    FIRST_BACKOFF_ROUNDS,
    SAFETY_MARGIN,
    SAFETY_ROUNDS,
    WARMUP_ROUNDS,
    BatchGate,
    ConfidenceCalibration,
    ConstantSchedule,
    CostAwareSchedule,
    HeuristicSchedule,
    acceptance_rate_estimate,
    best_length,
    expected_tokens,
    make_schedule,
    worth_more,
    worth_one_more,
)
import hf_polybasic as hp
from hf_polybasic.testing import PAD, SimulatedClock, make_chain, cheap_drafting_costs, make_target, noisy_copy, prompt, simulated_machine


class Curve:
    """A verifier cost curve for unit tests: seconds(k)."""

    def __init__(self, function):
        self.seconds = function


# --- the rules in isolation ---------------------------------------------------------------------
def test_make_schedule_builds_one_class_per_policy():
    assert isinstance(make_schedule("constant", 4, 16), ConstantSchedule)
    assert isinstance(make_schedule("heuristic", 4, 16), HeuristicSchedule)
    assert isinstance(make_schedule("cost_aware", 4, 16, per_token=True), CostAwareSchedule)
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("adaptive", 4, 16)


def test_constant_schedule_never_moves():
    schedule = ConstantSchedule(4)
    for drafted, accepted in [(4, 4), (4, 0), (4, 4), (4, 2)]:
        schedule.observe_proposal(drafted, 0.01)
        schedule.observe_verification(drafted, accepted, 0.1)
        assert schedule.length() == 4


def test_heuristic_schedule_is_transformers_rule():
    schedule = HeuristicSchedule(4, 7)
    lengths = []
    for drafted_all in [True, True, False, False, False, False, False, True]:
        k = schedule.length()
        schedule.observe_verification(k, k if drafted_all else 0, 0.1)
        lengths.append(schedule.length())
    # +2 capped at the maximum, -1 down to 1
    assert lengths == [6, 7, 6, 5, 4, 3, 2, 4]


def test_acceptance_rate_estimate_is_geometric_mle_with_pseudocounts():
    assert acceptance_rate_estimate(0, 0) == 0.5
    assert acceptance_rate_estimate(8, 2) == pytest.approx(9 / 12)
    with pytest.raises(ValueError, match="counts"):
        acceptance_rate_estimate(-1, 0)


def test_expected_tokens_is_the_truncated_geometric_mean():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5


def test_best_length_follows_cost_and_acceptance():
    flat = lambda k: 0.3  # noqa: E731 - a verification costs the same whatever k
    # a nearly free drafter that is usually right: propose as much as allowed
    assert best_length(0.95, 1e-4, flat, maximum=16) == 16
    # an expensive drafter that is usually wrong: propose the minimum
    assert best_length(0.2, 0.15, flat, maximum=16) == 1
    # with a flat verification it is Leviathan's optimum (alpha 0.8, c = 0.1)
    leviathan = [(1 - 0.8 ** (g + 1)) / (1 - 0.8) / (g * 0.1 + 1) for g in range(17)]
    assert best_length(0.8, 0.03, flat, maximum=16) == max(range(1, 17), key=lambda g: leviathan[g])
    # a verification that costs 0.05 s more per token scored makes long proposals pay less
    steep = lambda k: 0.3 + 0.05 * k  # noqa: E731
    rates = [expected_tokens(0.8, g) / (g * 0.03 + steep(g + 1)) for g in range(17)]
    assert best_length(0.8, 0.03, steep, maximum=16) == max(range(1, 17), key=lambda g: rates[g])
    assert best_length(0.8, 0.03, steep, maximum=16) < best_length(0.8, 0.03, flat, maximum=16)


def test_best_length_prices_the_verification_of_the_proposal_and_one_more_and_ties_go_short():
    # a static runner's widths: scoring up to 4 tokens costs one unit, 5 to 8 two; a proposal of l
    # tokens is verified at width l + 1, so 3 is the longest that stays in the first width and pays
    # best (E(3) = 3.44 per unit against E(8) = 6.13 per two units)
    stepped = lambda k: 1.0 if k <= 4 else 2.0  # noqa: E731
    assert best_length(0.9, 1e-6, stepped, maximum=8) == 3
    # a drafter never right and free, with a flat verification: every length gives exactly one token per
    # unit, and the tie goes to the shortest
    assert best_length(0.0, 0.0, lambda k: 1.0, maximum=8) == 1
    assert best_length(0.0, 0.0, lambda k: 1.0, maximum=8, minimum=2) == 2


def test_one_more_token_pays_exactly_when_it_raises_the_rounds_rate():
    # E tokens for C seconds; one more adds g = S a tokens for m seconds
    for survival, acceptance, expected, seconds, marginal in [(0.9, 0.9, 4.0, 0.4, 0.05), (0.5, 0.5, 2.0, 0.2, 0.05),
                                                              (1.0, 1.0, 1.0, 0.1, 0.1), (0.3, 0.2, 3.0, 0.3, 0.01)]:
        raised = (expected + survival * acceptance) / (seconds + marginal) > expected / seconds
        assert worth_one_more(survival, acceptance, expected, seconds, marginal) == raised


def test_more_tokens_pay_when_some_extension_raises_the_rounds_rate():
    # with one step it is the one-more rule
    for case in [(0.9, 0.9, 4.0, 0.4, 0.05), (0.5, 0.5, 2.0, 0.2, 0.05), (0.3, 0.2, 3.0, 0.3, 0.01)]:
        survival, acceptance, expected, seconds, marginal = case
        assert worth_more(survival, acceptance, expected, seconds, [marginal]) == worth_one_more(*case)
    # a costly step (0.35 s) then a flat stretch (0.05 s a token): the next token alone does not pay,
    # five more do (0.73 (0.9 + ... + 0.9^5) tokens for 0.55 s against 3.44 tokens for 1.15 s)
    steps = [0.35 + 0.05 * m for m in range(5)]
    assert not worth_one_more(0.73, 0.9, 3.44, 1.15, steps[0])
    assert worth_more(0.73, 0.9, 3.44, 1.15, steps)
    assert not worth_more(0.73, 0.3, 3.44, 1.15, steps)  # unsure drafts: no extension pays


def test_a_step_in_the_verification_cost_is_crossed_when_the_flat_stretch_beyond_pays(monkeypatch):
    """A static runner pads verifications to widths: T_v flat to 4 tokens, one step, flat again (as 8
    and 16 wide graphs cost about the same on a GPU). Sure drafts cross the step and fill the
    proposal; the one-token rule stopped at it (3 drafts, a 4-wide verification)."""
    curve = Curve(lambda k: 1.0 if k <= 4 else 1.3)

    def drafted(lookahead):
        monkeypatch.setattr(cost_aware, "LOOKAHEAD", lookahead)
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=curve, step_seconds=0.05)
        for _ in range(40):
            schedule.calibration.observe([0.9] * 6, accepted=6)
        return _drafted_lengths(schedule, [0.9] * 20, rounds=1)[-1]

    assert drafted(1) == 3 and drafted(16) == 16


def test_calibration_learns_acceptance_by_confidence_from_revealed_tokens():
    calibration = ConfidenceCalibration()
    assert calibration.acceptance(0.1) < calibration.acceptance(0.5) < calibration.acceptance(0.97)  # the prior
    for _ in range(40):  # confident drafts are always accepted, unsure ones never
        calibration.observe([0.995, 0.995, 0.3, 0.995], accepted=2)
    assert calibration.acceptance(0.995) > 0.95 and calibration.acceptance(0.3) < 0.1
    # only revealed tokens count: the 4th draft (after the rejected 3rd) taught nothing about 0.995's
    # 'next' curve beyond the two accepted ones followed by a revealed one
    assert calibration.next_acceptance(0.995) == pytest.approx((2 * 0.9975 + 40) / (2 + 80), abs=0.02)


def test_what_a_call_learned_starts_the_next_call_of_the_same_pair(monkeypatch):
    """A drafter that is right far more often than it is sure (confidence 0.3, always accepted): the
    prior says 0.65 per draft; after one call has seen it, the next call of the same two models starts
    near the truth, carrying at most CARRIED_WEIGHT observations per bin (a new text still moves it)."""
    from hf_polybasic.schedule import calibration as calibration_module

    memory = calibration_module._Remembered()
    drafter, target, other = (torch.nn.Linear(1, 1) for _ in range(3))
    first = memory.start(drafter, target)
    assert first.acceptance(0.3) == pytest.approx(0.65)
    for _ in range(200):
        first.observe([0.3, 0.3, 0.3], accepted=3)
    memory.keep(drafter, target, first)
    second = memory.start(drafter, target)
    assert second.acceptance(0.3) > 0.95 and second.observations == 0
    assert sum(trials for _, trials in second._accepted) <= calibration_module.CARRIED_WEIGHT * len(second._accepted)
    assert memory.start(drafter, other).acceptance(0.3) == pytest.approx(0.65)  # another verifier: the prior
    memory.keep(drafter, other, memory.start(drafter, other))  # a second pair of the same drafter
    assert memory.start(drafter, target).acceptance(0.3) > 0.95  # kept beside it, not overwritten


def test_a_chain_keeps_its_levels_calibrations_for_the_next_call(monkeypatch):
    from hf_polybasic.schedule import calibration as calibration_module

    memory = calibration_module._Remembered()
    monkeypatch.setattr(calibration_module, "remembered", memory)
    target, draft = make_chain("llama", depth=2, seed=4)
    with simulated_machine(cheap_drafting_costs(target, [draft])) as generate:
        target.generate(prompt(6, seed=2), custom_generate=generate, assistant_models=[draft], do_sample=False,
                        max_new_tokens=24)
    carried = memory.start(draft, target)
    assert carried._accepted != calibration_module.ConfidenceCalibration()._accepted


def test_greedy_and_sampled_calls_of_a_pair_learn_apart(monkeypatch):
    """Sampled acceptance at a confidence is not greedy's (the verifier's probability of the drawn token,
    not argmax agreement): each mode carries its own tables, and keeping one mode's keeps the other's.
    A chain marks each pair by how its verifier accepts: with `verification="greedy"` the drafter's
    drafts to the middle level are matched greedily while the middle level's to the target are sampled."""
    memory = calibration_module._Remembered()
    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    sampled = memory.start(drafter, target, sampled=True)
    assert sampled.sampled and not memory.start(drafter, target).sampled
    for _ in range(200):
        sampled.observe([0.3, 0.3, 0.3], accepted=3)
    memory.keep(drafter, target, sampled)
    assert memory.start(drafter, target, sampled=True).acceptance(0.3) > 0.95
    assert memory.start(drafter, target).acceptance(0.3) == pytest.approx(0.65)  # greedy: still the prior
    memory.keep(drafter, target, memory.start(drafter, target))  # greedy's kept beside sampled's
    assert memory.start(drafter, target, sampled=True).acceptance(0.3) > 0.95

    monkeypatch.setattr(calibration_module, "remembered", memory)
    target, middle, draft = make_chain("llama", depth=3, seed=4)
    with simulated_machine(cheap_drafting_costs(target, [middle, draft])) as generate:
        target.generate(prompt(6, seed=2), custom_generate=generate, assistant_models=[middle, draft],
                        polybasic_config=PolybasicConfig(verification="greedy"), do_sample=True, max_new_tokens=8)
    modes = {pair: set(memory._tables.get(pair)) for pair in [(draft, middle), (middle, target), (draft, target)]}
    assert modes == {(draft, middle): {False}, (middle, target): {True}, (draft, target): {True}}
    assert set(memory._tables.get((middle, target, draft))) == {True}  # the middle drafting alone to the target


def _penalised_likelihood(calibration, seen, shift):
    """What a sampled `ConfidenceCalibration`'s shift maximises, written out: ``seen`` (this call's
    revealed drafts, {(table, bin): (accepted, revealed)}) under each bin's rate moved by ``shift`` on
    the logit scale, less SHIFT_PENALTY shift^2 / 2."""
    import math

    value = -calibration_module.SHIFT_PENALTY * shift**2 / 2
    for (table, index), (successes, trials) in seen.items():
        total, weight = (calibration._accepted, calibration._next)[table][index]
        p = 1 / (1 + math.exp(-(math.log(total / (weight - total)) + shift)))
        value += successes * math.log(p) + (trials - successes) * math.log(1 - p)
    return value


def test_a_sampled_calibration_follows_a_text_that_agrees_less_down_in_every_bin():
    """A sampled call whose drafts of confidence 0.85 are accepted a third of the time where the carried
    tables say 0.9 moves both curves down in every bin, those it has not seen yet too (prose after code), by the
    shift that maximises its drafts' penalised likelihood; the first-draft gate then declines a round it
    drafted before. A greedy calibration taught the same keeps its other bins, and a text that agrees
    more than the tables leaves a sampled calibration's curves where its bins put them (no shift up)."""
    memory = calibration_module._Remembered()
    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    for sampled in (False, True):
        carried = memory.start(drafter, target, sampled=sampled)
        for _ in range(10):  # code: 0.8 of the drafts of confidence 0.5 accepted, 0.9 of those of 0.85
            for accepted in (1, 1, 1, 1, 0):
                carried.observe([0.5], accepted=accepted)
            for accepted in (1,) * 9 + (0,):
                carried.observe([0.85], accepted=accepted)
        memory.keep(drafter, target, carried)
    curve = Curve(lambda k: 0.1 if k == 1 else 0.25)  # a proposal costs the target 2.5 steps
    schedules = {}
    for sampled in (False, True):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=curve, step_seconds=0.01,
                                     calibration=memory.start(drafter, target, sampled=sampled))
        before = schedule.calibration.acceptance(0.5), schedule.calibration.next_acceptance(0.5)
        assert schedule.first_draft_pays(0.5)
        for _ in range(6):  # prose: a third of the confident drafts accepted, and none after another
            schedule.calibration.observe([0.85, 0.85], accepted=1)
            schedule.calibration.observe([0.85], accepted=0)
        schedules[sampled] = schedule, before
    greedy, before = schedules[False]
    assert greedy.calibration.shift == 0.0
    assert (greedy.calibration.acceptance(0.5), greedy.calibration.next_acceptance(0.5)) == before
    assert greedy.first_draft_pays(0.5)
    sampled, before = schedules[True]
    calibration = sampled.calibration
    assert calibration.shift < -0.5
    assert calibration.acceptance(0.5) < before[0] - 0.1 and calibration.next_acceptance(0.5) < before[1] - 0.1
    seen = {(0, calibration_module._bin(0.85)): (6, 18), (1, calibration_module._bin(0.85)): (0, 6)}
    for step in (0.01, -0.01):
        assert (_penalised_likelihood(calibration, seen, calibration.shift)
                > _penalised_likelihood(calibration, seen, calibration.shift + step))
    point = [0.0] * (len(BIN_EDGES) + 1)
    point[calibration_module._bin(0.5)] = 1.0
    assert calibration.drawn_acceptance(point) == pytest.approx(
        (calibration.acceptance(0.5), calibration.next_acceptance(0.5)))
    assert not sampled.first_draft_pays(0.5) and not sampled.first_draft_pays(point)

    agreeing = memory.start(drafter, target, sampled=True)
    for _ in range(20):
        agreeing.observe([0.5, 0.5, 0.5], accepted=3)
    seen = {(0, calibration_module._bin(0.5)): (60, 60), (1, calibration_module._bin(0.5)): (40, 40)}
    assert agreeing.shift == 0.0
    assert _penalised_likelihood(agreeing, seen, 0.1) > _penalised_likelihood(agreeing, seen, 0.0)  # up: not taken


def _drafted_lengths(schedule, confidences, rounds=6, verify=0.1):
    """Run ``rounds`` rounds in which every draft (of the given confidences, in turn) is accepted;
    the drafted lengths."""
    lengths = []
    for _ in range(rounds):
        drafted = 0
        for confidence in confidences:
            drafted += 1
            if drafted >= schedule.length() or not schedule.keep_drafting(confidence):
                break
        lengths.append(drafted)
        schedule.observe_proposal(drafted, 0.002 * drafted)
        schedule.observe_verification(drafted, drafted, verify)
    return lengths


def test_confident_drafts_run_long_and_unsure_ones_stop_early():
    def schedule():
        return CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.002)

    assert _drafted_lengths(schedule(), [0.99] * 20)[-1] == 16  # a flat curve and sure drafts: the maximum
    unsure = schedule()
    for _ in range(30):  # unsure drafts that are rejected teach it
        unsure.calibration.observe([0.2, 0.2], accepted=0)
    assert _drafted_lengths(unsure, [0.2] * 20, rounds=1)[-1] <= 2


def test_keep_drafting_weighs_the_marginal_verification_cost():
    def warmed(curve):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(curve), step_seconds=0.004)
        for _ in range(3):  # confident drafts that are accepted
            for _ in range(4):
                schedule.keep_drafting(0.9)
            schedule.observe_proposal(4, 0.004 * 4)
            schedule.observe_verification(4, 4, 0.1)
        return schedule

    flat, steep = warmed(lambda k: 0.1), warmed(lambda k: 0.1 * k)
    flat_kept = sum(flat.keep_drafting(0.9) for _ in range(6))
    steep_kept = sum(steep.keep_drafting(0.9) for _ in range(6))
    assert flat_kept == 6 and steep_kept == 0


def test_a_round_proposes_at_all_only_where_its_first_top_probability_pays():
    """`first_draft_pays` on a curve where any proposal costs the parent a second step (T(2) = 2 T(1),
    flat beyond: unpacked fp32 on AVX2): every round proposes until the calibration is the pair's own;
    then a first position whose probability bin was never accepted declines and a sure one proposes;
    `DECLINED_ROUNDS` declines in a row back the level off, and a round that proposes restarts the count."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 if k == 1 else 0.2),
                                 step_seconds=0.01)
    assert not schedule.calibration.calibrated and schedule.first_draft_pays(0.1)
    for _ in range(20):
        schedule.calibration.observe([0.1], accepted=0)
        schedule.calibration.observe([0.97, 0.97, 0.97], accepted=3)
    assert schedule.calibration.calibrated
    for _ in range(cost_aware.DECLINED_ROUNDS - 1):
        assert not schedule.first_draft_pays(0.1)
    assert schedule.first_draft_pays(0.97)
    schedule.keep_drafting(0.97)
    schedule.observe_verification(1, 1, 0.2)
    for _ in range(cost_aware.DECLINED_ROUNDS - 1):
        assert not schedule.first_draft_pays(0.1)
    assert not schedule.backoff.paused  # the round that proposed in between restarted the count
    assert not schedule.first_draft_pays(0.1)
    assert schedule.backoff.paused and schedule.length() == 0
    # the price is the curve's: where a first draft costs the parent nothing, even that bin's pays
    flat = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.01)
    flat.calibration = schedule.calibration
    assert flat.first_draft_pays(0.1)
    # a sure first draft pays for half a step on its own, though the draft after it is mostly rejected
    half = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 if k == 1 else 0.15),
                             step_seconds=0.01)
    for _ in range(20):
        half.calibration.observe([0.85, 0.1], accepted=1)
    assert half.calibration.next_acceptance(0.85) < 0.2 and half.first_draft_pays(0.85)


def _three_steps(k):
    """Issue 47's AVX2 machine, the fp32 1.5B as loaded (trace of 2026-12-01): one token a step, two
    two steps, three to 17 about three, then a gentle rise."""
    return 0.010 * min(k, 3) + 0.0005 * max(k - 17, 0)


def _calibrated(curve, sure=0.97, unsure=0.3):
    """A greedy model level on ``curve`` whose calibration says: drafts of confidence ``sure`` are
    always accepted, drafts of ``unsure`` one time in five."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(curve), step_seconds=0.001)
    for _ in range(20):
        schedule.calibration.observe([sure, sure, unsure], accepted=2)
        schedule.calibration.observe([sure, sure, unsure], accepted=3 if _ % 5 == 0 else 2)
    assert schedule.calibration.calibrated
    return schedule


def test_a_round_that_stopped_at_an_unsure_draft_proposes_what_pays():
    """`proposal_size`: with T(2) = 2 T(1) and T(3..17) = 3 T(1), a round that stopped after a sure and
    an unsure draft proposes neither (E_1 = 2 tokens for two steps, E_2 = 2.2 for three: both lose to
    decoding alone, 0), one that stopped after four sure drafts and an unsure one proposes all five
    (the unsure one is free within the step); on a flat curve every draft is proposed; before the
    calibration is the pair's own, or with a draft no confidence was asked of, all of them."""
    stepped = _calibrated(_three_steps)
    for confidences, size in [([0.97, 0.3], 0), ([0.97] * 4 + [0.3], 5), ([0.3], 0), ([0.97, 0.97, 0.97], 3)]:
        for confidence in confidences:
            stepped.keep_drafting(confidence)
        assert stepped.proposal_size(len(confidences)) == size, confidences
        stepped.observe_verification(size, size, 0.01)  # ends the round
    acceptance = stepped.calibration.acceptance
    expected = [1.0, 1 + acceptance(0.97), 1 + acceptance(0.97) * (1 + acceptance(0.3))]
    assert expected[1] * _three_steps(1) < _three_steps(2) and expected[2] * _three_steps(1) < _three_steps(3)
    flat = _calibrated(lambda k: 0.010)
    for confidence in [0.97, 0.3]:
        flat.keep_drafting(confidence)
    assert flat.proposal_size(2) == 2
    fresh = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(_three_steps), step_seconds=0.001)
    fresh.keep_drafting(0.3)
    assert not fresh.calibration.calibrated and fresh.proposal_size(1) == 1
    stepped.keep_drafting(0.97)
    assert stepped.proposal_size(2) == 2  # the second (an EOS, the budget's last) was not asked about
    assert ConstantSchedule(4).proposal_size(3) == 3
    assert best_proposal([0.0, 0.0], lambda k: 0.010) == 2  # equal savings (none): the longest
    assert best_proposal([1.0, 0.0, 1.0], _three_steps) == 1 and best_proposal([], _three_steps) == 0
    # rounds that drafted and proposed nothing back the level off as declined ones do; one that
    # proposes restarts the count
    stepped.observe_verification(0, 0, 0.01)
    for rounds in (cost_aware.DECLINED_ROUNDS - 1, cost_aware.DECLINED_ROUNDS):
        for _ in range(rounds):
            stepped.keep_drafting(0.97), stepped.keep_drafting(0.3)
            assert stepped.proposal_size(2) == 0
            stepped.observe_verification(0, 0, 0.01)
        assert stepped.backoff.paused == (rounds == cost_aware.DECLINED_ROUNDS)
        if not stepped.backoff.paused:
            stepped.keep_drafting(0.97)
            stepped.observe_verification(1, 1, 0.02)


def test_a_drafter_withholds_only_argmax_drafts_and_counts_them():
    """`ModelDrafter._withhold`: an argmax drafter cuts its block to its schedule's `proposal_size` and
    counts the rest in `LevelStats.withheld`; a sampling drafter proposes every draft whatever its
    schedule would say (a draft dropped for its value is lossy: the negative control below,
    `test_negative_control_length_chosen_after_drafting_is_rejected`)."""
    from types import SimpleNamespace
    from hf_polybasic.decoding.protocol import Block
    from hf_polybasic.stats import LevelStats

    class ProposesOne(ConstantSchedule):
        def proposal_size(self, drafted):
            return 1

    for samples, size, withheld in [(False, 1, 2), (True, 3, 0)]:
        drafter = SimpleNamespace(samples=samples, stats=LevelStats("M2", "drafter"), _active={0: ProposesOne(4)})
        block = Block(frozenset(), budget=4)
        block.extend(torch.tensor([4, 5, 6]), torch.full((3, 8), 0.125) if samples else None, ids=[4, 5, 6])
        ModelDrafter._withhold(drafter, 0, block)
        assert (block.size, drafter.stats.withheld, block.ids) == (size, withheld, [4, 5, 6][:size])


def _calibrated_call_on_three_steps(target, drafter, ids, **options):
    """The second of two calls of the pair on `_three_steps`' machine (the first calibrates it)."""
    with simulated_machine({target: _three_steps, drafter: lambda k: 0.0009}) as generate:
        chain = dict(custom_generate=generate, assistant_models=[drafter], return_dict_in_generate=True, **options)
        target.generate(ids, **chain)
        return target.generate(ids, **chain)


@pytest.mark.parametrize("arch, noise", [("llama", 0.2), ("qwen2", 0.2), ("gemma3", 0.1)])  # gemma3: a window of 6
def test_greedy_rounds_withhold_unsure_drafts_past_a_step_and_keep_plain_generates_output(arch, noise):
    """On `_three_steps`' machine with a drafter that agrees with the target in streaks and disagrees
    between them, the drafter withholds drafts (`LevelStats.withheld`) and the output is plain greedy
    `generate`'s."""
    target = make_target(arch, seed=13, layers=4, logit_scale=40.0)  # peaked: drafts of every confidence
    drafter = noisy_copy(target, noise, seed=3)
    ids, options = prompt(6, seed=4), dict(max_new_tokens=48, eos_token_id=None, do_sample=False)
    out = _calibrated_call_on_three_steps(target, drafter, ids, **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    assert_every_level_took_part(out.polybasic_stats)
    drafter_level = out.polybasic_stats.levels[1]
    assert drafter_level.withheld > 0 and drafter_level.proposed > 0


def test_sampled_rounds_stop_before_later_positions_their_distribution_says_do_not_pay():
    """On `_three_steps`' machine, with the pair's sampled calibration learned, a sampled call's rounds stop
    before later drafts by their position's distribution (`next_draft_pays`, counted as withheld), and
    propose the rest."""
    target = make_target("llama", seed=13, layers=4, logit_scale=40.0)
    drafter = noisy_copy(target, 0.2, seed=3)
    ids, options = prompt(6, seed=4), dict(max_new_tokens=64, eos_token_id=None, do_sample=True)
    torch.manual_seed(0)
    out = _calibrated_call_on_three_steps(target, drafter, ids, **options)
    assert_every_level_took_part(out.polybasic_stats)
    drafter_level = out.polybasic_stats.levels[1]
    assert drafter_level.withheld > 0 and drafter_level.proposed > 0


def test_rows_of_a_ragged_batch_withhold_the_draft_that_filled_their_block_and_keep_plain_generates_output():
    """A batch's rows draft short blocks (a batch not yet seen to pay: `BatchGate.cap`), each filled to its
    length; the draft that filled it is priced too (`Schedule.closed_at`), so a row withholds it where it does
    not pay, and the left-padded batch's output is plain greedy `generate`'s."""
    target = make_target("llama", seed=13, layers=4, logit_scale=40.0)
    drafter = noisy_copy(target, 0.05, seed=3)
    ids, mask = left_padded([prompt(n, seed=n)[0] for n in (5, 8)])
    options = dict(max_new_tokens=48, eos_token_id=None, pad_token_id=PAD, do_sample=False)
    out = _calibrated_call_on_three_steps(target, drafter, ids, attention_mask=mask, **options)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, **options))
    assert_every_level_took_part(out.polybasic_stats)
    assert out.polybasic_stats.levels[1].withheld > 0


def test_a_probe_after_declined_rounds_is_priced_without_the_calls_shift():
    """A declined round reveals nothing, so a sampled call's `shift`, learned from a turn's first rejected
    rounds, would decline every later round, the back-off's probes too (issue 47's AVX2 bench: a code
    turn drafted nothing for 33 rounds after two rejected ones, and the rounds after accepted 23 of 23). The
    probe is priced by the bins without the shift and drafts; what it reveals moves the shift, and the
    rounds after it, priced with the shift again, draft."""
    memory = calibration_module._Remembered()
    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    carried = memory.start(drafter, target, sampled=True)
    for accepted in (8,) * 10 + (5,) * 4:  # code: sure drafts, nearly all accepted
        carried.observe([0.995] * 8, accepted=accepted)
    memory.keep(drafter, target, carried)
    calibration = memory.start(drafter, target, sampled=True)
    for _ in range(5):  # the turn opens with sure drafts rejected
        calibration.observe([0.995] * 4, accepted=0)
    shift = calibration.shift
    assert shift < -1 and calibration.unshifted().shift == 0.0 and calibration.shift == shift
    assert calibration.unshifted().acceptance(0.995) > calibration.acceptance(0.995) + 0.1
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(_step_at_two), step_seconds=0.003,
                                 calibration=calibration)
    sure = [0.0] * (len(BIN_EDGES) + 1)
    sure[-1] = 1.0
    for _ in range(cost_aware.DECLINED_ROUNDS):
        assert schedule.length() > 0 and not schedule.first_draft_pays(sure)
        _round(schedule, 0, 0, 0.0, verify=_step_at_two(1))
    assert schedule.backoff.paused
    while not schedule.backoff.probing:
        assert schedule.length() == 0
        _round(schedule, 0, 0, 0.0, verify=_step_at_two(1))
    assert schedule.length() > 0 and schedule.first_draft_pays(sure) and calibration.shift == shift
    for _ in range(4):
        schedule.keep_drafting(0.995)
    _round(schedule, 4, 4, 4 * 0.003, verify=_step_at_two(5))
    assert not schedule.backoff.probing and calibration.shift > shift
    assert schedule.first_draft_pays(sure)  # no longer a probe: priced with the shift the probe moved


def test_a_sampled_first_draft_is_priced_over_its_draw_not_its_top():
    """Sampling draws an unsure token from a flat distribution as often as its mass says: a first
    position whose top (0.45) is always accepted but which puts 0.55 of its mass on tokens never
    accepted pays greedy (the draft is the top) and not sampled (`drawn_acceptance` over the spread);
    a spread that is a point mass prices exactly as the top does."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 if k == 1 else 0.16),
                                 step_seconds=0.01)
    for _ in range(20):
        schedule.calibration.observe([0.45, 0.1], accepted=1)
        schedule.calibration.observe([0.1], accepted=0)
    calibration = schedule.calibration
    spread = [0.0] * (len(BIN_EDGES) + 1)
    spread[calibration_module._bin(0.1)], spread[calibration_module._bin(0.45)] = 0.55, 0.45
    point = [0.0] * len(spread)
    point[calibration_module._bin(0.45)] = 1.0
    assert calibration.drawn_acceptance(point) == pytest.approx(
        (calibration.acceptance(0.45), calibration.next_acceptance(0.45)))
    first, later = calibration.drawn_acceptance(spread)
    assert first == pytest.approx(0.45 * calibration.acceptance(0.45) + 0.55 * calibration.acceptance(0.1))
    assert later == pytest.approx(0.45 * calibration.acceptance(0.45) * calibration.next_acceptance(0.45) / first
                                  + 0.55 * calibration.acceptance(0.1) * calibration.next_acceptance(0.1) / first)
    assert calibration.drawn_acceptance([2 * mass for mass in spread]) == pytest.approx((first, later))
    assert schedule.first_draft_pays(0.45) and schedule.first_draft_pays(point)
    assert not schedule.first_draft_pays(spread)
    with pytest.raises(ValueError, match="no mass"):
        calibration.drawn_acceptance([0.0] * len(spread))


@settings(max_examples=300, deadline=None)
@given(acceptances=st.lists(st.floats(0.05, 0.99), max_size=4), first=st.floats(0.01, 0.99),
       later=st.floats(0.01, 0.99), step=st.floats(0.0, 0.05), rises=st.lists(st.floats(0.0, 0.2), min_size=11,
                                                                                 max_size=11),
       room=st.integers(0, 6), spent=st.sampled_from([0, 1]))
# four kept drafts' steps are part of the round's cost: without them the next draft would not pay
@example(acceptances=[0.9] * 4, first=0.5, later=0.5, step=0.05, rises=[0.0] * 4 + [0.015] + [0.0] * 6, room=1,
         spent=1)
def test_more_drafts_pay_exactly_when_some_longer_round_has_a_higher_expected_rate(acceptances, first, later, step,
                                                                                   rises, room, spent):
    """`rates.more_drafts_pay` against the rates themselves: l kept drafts accepted with probabilities a_i
    (each given the ones before) make a round of E = 1 + a_1 + a_1 a_2 + ... tokens for C = l s + T(l + 1); m
    more, the next accepted with ``first`` and each after it with ``later``, add S (first + first later + ...)
    tokens (S = a_1 ... a_l) for (m - spent) s + T(l + 1 + m) - T(l + 1) seconds. Pays iff some m within
    ``room`` raises E / C (ties, within rounding, left out)."""
    def seconds(k):
        return 0.1 + sum(rises[: k - 1])

    survival, expected = 1.0, 1.0
    for acceptance in acceptances:
        survival *= acceptance
        expected += survival
    drafted = len(acceptances)
    cost = drafted * step + seconds(drafted + 1)
    margins = []
    for m in range(1, room + 1):
        gain = survival * sum(first * later ** i for i in range(m))
        extra = (m - spent) * step + seconds(drafted + 1 + m) - seconds(drafted + 1)
        margins.append((expected + gain) / (cost + extra) - expected / cost)
    assume(all(abs(margin) > 1e-9 for margin in margins))
    assert more_drafts_pay(acceptances, first, later, step, seconds, room, spent) == any(m > 0 for m in margins)


def test_keep_drafting_looks_ahead_only_within_the_longest_proposal():
    """`keep_drafting` prices extensions up to the level's ``maximum`` only: a step in the cost curve that two
    more sure drafts pay for and one does not is crossed by a level that may draft on, not by one whose
    longest proposal ends one draft past it."""
    curve = Curve(lambda k: 0.1 if k <= 2 else 0.17)
    short, long = (CostAwareSchedule(2, most, per_token=True, verifier_costs=curve, step_seconds=0.01) for most in (2, 16))
    assert long.keep_drafting(0.995) and not short.keep_drafting(0.995)


def test_a_sampled_rounds_next_draft_is_priced_over_its_position_after_the_drafts_kept():
    """`next_draft_pays`: after a kept draft, a position with most of its mass on confidences the target
    accepts is proposed, one with most of it on confidences it rejects is not, one between is proposed
    because its drafting step is spent already (without it, not); it prices `rates.more_drafts_pay` over
    the kept drafts and the position's `drawn_acceptance`. Before the calibration is the pair's own, yes."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 if k <= 2 else 0.11),
                                 step_seconds=0.01)

    def spread(unsure):
        masses = [0.0] * (len(BIN_EDGES) + 1)
        masses[calibration_module._bin(0.1)], masses[calibration_module._bin(0.45)] = unsure, 1 - unsure
        return masses

    steep = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 * k), step_seconds=0.01)
    priced = [[], *steep.calibration.drawn_acceptance(spread(1.0)), 0.01, steep.verification_seconds, 15]
    assert steep.next_draft_pays(spread(1.0)) and not more_drafts_pay(*priced, spent=1)  # the prior's price: no
    for _ in range(20):
        schedule.calibration.observe([0.45, 0.45, 0.45, 0.1], accepted=3)
        schedule.calibration.observe([0.1], accepted=0)
    calibration = schedule.calibration
    assert schedule.keep_drafting(0.45)
    answers = {}
    for unsure in (0.0, 0.8, 0.9):
        priced = [[calibration.acceptance(0.45)], *calibration.drawn_acceptance(spread(unsure)), 0.01,
                  schedule.verification_seconds, 15]
        answers[unsure] = (schedule.next_draft_pays(spread(unsure)), more_drafts_pay(*priced, spent=1),
                           more_drafts_pay(*priced, spent=0))
    assert answers == {0.0: (True, True, True), 0.8: (True, True, False), 0.9: (False, False, False)}


def test_the_draw_spread_is_the_mass_of_each_calibration_bin():
    """`draw_spread`: greedy, the top probability; sampling, the distribution's mass per bin, each
    probability in the bin `calibration` would put a draft of that confidence in (edges included), on
    distributions flat, peaked, with several tokens past the first edge, and with a token exactly at each
    edge; over vocabularies smaller than the tokens that can lie past the first edge too."""
    generator = torch.Generator().manual_seed(3)
    cases = [torch.rand(5000, generator=generator)]
    cases += [(torch.randn(5000, generator=generator) * scale).softmax(-1) for scale in (1.0, 8.0, 15.0)]
    cases += [torch.tensor([0.21, 0.2, 0.2, 0.39]), torch.tensor([0.5, 0.5]), torch.tensor([1.0])]
    cases += [torch.full((5,), 0.2, dtype=torch.float64), torch.tensor([0.2] * 5 + [0.0] * 9, dtype=torch.float64)]
    for edge in BIN_EDGES:  # a token exactly at the edge, the rest of the mass spread thin
        cases.append(torch.cat([torch.tensor([edge]), torch.full((1000,), (1 - edge) / 1000)]).double())
    for probs in cases:
        probs = probs / probs.sum() if probs.dtype == torch.float32 else probs
        expected = [0.0] * (len(BIN_EDGES) + 1)
        for value in probs.double().tolist():
            expected[calibration_module._bin(value)] += value
        assert draw_spread(probs, sampled=True).tolist() == pytest.approx(expected, abs=1e-6)
        assert draw_spread(probs, sampled=False).tolist() == [probs.max().item()]


def test_it_backs_off_at_once_when_not_even_perfect_acceptance_could_pay():
    """Verifying k tokens costs k steps (bf16 without bf16 units): drafting can never pay."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 * k), step_seconds=0.01)
    assert schedule.length() == 0
    flat = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.01)
    assert flat.length() == 16  # a model level proposes up to the maximum; keep_drafting ends the proposal


def test_a_level_that_cannot_stop_token_by_token_drafts_the_best_fixed_length():
    """`fixed_length` (a drafter whose rounds run on the device, `hf_polybasic.decoding.device_blocks`):
    a per-token schedule drafts FIRST_FIXED_LENGTH before it has measured anything, then the best
    fixed length for its measured acceptance and costs, never more than `length`; a schedule that does
    not stop token by token drafts its `length`, and a paused one nothing."""
    flat = Curve(lambda k: 0.1)
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=flat, step_seconds=0.01)
    assert schedule.length() == 16 and schedule.fixed_length() == cost_aware.FIRST_FIXED_LENGTH
    for _ in range(WARMUP_ROUNDS + 3):
        _round(schedule, 4, 2, 0.04)  # about half of each draft accepted
    best = best_length(min(schedule.acceptance_rate(), 0.999), schedule.seconds_per_token(),
                       schedule.verification_seconds, 16)
    assert 1 < best < 16 and schedule.fixed_length() == best
    fixed = CostAwareSchedule(4, 16, per_token=False, verifier_costs=flat, step_seconds=0.01)
    assert fixed.fixed_length() == fixed.length() == 4
    assert ConstantSchedule(5).fixed_length() == 5 and HeuristicSchedule(3, 9).fixed_length() == 3
    dear = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1 * k), step_seconds=0.01)
    assert dear.fixed_length() == 0


def _round(schedule, length, accepted, proposing, verify=0.1):
    schedule.observe_proposal(length, proposing)
    schedule.observe_verification(length, accepted, verify)


def test_it_backs_off_when_first_tokens_stop_paying_and_probes_again():
    """A round pays iff its first token does: a (T_v(1) + o) > s + T_v(2) - T_v(1). Drafts that are
    all rejected, at a step of 0.05 s against a 0.1 s verification, stop paying once the running
    first-token acceptance falls below one half."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.05)
    _round(schedule, 2, 0, 5.0, verify=5.0)  # the first round holds the prompt's prefill
    rounds = 1
    while schedule.length() > 0:
        _round(schedule, 2, 0, 0.1)
        rounds += 1
        assert rounds < 20
    assert schedule.first_token_acceptance() * 0.1 <= 0.05 and rounds >= WARMUP_ROUNDS
    lengths = []
    for _ in range(FIRST_BACKOFF_ROUNDS):  # the parent decodes alone
        _round(schedule, 0, 0, 0.0)
        lengths.append(schedule.length())
    assert lengths[:-1] == [0] * (FIRST_BACKOFF_ROUNDS - 1) and lengths[-1] > 0  # then it probes
    assert schedule.paused_rounds == FIRST_BACKOFF_ROUNDS
    # probes whose drafts are accepted make the first token pay again: proposing resumes, and the
    # next pause would be the first one again
    for _ in range(4):
        length = schedule.length()
        _round(schedule, length, length, 0.05 * length)
    assert schedule.length() > 0 and schedule.backoff.stretch == FIRST_BACKOFF_ROUNDS


def test_a_first_round_slowed_by_the_prefill_does_not_make_it_back_off():
    """The first verification feeds the whole prompt: counted as a yield it made a chain back off
    on prose (1 token in 0.7 s against plain decoding's 0.17 s)."""
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.17), step_seconds=0.035)
    _round(schedule, 3, 0, 0.1, verify=0.6)
    for _ in range(SAFETY_ROUNDS + 4):
        _round(schedule, 3, 1, 0.105, verify=0.17)  # 2 tokens per 0.275 s: 7.3 tok/s against plain's 5.9
        assert schedule.length() > 0 and schedule.overhead() == 0


def test_the_clock_backs_off_only_after_enough_rounds_clearly_below_plain_decoding():
    """Costs that say proposing pays, and a clock that says it does not (the curves are wrong):
    the safety net waits for SAFETY_ROUNDS rounds and a loss beyond SAFETY_MARGIN."""
    def run(rate_factor, rounds):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.001)
        _round(schedule, 2, 2, 1.0, verify=1.0)  # prefill
        for _ in range(rounds):  # 2 tokens per round, timed at rate_factor x plain's 10 tok/s
            _round(schedule, 2, 1, 2 / (10 * rate_factor) - 0.1)
        return schedule.backoff.paused

    assert not run(SAFETY_MARGIN + 0.05, SAFETY_ROUNDS + 2)  # within the noise
    assert not run(SAFETY_MARGIN - 0.2, SAFETY_ROUNDS - 1)  # too little evidence yet
    assert run(SAFETY_MARGIN - 0.2, SAFETY_ROUNDS)


def test_failed_probes_double_the_back_off():
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.1), step_seconds=0.05)
    stretches = []
    for _ in range(200):
        length = schedule.length()
        if length == 0:
            _round(schedule, 0, 0, 0.0)
        else:
            if not schedule.backoff.paused and (not stretches or stretches[-1] != schedule.backoff.stretch):
                stretches.append(schedule.backoff.stretch)
            _round(schedule, length, 0, 0.05 * length)
    assert stretches[:4] == [FIRST_BACKOFF_ROUNDS, 2 * FIRST_BACKOFF_ROUNDS, 4 * FIRST_BACKOFF_ROUNDS,
                             8 * FIRST_BACKOFF_ROUNDS]


def test_a_drafter_without_confidences_gets_the_length_its_acceptance_pays_for():
    schedule = CostAwareSchedule(16, 16, verifier_costs=Curve(lambda k: 0.1 + 0.01 * k))
    assert schedule.length() == 16  # its own length first
    for _ in range(6):  # half of each proposal accepted
        length = schedule.length()
        _round(schedule, length, length // 2, 0.0001)
    assert 1 <= schedule.length() < 16
    assert schedule.length() == best_length(min(schedule.acceptance_rate(), 0.999), schedule.seconds_per_token(),
                                            schedule.verification_seconds, 16)


# --- the policy on simulated machines: deterministic --------------------------------------------
def _simulated_run(target_cost, drafter_cost, tokens=48, do_sample=False, close_drafter=False, **options):
    """The target (4 layers) and an early exit of it (1 layer; or a close copy) on a simulated machine."""
    target = make_target("llama", seed=13, layers=4)
    drafter = noisy_copy(target, 0.02, seed=3) if close_drafter else early_exit(target, 1)
    clock = SimulatedClock()
    handles = [clock.charge(target, target_cost), clock.charge(drafter, drafter_cost)]
    generate = make_generate(clock=clock, costs=CostCurves(directory=None))
    ids = prompt(6, seed=4)
    options = dict(do_sample=do_sample, max_new_tokens=tokens, eos_token_id=None, **options)
    try:
        reference = target.generate(ids, **options)
        out = target.generate(ids, custom_generate=generate, assistant_models=[drafter],
                              polybasic_config=PolybasicConfig(num_draft_tokens=4), return_dict_in_generate=True, **options)
    finally:
        for handle in handles:
            handle.remove()
    return reference, out, target


def test_on_a_machine_where_verification_costs_grow_with_k_it_decodes_plainly():
    """T_target(k) = 10 ms x k (bf16 without bf16 units): no length pays, the target decodes alone."""
    reference, out, _ = _simulated_run(lambda k: 0.010 * k, lambda k: 0.001 * k)
    assert torch.equal(out.sequences, reference)
    target_level, drafter_level = out.polybasic_stats.levels
    assert drafter_level.paused_rounds > 0
    assert target_level.forward_passes >= 0.8 * 48  # close to plain decoding's one per token
    assert drafter_level.forward_costs[8] == pytest.approx(0.008)


def test_on_a_machine_where_verification_is_flat_it_drafts_long():
    """T_target(k) = 10 ms whatever k (a GPU, or bf16 units): long drafts pay."""
    reference, out, _ = _simulated_run(lambda k: 0.010, lambda k: 0.0005, close_drafter=True)
    assert torch.equal(out.sequences, reference)
    target_level, drafter_level = out.polybasic_stats.levels
    assert drafter_level.paused_rounds == 0
    assert target_level.drafted / target_level.verifications > 4  # beyond the configured K = 4


def _step_at_two(k):
    """An unpacked fp32 target on many CPUs (`docs/results/costs`: 1.5B, AVX2): 2 tokens cost two
    steps (a slower matrix path than one row's), 8 hardly more, then a gentle rise."""
    return 0.010 if k <= 1 else 0.020 + 0.001 * max(k - 8, 0)


def test_a_round_pays_where_a_long_proposal_beats_decoding_alone_though_its_first_token_does_not():
    """`CostAwareSchedule.round_pays`: with a step at 2 tokens a one-token round never pays, (1 + a) /
    (s + 2 T(1)) < 1 / T(1) for any a <= 1, and a round of 8 accepted drafts does; with unsure drafts
    no length pays. (The first-token rule backed off here for good: issue 47's AVX2 machine.)"""
    def schedule_after(accepted_of_8):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(_step_at_two), step_seconds=0.0009)
        for _ in range(WARMUP_ROUNDS + 2):
            _round(schedule, 8, accepted_of_8, 8 * 0.0009, verify=_step_at_two(9))
        return schedule

    sure, unsure = schedule_after(7), schedule_after(0)
    assert sure.first_token_acceptance() > 0.85 and sure.round_pays() and sure.length() > 0
    plain = 1 / _step_at_two(1)
    assert (1 + 1.0) / (0.0009 + _step_at_two(2)) < plain  # not even a sure first token pays alone
    assert not unsure.round_pays() and unsure.length() == 0


def test_a_level_its_first_draft_gate_decides_is_not_paused_by_the_average_test():
    """After a turn's unsure start (its unsure first drafts rejected round after round) the average test,
    `round_pays`, says no proposal pays; a level whose rounds `first_draft_pays` decides (asked with a
    calibration of the pair's own) proposes on, declining unsure rounds one by one, while one that does
    not ask backs off for a stretch (issue 47's AVX2 bench: 8-round pauses over code the drafter matched).
    An answer of the prior's calibration does not count as the gate deciding."""
    def after_unsure_start(gated):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(_step_at_two), step_seconds=0.0009)
        if gated:
            schedule.first_draft_pays(0.3)
            assert not schedule.gates_rounds  # the prior's answer
        for _ in range(WARMUP_ROUNDS + 4):
            for _ in range(8):
                schedule.keep_drafting(0.3)
            _round(schedule, 8, 0, 8 * 0.0009, verify=_step_at_two(9))
        assert schedule.calibration.calibrated and not schedule.round_pays()
        if gated:
            assert schedule.first_draft_pays(0.995) and schedule.gates_rounds
        return schedule

    assert after_unsure_start(gated=False).length() == 0
    gated = after_unsure_start(gated=True)
    assert gated.length() > 0 and not gated.backoff.paused
    assert not gated.first_draft_pays(0.3)  # the unsure round is declined on its own


def test_the_best_round_rate_takes_the_first_tokens_acceptance_for_the_first_token_only():
    """A round's first draft is accepted at the first-token rate a_1, each later one at alpha after an
    accepted one; ``round_pays(margin)`` asks for that margin over plain decoding."""
    def costs(k):  # a flat curve
        return 0.010

    rates = [(1 + 0.5 * sum(0.9 ** i for i in range(n))) / (n * 0.001 + 0.010) for n in range(1, 9)]
    assert best_round_rate(0.5, 0.9, 0.001, costs, 8) == pytest.approx(max(rates))
    assert best_round_rate(0.0, 0.9, 0.001, costs, 8) == pytest.approx(1 / 0.011)
    schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=Curve(lambda k: 0.010), step_seconds=0.002)
    best = best_round_rate(schedule.first_token_acceptance(), schedule.acceptance_rate(), 0.002,
                           schedule.verification_seconds, 16)
    ratio = best / schedule.plain_rate()
    assert ratio > 1 and schedule.round_pays() and schedule.round_pays(ratio * 0.99)
    assert not schedule.round_pays(ratio * 1.01)


@pytest.mark.parametrize("noise, least_speedup", [(0.02, 1.5), (1.0, 0.97)], ids=["close drafter", "random drafter"])
def test_on_a_machine_whose_second_token_costs_a_step_it_gains_where_drafts_pay_and_stays_near_plain_elsewhere(
        noise, least_speedup):
    """The chain on `_step_at_two`'s machine, a drafter at 0.09 of a target step (the 0.5B int8 drafting
    for the 1.5B): a close copy drafts past the step and gains (2.3x plain decoding's simulated time);
    a random one stays near plain decoding (0.98x): in the second call its calibration, carried over,
    declines its first drafts (`first_draft_pays`), and after 4 declined rounds it backs off (without
    the gate, 0.95x: forced and probing rounds drafted and were rejected). Priced on the least-squares line
    through the curve (T(1) seen 1.5x dearer than it is, a second token nearly free), the random drafter
    ran at 0.64x: it drafted on, round after round of rejected drafts at two steps each."""
    target = make_target("llama", seed=13, layers=4)
    drafter = noisy_copy(target, noise, seed=3)
    clock = SimulatedClock()
    handles = [clock.charge(target, _step_at_two), clock.charge(drafter, lambda k: 0.0009)]
    ids, options = prompt(6, seed=4), dict(do_sample=False, max_new_tokens=64, eos_token_id=None)
    curves = CostCurves(directory=None, key=lambda model: f"{cost_key(model)}-{id(model)}")  # a curve per model object
    generate = make_generate(clock=clock, costs=curves)
    try:
        reference = target.generate(ids, **options)
        chain = dict(custom_generate=generate, assistant_models=[drafter], return_dict_in_generate=True, **options)
        target.generate(ids, **chain)  # the first call also measures the cost curves (on the clock)
        start = clock.now
        out = target.generate(ids, **chain)
        seconds = clock.now - start
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(out.sequences, reference)
    assert out.polybasic_stats.levels[1].forward_passes > 0  # the drafter was asked, in this call too
    if least_speedup > 1:
        assert out.polybasic_stats.levels[0].drafted > 0
    plain = _step_at_two(6) + 63 * _step_at_two(1)
    assert plain / seconds >= least_speedup


def test_a_drafter_dearer_than_the_target_never_runs_not_even_its_first_rounds(shared_models):
    """A model drafter whose forward costs more than the target's (flat, as on a GPU): not even
    perfect acceptance could pay, so the chain's drafter backs off before its first proposal (the
    static check of its schedule, `CostAwareSchedule._proposing_cannot_pay`) and the call costs what
    plain decoding does, without the drafter's prefill and warm-up rounds."""
    target, draft = shared_models.chain("llama", 2, seed=4)
    ids, options = prompt(6, seed=2), dict(do_sample=False, max_new_tokens=24, eos_token_id=None)
    with simulated_machine({target: lambda n: 0.010, draft: lambda n: 0.012}) as generate:
        out = target.generate(ids, custom_generate=generate, assistant_models=[draft], return_dict_in_generate=True,
                              **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    target_level, drafter_level = out.polybasic_stats.levels
    assert drafter_level.forward_passes == 0 and drafter_level.paused_rounds > 0
    assert target_level.forward_passes == 24


def test_the_simulated_policy_is_deterministic():
    runs = [_simulated_run(lambda k: 0.010 + 0.002 * k, lambda k: 0.001)[1].polybasic_stats for _ in range(2)]
    assert [level.acceptance_lengths for level in runs[0].levels] == [level.acceptance_lengths for level in runs[1].levels]
    assert runs[0].levels[1].paused_rounds == runs[1].levels[1].paused_rounds


# --- losslessness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["heuristic", "cost_aware"])
@pytest.mark.parametrize("depth", [2, 3])
def test_varying_schedules_sample_the_target_distribution(schedule, depth, distribution_models, exact_distribution,
                                                          monkeypatch):
    """Lengths that move between rounds (cost-aware: on a simulated machine where drafting pays, so
    it drafts; with equal-cost tiny models it would rightly back off and test plain sampling). One
    batch of 3 new tokens per row: the batch gate proposes at once instead of timing plain rounds."""
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    setting = "temperature+top_k+top_p"
    target, *assistants = distribution_models[:depth]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as simulated:
        generate = simulated if schedule == "cost_aware" else hp.generate
        counts, stats = sample_counts(target, setting, assistants, seed=11, generate=generate, num_draft_tokens=1,
                                      block_threshold=1, schedule=schedule)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class SittingOutDrafter(ModelDrafter):
    """Proposes nothing every other round (as a backed-off level does): the target then decodes alone."""

    calls = 0

    def propose(self, requests, schedules=None):
        SittingOutDrafter.calls += 1
        if SittingOutDrafter.calls % 2:
            requests = {row: (sequence, 0) for row, (sequence, _) in requests.items()}
        return super().propose(requests, schedules)


def test_rounds_without_proposals_keep_the_target_distribution(distribution_models, exact_distribution):
    setting = "temperature+top_k+top_p"
    generate = make_generate(ChainParts(model_drafter=SittingOutDrafter))
    counts, stats = sample_counts(distribution_models[0], setting, distribution_models[1:2], seed=5, generate=generate,
                                  num_draft_tokens=2, schedule="constant")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class PeekingDrafter(ModelDrafter):
    """Chooses its length after drafting: drops a trailing draft whose own probability is low.
    (transformers' confidence stop keeps that token, which is why it stays exact.)"""

    def propose(self, requests, schedules=None):
        proposals = {}
        for row, proposal in super().propose(requests, schedules).items():
            tokens, probs = proposal.tokens, proposal.probs
            while probs is not None and tokens.shape[0] and probs[-1, tokens[-1]] < 0.25:
                tokens, probs = tokens[:-1], probs[:-1]
            proposals[row] = Proposal(tokens, probs)
        return proposals


def test_negative_control_length_chosen_after_drafting_is_rejected(distribution_models, exact_distribution):
    lossy = make_generate(ChainParts(model_drafter=PeekingDrafter))
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(distribution_models[0], setting, distribution_models[1:2], seed=11, generate=lossy,
                                  num_draft_tokens=2, schedule="constant")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="PolybasicConfig.schedule must be one of"):
        PolybasicConfig(schedule="adaptive")


def test_sampled_output_on_a_simulated_machine_drafts_and_keeps_the_budget():
    """Sampling where drafting pays: the drafter drafts, the budget is exact, and every token is one
    the target can sample (top_k=3); the distribution itself is tested above."""
    reference, out, target = _simulated_run(lambda k: 0.010, lambda k: 0.0005, tokens=20, do_sample=True,
                                            close_drafter=True, top_k=3)
    assert out.sequences.shape == reference.shape
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
    assert_target_could_sample(target, out.sequences, 6, top_k=3)



def test_an_intermediate_level_prices_its_tokens_by_its_own_step_until_its_rounds_are_timed():
    """Its first block (which holds its prefill) is not timed; until its rounds are, a token costs
    its model's T(1): priced at 0 it would run to the maximum whatever its confidence."""
    schedule = make_schedule("cost_aware", 8, 32, per_token=True, verifier_costs=Curve(lambda k: 0.15 + 0.005 * k),
                             step_seconds=0.045, static_check=False)
    assert schedule.seconds_per_token() == 0.045
    drafted = 0
    for confidence in [0.33, 0.24, 0.06, 0.38, 0.83, 0.07, 0.27, 0.22]:
        drafted += 1
        if not schedule.keep_drafting(confidence):
            break
    assert drafted < 8
    # no up-front back-off for an intermediate, even where one token per forward would not pay
    steep = make_schedule("cost_aware", 8, 32, per_token=True, verifier_costs=Curve(lambda k: 0.1 * k),
                          step_seconds=0.05, static_check=False)
    assert steep.length() == 32


# --- a batch as a whole -----------------------------------------------------------------------------
def _estimate(cost):
    from hf_polybasic.costs import CostCurve, CostEstimate

    return CostEstimate(CostCurve(points={k: cost(k) for k in (1, 2, 4, 8, 16)}))


def test_the_batch_gate_prices_a_batch_up_front_from_the_curves():
    from hf_polybasic.schedule.batch_gate import proposing_can_pay

    flat, linear, drafter = _estimate(lambda k: 0.1), _estimate(lambda k: 0.1 * k), _estimate(lambda k: 0.01)
    # memory-bound: four rows of several tokens for the price of one step; compute-bound: no draft pays
    assert proposing_can_pay(4, flat, drafter) and not proposing_can_pay(4, linear, drafter)
    # a machine that is flat up to 8 tokens: 2 rows can verify drafts for free, 8 rows cannot
    knee = _estimate(lambda k: 0.1 * max(1.0, k / 8))
    assert proposing_can_pay(2, knee, drafter) and not proposing_can_pay(8, knee, drafter)
    # a batch that can pay still starts with plain rounds, timed: the rate it must beat is measured
    assert BatchGate(4, linear, drafter).backoff.paused_for == MAX_BACKOFF_ROUNDS
    # the drafter's own steps count: one as dear as a target step leaves nothing to gain
    assert not proposing_can_pay(4, flat, _estimate(lambda k: 0.1)) and proposing_can_pay(4, flat, None)
    # k drafts per row are verified in a forward of rows * (k + 1) tokens: flat up to 4 tokens, 2 rows
    # can verify one draft each (4 tokens) but nothing more
    steep_after_4 = _estimate(lambda k: 0.1 if k <= 4 else 1.0)
    assert proposing_can_pay(2, steep_after_4, None)
    assert BatchGate(4, flat, drafter).backoff.paused_for == PLAIN_FIRST_ROUNDS


def test_the_batch_gate_backs_off_when_the_batchs_rounds_lose_by_the_clock():
    from hf_polybasic.schedule.batch_gate import WINDOW

    # the curve prices plain batched decoding at 4 tokens per 0.4 s (10 tokens/s); the gate never
    # takes that rate: it times plain rounds first (4 tokens per 0.1 s here, 40 tokens/s)
    gate = BatchGate(4, _estimate(lambda k: 0.4))
    gate.observe_round(20, 9.0, 4)  # the prefill: not judged
    for _ in range(PLAIN_FIRST_ROUNDS):
        assert gate.paused
        gate.observe_round(4, 0.1, 4)
    assert not gate.paused and gate.plain_rate() == pytest.approx(40.0)
    assert gate.window_tokens == 0 and gate.window_seconds == 0  # the first window counts its own rounds only
    assert gate.cap == BLIND_LENGTH and gate.window == 1  # short proposals, each round judged alone
    gate.observe_round(8, 0.3, 4)  # 26.7 tokens/s: a loss against the timed rate (a win against the curve's)
    assert gate.paused
    first_pause = gate.backoff.paused_for
    for _ in range(first_pause):  # sat out: plain rounds, timed, now slower (4 tokens per 0.4 s)
        gate.observe_round(4, 0.4, 4)
    assert not gate.paused and gate.plain_rate() < 26.0
    gate.observe_round(8, 0.3, 4)  # the same round now beats plain: the rows' schedules decide
    assert not gate.paused and gate.cap is None and gate.window == WINDOW
    assert gate.backoff.stretch == FIRST_BACKOFF_ROUNDS
    for _ in range(WINDOW):
        gate.observe_round(4, 0.8, 4)  # a window of 5 tokens/s rounds: sat out again
    assert gate.paused


def test_the_batch_gate_prices_the_drafters_prefill_against_what_the_budget_could_save():
    """After its plain rounds a batch proposes only if the drafter's prefill of every row's prompt (the
    target's prefill, timed, times the drafter's cost ratio: 0.2 here) plus the rest decoded with
    proposals beats the rest decoded plainly: a long prompt and a short budget never pay it (the
    drafter is never prefilled); a long budget does."""
    flat, drafter = _estimate(lambda k: 0.1), _estimate(lambda k: 0.02)

    def gate_after_plain_rounds(prompt_tokens, new_tokens):
        gate = BatchGate(4, flat, drafter)
        gate.budget(prompt_tokens, new_tokens)
        gate.observe_round(4, 20.0, 4)  # the prefill of 4000 prompt tokens: the drafter's would take 4 s
        for _ in range(PLAIN_FIRST_ROUNDS):
            gate.observe_round(4, 0.1, 4)
        return gate

    short = gate_after_plain_rounds(prompt_tokens=4000, new_tokens=6)
    assert not short.prefill_pays() and short.paused and short.backoff.paused_for == MAX_BACKOFF_ROUNDS
    long = gate_after_plain_rounds(prompt_tokens=4000, new_tokens=400)
    assert long.prefill_pays() and not long.paused and long.cap == BLIND_LENGTH
    unpriced = BatchGate(4, flat, None)  # a Drafter proposes: nothing to prefill, nothing priced
    unpriced.budget(4000, 6)
    assert unpriced.prefill_pays()


def test_plain_rounds_are_timed_per_row_down_to_one_row():
    """Plain batched decoding's rate is the rows' tokens per second: a round of 4 rows in 0.1 s is 40
    tokens/s, a round of the last row alone in 0.1 s is 10."""
    flat, drafter = _estimate(lambda k: 0.1), _estimate(lambda k: 0.02)
    for rows, rate in ((4, 40.0), (1, 10.0)):
        gate = BatchGate(rows, flat, drafter)
        gate.observe_round(rows, 1.0, rows)  # the prefill
        assert gate.backoff.paused
        gate.observe_round(rows, 0.1, rows)
        assert gate.plain_rate() == pytest.approx(rate)


def test_a_batch_that_rows_left_is_priced_again_as_the_smaller_batch_it_is():
    """A machine flat up to 8 tokens: 8 rows cannot draft, 2 rows can; when 6 rows are done and leave,
    the gate decides afresh and lets the 2 left draft (what the larger batch timed is dropped)."""
    knee, drafter = _estimate(lambda k: 0.1 * max(1.0, k / 8)), _estimate(lambda k: 0.01)
    gate = BatchGate(8, knee, drafter)
    assert gate.backoff.paused_for == MAX_BACKOFF_ROUNDS
    gate.observe_round(40, 5.0, 8)  # the prefill
    gate.observe_round(8, 0.1, 8)  # a plain round of 8 rows, timed
    assert gate.plain_seconds > 0 and gate.paused
    gate.observe_round(2, 0.1, 2)  # six rows left: timed afresh, plain rounds first
    assert gate.backoff.paused_for == PLAIN_FIRST_ROUNDS and gate.plain_seconds == 0
    assert gate.backoff.paused_rounds >= 1 and gate.cap == BLIND_LENGTH
    for _ in range(PLAIN_FIRST_ROUNDS):
        gate.observe_round(2, 0.1, 2)
    assert not gate.paused
    gate.observe_round(2, 0.1, 1)  # one row: timed afresh again
    assert gate.backoff.paused_for == PLAIN_FIRST_ROUNDS
    steep = BatchGate(2, _estimate(lambda k: 0.1 * k), drafter)
    steep.observe_round(10, 1.0, 2)
    steep.observe_round(2, 0.1, 1)  # a compute-bound machine: not even one row pays
    assert steep.backoff.paused_for == MAX_BACKOFF_ROUNDS


def _forced_gate(monkeypatch, threshold: float, drawn: bool = False, gate: str = "first_draft_pays") -> dict:
    """Every round that stops by confidence proposes a draft at the positions ``gate`` prices (its first:
    `first_draft_pays`; sampling, each later one: `next_draft_pays`) only where the chance that the draft's
    probability is at least 0.2 (the mass of that position's distribution in the calibration's bins from
    0.2 up, `draw_spread`, as `ModelDrafter` asks when sampling) is at least ``threshold``; the other gate
    passes every draft. For the negative control, the gates see the drawn token's own bin instead (a point
    mass there). Counts the gate's answers."""
    asked = {"passed": 0, "declined": 0}

    def forced(self, spread):
        assert isinstance(spread, list) and len(spread) == len(BIN_EDGES) + 1 and sum(spread) == pytest.approx(1.0)
        passes = sum(spread[1:]) >= threshold
        asked["passed" if passes else "declined"] += 1
        return passes

    other = {"first_draft_pays": "next_draft_pays", "next_draft_pays": "first_draft_pays"}[gate]
    monkeypatch.setattr(CostAwareSchedule, gate, forced)
    monkeypatch.setattr(CostAwareSchedule, other, lambda self, spread: True)
    if drawn:
        draw = ModelDrafter.draw

        def drawn_bin(self, *args):
            made = draw(self, *args)
            if made.top is None:
                return made
            edges = torch.tensor(BIN_EDGES, dtype=made.top.dtype)
            point = torch.zeros_like(made.top)
            point[torch.bucketize(made.confidence.reshape(1), edges, right=True)] = 1.0
            return dataclasses.replace(made, top=point)

        monkeypatch.setattr(ModelDrafter, "draw", drawn_bin)
    return asked


def _gated_counts(distribution_models, seed: int):
    target, assistant = distribution_models[:2]
    with simulated_machine(cheap_drafting_costs(target, [assistant])) as simulated:
        return sample_counts(target, "temperature+top_k+top_p", [assistant], seed=seed, generate=simulated,
                             num_draft_tokens=2, block_threshold=2, schedule="cost_aware")


@pytest.mark.parametrize("reads", ["host", "device"])
def test_rounds_declined_by_their_first_top_probability_sample_the_target_distribution(
        reads, request, distribution_models, exact_distribution, monkeypatch):
    """Rounds that propose only where the drafter's distribution at their first position puts enough
    mass on probabilities of 0.2 and more (`first_draft_pays`, forced so; `_forced_gate`): a property
    of the distribution, decided before the draw is kept, so sampling stays exact; on the host
    (`_keep_step`) and where drafts are read with the verifier's decision (`_cut_by_confidence`, the
    device path)."""
    if reads == "device":
        request.getfixturevalue("drafts_read_with_the_decision")
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    asked = _forced_gate(monkeypatch, 0.55)  # the tiny models put 0.46 - 0.64 of their mass there
    counts, stats = _gated_counts(distribution_models, seed=11)
    assert_every_level_took_part(stats)
    assert asked["passed"] > 0 and asked["declined"] > 0, asked
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) > ALPHA


def test_negative_control_rounds_declined_by_their_drawn_tokens_probability_are_caught(
        distribution_models, exact_distribution, monkeypatch):
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    asked = _forced_gate(monkeypatch, 0.55, drawn=True)
    counts, stats = _gated_counts(distribution_models, seed=11)
    assert_every_level_took_part(stats)
    assert asked["passed"] > 0 and asked["declined"] > 0, asked
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) < ALPHA


def test_sampled_rounds_stopped_before_a_later_position_by_its_distribution_sample_the_target_distribution(
        distribution_models, exact_distribution, monkeypatch):
    """Sampled rounds that stop before a later draft where the drafter's distribution at that position puts
    too little mass on probabilities of 0.2 and more (`next_draft_pays`, forced so; `_forced_gate`): decided
    from the position's distribution before its draw counts, a stopping rule, so sampling stays exact; the
    drafts it stops before are counted as withheld."""
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    asked = _forced_gate(monkeypatch, 0.55, gate="next_draft_pays")
    counts, stats = _gated_counts(distribution_models, seed=11)
    assert_every_level_took_part(stats)
    assert asked["passed"] > 0 and asked["declined"] > 0, asked
    assert stats.levels[1].withheld == asked["declined"]
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) > ALPHA


def test_negative_control_later_drafts_withheld_by_their_drawn_tokens_probability_are_caught(
        distribution_models, exact_distribution, monkeypatch):
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    asked = _forced_gate(monkeypatch, 0.55, drawn=True, gate="next_draft_pays")
    counts, stats = _gated_counts(distribution_models, seed=11)
    assert_every_level_took_part(stats)
    assert asked["passed"] > 0 and asked["declined"] > 0, asked
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) < ALPHA
