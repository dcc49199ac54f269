"""The chain's shape follows Theorem 3.2 (issue 30, item 2): a middle level takes part only while
inserting it pays, on the machine and the text at hand (`hf_polybasic.schedule.ShapeGate`); and the
drafter only while the middle level drafting on its own is not clearly faster (issue 35, item 5).

Simulated machines make it deterministic: one where the middle level costs nearly a target forward
(it does not pay: the default must run about as fast as the drafter alone under the target, not
slower than plain decoding as it did), one where it is cheap and agrees closely (it pays: the
default must stay a three-model chain). Bypassed rounds are exact (greedy against plain generate,
sampling against the exact distribution, with a negative control), and so are rounds with the
drafter dropped.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import ALPHA, chi_square_p_value, sample_counts

import hf_polybasic as hp
from hf_polybasic.decoding.round import IntermediateLevel
from hf_polybasic.decoding.protocol import Proposal
from hf_polybasic.schedule import batch_gate, shape_gate
from hf_polybasic.schedule.calibration import CALIBRATED_OBSERVATIONS, ConfidenceCalibration
from hf_polybasic.schedule.cost_aware import CostAwareSchedule
from hf_polybasic.schedule.shape_gate import (BYPASSED, DROPPED, EXTRA_ROUNDS, FIRST_STRETCH, IN, IN_ROUNDS, OUT_ROUNDS,
                                              PROBE_ROUNDS, ShapeGate)
from hf_polybasic.testing import cheap_drafting_costs, noisy_copy, prompt, simulated_machine, tiny_chain


@pytest.fixture(autouse=True)
def forget_shapes(monkeypatch):
    """Every test starts without what earlier calls of its models taught (`shape_gate.remembered`,
    the calibrations) and sees the once-per-process warnings afresh."""
    from hf_polybasic.decoding import build as chain
    from hf_polybasic.schedule import calibration

    monkeypatch.setattr(shape_gate, "remembered", shape_gate._Memory())
    monkeypatch.setattr(calibration, "remembered", calibration._Remembered())
    monkeypatch.setattr(chain, "_warned_sat_out", set())


# --- the gate's phases and verdicts, on their own ------------------------------------------------------
FLAT = (lambda k: 1.0, lambda k: 0.8, lambda k: 0.02)  # above, middle, drafter


def _feed(gate: ShapeGate, rounds: int, inside=(3, 2, 4, (2, 5, 4)), outside=(3, 3, 3)) -> list[bool]:
    """``rounds`` observations in whatever shape the gate is in; the shapes it was in."""
    shapes = []
    for _ in range(rounds):
        shapes.append(gate.bypassed)
        if gate.bypassed:
            gate.observe(1, *outside)
        else:
            gate.observe(1, *inside)
    return shapes


def test_the_gate_measures_both_shapes_then_runs_the_one_theorem_3_2_picks():
    gate = ShapeGate(FLAT)
    # in: the level above emits 3 tokens per verification of 2-token blocks from the middle level, which
    # verifies twice per block (5 tokens emitted of 4 drafted); out: 3 emitted of 3 drafted
    shapes = _feed(gate, IN_ROUNDS + OUT_ROUNDS + 1)
    assert shapes[:IN_ROUNDS + OUT_ROUNDS] == [False] * IN_ROUNDS + [True] * OUT_ROUNDS
    assert gate.decisions == 1 and gate.verdict is not None
    # the middle costs 0.8 per forward, twice per block of the level above, for no gain in its acceptance:
    # it does not pay, and the drafter proposes straight to the level above for a stretch, then a probe
    assert not gate.verdict.helps and gate.bypassed
    shapes = _feed(gate, FIRST_STRETCH - 1 + PROBE_ROUNDS)
    assert shapes == [True] * (FIRST_STRETCH - 1) + [False] * PROBE_ROUNDS
    assert gate.decisions == 2 and gate.bypassed


def test_a_cheap_middle_level_that_raises_acceptance_stays_in():
    gate = ShapeGate((lambda k: 1.0, lambda k: 0.05, lambda k: 0.01))
    shapes = _feed(gate, IN_ROUNDS + OUT_ROUNDS + FIRST_STRETCH, inside=(8, 7, 10, (3, 9, 9)), outside=(2, 4, 4))
    assert gate.verdict.helps and shapes[IN_ROUNDS + OUT_ROUNDS :] == [False] * FIRST_STRETCH
    assert gate.bypassed_rounds == OUT_ROUNDS


def test_a_middle_level_that_never_proposes_is_bypassed_without_a_verdict():
    gate = ShapeGate(FLAT)
    _feed(gate, IN_ROUNDS + OUT_ROUNDS, inside=(1, 0, 0, (0, 0, 0)))
    assert gate.bypassed and gate.verdict is None and "never proposed" in gate.describe()


def test_rounds_where_the_middle_level_proposed_nothing_are_not_counted_for_it():
    gate = ShapeGate(FLAT)
    gate.observe(1, 1, 0, 0, (0, 0, 0))
    assert gate.sums[IN].rounds == 0
    gate.observe(1, 3, 2, 4, (2, 5, 4))
    assert gate.sums[IN].rounds == 1


def test_the_verdict_in_words_states_the_theorems_milliseconds():
    gate = ShapeGate(FLAT)
    _feed(gate, IN_ROUNDS + OUT_ROUNDS)
    verdict = gate.verdict
    saving = 1e3 * (verdict.upper_saving_per_token + verdict.lower_saving_per_token)
    assert f"costs {1e3 * verdict.new_cost_per_token:.3g} ms per token" in gate.describe()
    assert f"saves {saving:.3g} ms per token" in gate.describe()


def test_a_verdict_kept_doubles_the_stretch_and_a_changed_one_starts_it_again():
    gate = ShapeGate(FLAT)
    _feed(gate, IN_ROUNDS + OUT_ROUNDS)  # the first verdict: out, for the first stretch
    _feed(gate, FIRST_STRETCH + PROBE_ROUNDS)  # the stretch, a probe, the same verdict
    assert gate.decisions == 2 and gate.bypassed
    shapes = _feed(gate, 2 * FIRST_STRETCH)  # kept: the stretch is twice as long before the next probe
    assert shapes == [True] * (2 * FIRST_STRETCH)


def test_a_later_call_of_the_same_chain_starts_in_the_last_verdicts_shape():
    models = tuple(torch.nn.Linear(1, 1) for _ in range(3))
    first = ShapeGate(FLAT, models)
    _feed(first, IN_ROUNDS + OUT_ROUNDS)
    assert first.bypassed
    later = ShapeGate(FLAT, models)
    assert later.bypassed and _feed(later, FIRST_STRETCH) == [True] * FIRST_STRETCH
    other = ShapeGate(FLAT, (models[0], models[1], torch.nn.Linear(1, 1)))  # another drafter: learns afresh
    assert not other.bypassed


def test_calls_shorter_than_the_first_measurements_share_one_measuring():
    """A call that ends before the gate's first verdict leaves its measuring phase to the next call of
    the same chain (`ShapeGate.keep`, at the chain's finish): calls shorter than the measuring reach a
    verdict between them, instead of each measuring the in shape again and never deciding."""
    models = tuple(torch.nn.Linear(1, 1) for _ in range(3))
    first = ShapeGate(FLAT, models)
    assert _feed(first, IN_ROUNDS + 1) == [False] * IN_ROUNDS + [True]  # ends one round into the bypassed shape
    first.keep()
    second = ShapeGate(FLAT, models)
    assert second.bypassed and second.decisions == 0  # goes on measuring the bypassed shape
    assert _feed(second, OUT_ROUNDS - 1) == [True] * (OUT_ROUNDS - 1)
    assert second.decisions == 1 and second.bypassed  # the verdict, after the measuring rounds of both calls
    second.keep()  # a verdict was given: what observe remembered at it stands
    third = ShapeGate(FLAT, models)
    assert third.bypassed and _feed(third, FIRST_STRETCH) == [True] * FIRST_STRETCH
    # the negative control: a call whose gate is not kept leaves nothing, and the next measures afresh
    others = tuple(torch.nn.Linear(1, 1) for _ in range(3))
    _feed(ShapeGate(FLAT, others), IN_ROUNDS + 1)
    assert not ShapeGate(FLAT, others).bypassed


def _course(gate_for, rounds: int, split: int | None) -> list[tuple]:
    """Each round's shape, the gate's verdicts so far and its latest Lemma 3.1 times, over ``rounds``
    rounds of one call, or of two calls split after round ``split`` (the first gate kept, a second
    made for the same models). Round i (counted over both calls) is left out of the sums
    (uncalibrated) in the in shape's first measuring and where i % 5 == 0, and the blocks and drafts
    change with i, so every measurement the gate carries shows in its verdicts."""
    gate, course = gate_for(), []
    for i in range(rounds):
        if i == split:
            gate.keep()
            gate = gate_for()
        uncalibrated, extra = (gate.shape == IN and i < 12) or i % 5 == 0, i % 3
        course.append((gate.shape, gate.decisions, tuple(sorted(gate.times.items()))))
        if gate.shape == IN:
            gate.observe(1, 3 + extra, 2 + extra, 4, (2, 5 + extra, 4), uncalibrated)
        else:
            gate.observe(1, *((3, 3, 3) if gate.shape == BYPASSED else (4 + extra, 3, 3)), (0, 0, 0), uncalibrated)
    return course


def test_splitting_a_call_before_the_first_verdict_does_not_change_the_gates_course():
    """Two calls split anywhere before the first verdict run the gate as one call of their rounds
    would: the measuring phase, the rounds it added for rounds left out, the sums (counted and left
    out), all carry over. A call that starts after a verdict starts a first stretch in the verdict's
    shape, then probes the shape that ran longest ago, counted over the calls before."""
    costs = (lambda k: 1.0, lambda k: 0.3, lambda k: 0.02)
    models = tuple(torch.nn.Linear(1, 1) for _ in range(3))
    whole = _course(lambda: ShapeGate(costs, drops=True), 80, None)
    shapes = [shape for shape, _, _ in whole]
    first_verdict = next(i for i, (_, decisions, _) in enumerate(whole) if decisions)
    # the in shape's phase ran EXTRA_ROUNDS longer for its rounds left out; a bypassed round was left out
    assert shapes[:first_verdict] == [IN] * (IN_ROUNDS + EXTRA_ROUNDS) + [BYPASSED] * 4 + [DROPPED] * 4
    for split in range(1, first_verdict):
        shape_gate.remembered = shape_gate._Memory()
        assert _course(lambda: ShapeGate(costs, models, drops=True), 80, split) == whole, split
    # the second verdict (round 33) picks the dropped shape after a probe of the in shape. A later call
    # (from round 36) probes after its first stretch the shape that ran longest ago, the bypassed one;
    # after its second (kept: twice as long), the in shape, last run in the first call (rounds count
    # over the calls)
    assert shapes[30:34] == [IN] * 3 + [DROPPED] and whole[34][1] == 2
    shape_gate.remembered = shape_gate._Memory()
    later = [shape for shape, _, _ in _course(lambda: ShapeGate(costs, models, drops=True), 75, 36)]
    assert later[36:] == [DROPPED] * FIRST_STRETCH + [BYPASSED] * PROBE_ROUNDS + [DROPPED] * 2 * FIRST_STRETCH + [IN]


def test_short_calls_of_a_chain_whose_middle_level_does_not_pay_come_to_bypass_it():
    """End to end on the costly-middle machine: calls of 6 tokens (3 target rounds) end before a first
    verdict. Kept between calls, the measuring of the three shapes ends within 7 calls and later calls
    bypass the middle level from their first round, faster on the whole than the first calls, which
    run it throughout as every call did before (0.93 s per token; 0.73 on average once bypassed,
    0.52 - 1.05 by call: ``-s`` prints each call); each call equals plain generate."""
    target, middle, draft, costs = _machine(0.8, 0.01, 0.02, 0.3)
    verdicts, per_token = [], []
    with warnings.catch_warnings(), simulated_machine(costs) as generate:
        warnings.simplefilter("ignore")
        for seed in range(12):
            out = target.generate(prompt(8, seed=seed), custom_generate=generate, assistant_models=[middle, draft],
                                  do_sample=False, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True)
            assert torch.equal(out.sequences, target.generate(prompt(8, seed=seed), do_sample=False, max_new_tokens=6,
                                                              eos_token_id=None))
            stats = out.polybasic_stats
            verdicts.append(stats.levels[1].bypassed_rounds == stats.levels[0].verifications)
            per_token.append(stats.seconds / stats.new_tokens)
            print(f"call {seed + 1}: {per_token[-1]:.3f} s/token, bypassed throughout: {verdicts[-1]}")
    assert verdicts[-4:] == [True] * 4, verdicts
    bypassed = [t for t, throughout in zip(per_token, verdicts) if throughout]
    assert sum(bypassed) / len(bypassed) < 0.85 * sum(per_token[:3]) / 3, per_token


# --- on simulated machines -----------------------------------------------------------------------------
# the gate's tests run without the drafter's alternatives (`PolybasicConfig.draft_alternatives`):
# Theorem 3.2 and Lemma 3.1 do not price them, and the best chains the gate chooses among are priced without
WITHOUT_ALTERNATIVES = hp.PolybasicConfig(draft_alternatives=0)


def _seconds_per_token(target, chain, costs, seeds=range(4), new_tokens=48, config=WITHOUT_ALTERNATIVES):
    seconds = tokens = 0.0
    for seed in seeds:
        with simulated_machine(costs) as generate:
            out = target.generate(prompt(8, seed=seed), custom_generate=generate, assistant_models=chain,
                                  do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                  return_dict_in_generate=True, polybasic_config=config)
        assert torch.equal(out.sequences, target.generate(prompt(8, seed=seed), do_sample=False,
                                                          max_new_tokens=new_tokens, eos_token_id=None))
        seconds, tokens = seconds + out.polybasic_stats.seconds, tokens + out.polybasic_stats.new_tokens
    return seconds / tokens, out.polybasic_stats


def _machine(middle_cost: float, middle_noise: float, draft_cost: float, draft_noise: float):
    target = tiny_chain("llama", depth=1, seed=1)[0]
    middle, draft = noisy_copy(target, middle_noise, 11), noisy_copy(target, draft_noise, 12)
    costs = {target: lambda n: 1.0, middle: lambda n: middle_cost, draft: lambda n: draft_cost}
    return target, middle, draft, costs


def test_a_costly_middle_level_sits_out_and_says_so(monkeypatch):
    """The issue's machine: a target at 1.0 per forward, a middle level at 0.8 that agrees closely, a
    drafter at 0.02 that agrees less. Without the gate the default given both ran about as slow as
    plain decoding (1.0 per token here); with it, within 10 % of the drafter alone under the target."""
    target, middle, draft, costs = _machine(0.8, 0.01, 0.02, 0.3)
    alone, _ = _seconds_per_token(target, [draft], {target: costs[target], draft: costs[draft]})
    with pytest.warns(UserWarning, match=r"let M2 LlamaForCausalLM sit out: the chain ran faster without it \(Theorem 3.2"):
        both, stats = _seconds_per_token(target, [middle, draft], costs)
    assert both <= 1.1 * alone < 1.0
    assert stats.levels[1].bypassed_rounds > stats.levels[0].verifications / 2 and "Theorem 3.2" in stats.levels[1].sat_out
    assert stats.levels[1].insertion_saving < 0
    # the gate's negative control: one that never moves (and remembers nothing) runs the middle level throughout
    monkeypatch.setattr(ShapeGate, "observe", lambda self, *args: None)
    monkeypatch.setattr(shape_gate, "remembered", shape_gate._Memory())
    ungated, _ = _seconds_per_token(target, [middle, draft], costs)
    assert ungated > 1.1 * both


def test_a_cheap_middle_level_that_agrees_closely_takes_part(monkeypatch):
    """The middle level stays in. (Its calls make 2 to 8 target rounds each, so the gate's first
    measurings span calls, `ShapeGate.keep`; they may drop the drafter, the middle level drafting on
    its own: measured 0.11 - 0.13 s per token that way against 0.13 with the drafter.)"""
    target, middle, draft, costs = _machine(0.05, 0.01, 0.005, 0.6)
    alone, _ = _seconds_per_token(target, [draft], {target: costs[target], draft: costs[draft]})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hf_polybasic let M2")  # the middle level does not sit out
        both, stats = _seconds_per_token(target, [middle, draft], costs)
    assert both < 0.5 * alone
    assert stats.levels[1].bypassed_rounds == 0 and stats.levels[1].sat_out == ""  # the last call: remembered


# --- bypassed rounds are exact ---------------------------------------------------------------------------
def _every_gate_starts(monkeypatch, shape: str) -> None:
    """Every gate starts in ``shape`` (the distribution tests' samples are 3 tokens long, shorter than
    the first phase), and the batch of samples proposes from its first round."""
    start = ShapeGate.__init__

    def at_once(self, *args, **kwargs):
        start(self, *args, **kwargs)
        self.shape, self._left = shape, OUT_ROUNDS

    monkeypatch.setattr(ShapeGate, "__init__", at_once)
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)


def _sampled(distribution_models, shape_rounds: str, seed: int = 23):
    """Sampled counts and statistics of [middle, drafter] on a machine where drafting pays; the
    statistic ``shape_rounds`` ("bypassed_rounds" of the middle level or "dropped_rounds" of the
    drafter) shows the shape ran."""
    target, *assistants = distribution_models[:3]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        counts, stats = sample_counts(target, "temperature+top_k+top_p", assistants, seed=seed, generate=generate,
                                      block_threshold=2)
    level = 1 if shape_rounds == "bypassed_rounds" else 2
    assert getattr(stats.levels[level], shape_rounds) > 0
    return counts, stats


@pytest.fixture
def bypass_early(monkeypatch):
    _every_gate_starts(monkeypatch, BYPASSED)


def test_bypassed_rounds_sample_the_target_distribution(bypass_early, distribution_models, exact_distribution):
    counts, stats = _sampled(distribution_models, "bypassed_rounds")
    target, middle, drafter = stats.levels
    # the drafter's samples went straight to the target, which accepted some and rejected some
    assert drafter.proposed > 0 and 0 < target.accepted < target.drafted and middle.verifications == 0
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) > ALPHA


def test_negative_control_a_bypass_that_reports_the_wrong_positions_distribution(
        bypass_early, distribution_models, exact_distribution, monkeypatch):
    """Sampled drafts handed up with each position's distribution shifted by one (the drafter's q of the
    next position): the same test fails, so it has the power to see a bypass's mistakes. (Handing them
    up as point masses would not: the point-mass rule is exact for drafts chosen in any way.)"""
    bypass = IntermediateLevel._bypass

    def shifted(self, requests):
        return {row: Proposal(p.tokens, None if p.probs is None else p.probs.roll(1, dims=0), p.ids)
                for row, p in bypass(self, requests).items()}

    monkeypatch.setattr(IntermediateLevel, "_bypass", shifted)
    counts, _ = _sampled(distribution_models, "bypassed_rounds")
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) < ALPHA


# --- the third shape: the drafter dropped, the middle level drafting on its own ------------------------
def _feed3(gate: ShapeGate, rounds: int, inside=(3, 2, 4, (2, 5, 4)), outside=(3, 3, 3), direct=(4, 3, 3),
           uncalibrated=False) -> list[str]:
    """``rounds`` observations in whatever of the three shapes the gate is in; the shapes it was in."""
    shapes = []
    for _ in range(rounds):
        shapes.append(gate.shape)
        if gate.shape == IN:
            gate.observe(1, *inside[:3], inside[3], uncalibrated)
        else:
            gate.observe(1, *(outside if gate.shape == BYPASSED else direct), (0, 0, 0), uncalibrated)
    return shapes


def test_a_gate_that_can_drop_the_drafter_measures_the_three_shapes_then_picks_by_lemma_3_1():
    # a middle level at 0.3 per forward, a drafter at 0.02: through the middle level the target emits 3
    # tokens per round, the drafter alone 1 of 3 drafted, the middle level alone 9 of 8 drafted in 8 forwards
    gate = ShapeGate((lambda k: 1.0, lambda k: 0.3, lambda k: 0.02), drops=True)
    shapes = _feed3(gate, IN_ROUNDS + 2 * OUT_ROUNDS + 1, inside=(3, 2, 4, (2, 3, 4)), outside=(1, 3, 3),
                    direct=(9, 8, 8))
    assert shapes[: IN_ROUNDS + 2 * OUT_ROUNDS] == [IN] * IN_ROUNDS + [BYPASSED] * OUT_ROUNDS + [DROPPED] * OUT_ROUNDS
    assert gate.decisions == 1 and gate.dropped and shapes[-1] == DROPPED
    # Lemma 3.1 on each shape's counts: (1 + 8 * 0.3) / 9 alone against (1 + 2 * 0.3 + 4 * 0.02) / 3 through
    # it (which Theorem 3.2 prefers to the drafter alone): more than DROP_MARGIN less
    assert gate.times[DROPPED] == pytest.approx(3.4 / 9) and gate.times[IN] == pytest.approx(1.68 / 3)
    assert gate.verdict.helps and "378 ms per token" in gate.describe_drop() and "560 ms" in gate.describe_drop()
    # after a stretch the shape measured longest ago is probed (in), then the verdict is taken again
    shapes = _feed3(gate, FIRST_STRETCH - 1 + PROBE_ROUNDS, inside=(3, 2, 4, (2, 3, 4)), outside=(1, 3, 3),
                    direct=(9, 8, 8))
    assert shapes == [DROPPED] * (FIRST_STRETCH - 1) + [IN] * PROBE_ROUNDS
    assert gate.decisions == 2 and gate.dropped and gate.dropped_rounds == OUT_ROUNDS + FIRST_STRETCH
    assert gate.probe_rounds[DROPPED] == OUT_ROUNDS


def test_the_drafter_stays_where_the_middle_level_alone_is_not_clearly_faster_than_it_alone():
    gate = ShapeGate((lambda k: 1.0, lambda k: 0.3, lambda k: 0.02), drops=True)
    # Theorem 3.2 bypasses the middle level; alone it costs (1 + 3 * 0.3) / 4 = 0.475 s per token, the
    # drafter alone (1 + 3 * 0.02) / 2 = 0.53: less, but not by DROP_MARGIN (a few noisy probe rounds)
    _feed3(gate, IN_ROUNDS + 2 * OUT_ROUNDS, inside=(2, 1, 4, (2, 2, 4)), outside=(2, 3, 3), direct=(4, 3, 3))
    assert not gate.verdict.helps and gate.times[DROPPED] < gate.times[BYPASSED]
    assert gate.shape == BYPASSED and gate.dropped_rounds == OUT_ROUNDS


def test_a_bypass_that_cannot_pay_even_at_its_best_is_never_probed():
    # a middle level at 0.12 whose 4-token blocks the target accepts whole, over a drafter whose 12 drafts per
    # block it rejects all of: the target accepts the drafter's drafts at most as often as the middle level does
    # (never) plus the rate at which it rejects the middle level's (never), so the drafter alone is plain decoding
    # at best (1.0 s per token), against 0.2 + (0.12 + 3 * 0.02) / 1.25 = 0.344 with the middle level in
    costs = (lambda k: 1.0, lambda k: 0.12, lambda k: 0.02)
    gate = ShapeGate(costs, drops=True)
    shapes = _feed3(gate, IN_ROUNDS + OUT_ROUNDS + FIRST_STRETCH + PROBE_ROUNDS, inside=(5, 4, 12, (4, 4, 12)),
                    direct=(5, 4, 4))
    assert gate.bypassed_at_best() == pytest.approx(1.0) and gate.ruled_out(BYPASSED)
    # in, then the dropped shape measured, picked (0.296 s per token) and, after its stretch, in probed again
    assert shapes == [IN] * IN_ROUNDS + [DROPPED] * (OUT_ROUNDS + FIRST_STRETCH) + [IN] * PROBE_ROUNDS
    assert gate.bypassed_rounds == 0 and gate.verdict is None and gate.decisions == 2
    # a drafter the middle level accepts 2 tokens of 3 from (a = 0.8): it could pay straight to the target
    # (the bound reads the acceptance back from the mean length, 1 + a + a^2 + a^3)
    gate = ShapeGate(costs, drops=True)
    shapes = _feed3(gate, IN_ROUNDS + OUT_ROUNDS, inside=(5, 4, 12, (4, 4 * (1 + 0.8 + 0.8**2 + 0.8**3), 12)))
    assert shapes == [IN] * IN_ROUNDS + [BYPASSED] * OUT_ROUNDS and not gate.ruled_out(BYPASSED)
    assert shape_gate._acceptance(1 + 0.8 + 0.8**2 + 0.8**3, 3) == pytest.approx(0.8, abs=1e-6)


def test_rounds_cut_by_an_uncalibrated_stop_give_no_verdict():
    gate = ShapeGate(FLAT, drops=True)
    # every in round's blocks were cut by a schedule still on its prior: none is counted, and the phase runs
    # up to EXTRA_ROUNDS longer to make up for them
    shapes = _feed3(gate, EXTRA_ROUNDS + IN_ROUNDS, uncalibrated=True)
    assert shapes == [IN] * (EXTRA_ROUNDS + IN_ROUNDS) and gate.sums[IN].rounds == 0 and gate.uncalibrated[IN].rounds > 0
    assert gate.shape == BYPASSED
    # calibrated rounds of the other shapes are what a verdict weighs; a shape with no calibrated round is
    # judged on the rounds it ran rather than on nothing
    _feed3(gate, 2 * OUT_ROUNDS)
    assert gate.decisions == 1 and gate.sums[BYPASSED].rounds > 0 and gate.sums[DROPPED].rounds > 0
    assert gate.evidence(IN) is gate.uncalibrated[IN] and gate.evidence(BYPASSED) is gate.sums[BYPASSED]
    # one calibrated round of a shape outweighs any number of uncalibrated ones
    before = gate.sums[BYPASSED].rounds
    gate.shape = BYPASSED
    gate.observe(1, 1, 3, 3, (0, 0, 0), True)
    assert gate.sums[BYPASSED].rounds == before


def test_a_calibration_is_trusted_after_enough_revealed_drafts_here_or_carried():
    from hf_polybasic.schedule import calibration

    fresh = ConfidenceCalibration()
    assert not fresh.calibrated
    fresh.observe([0.9] * CALIBRATED_OBSERVATIONS, CALIBRATED_OBSERVATIONS)
    assert fresh.calibrated
    memory, models = calibration._Remembered(), (torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    memory.keep(*models, fresh)
    assert memory.start(*models).calibrated and memory.start(*models).observations == 0
    # a middle level drafting in place of a drafter keeps its own calibration, under the three models
    assert not memory.start(*models, within=(torch.nn.Linear(1, 1),)).calibrated
    # the schedule counts its answers given on the prior: the rounds the gate leaves out
    schedule = CostAwareSchedule(4, 8, per_token=True, verifier_costs=None, step_seconds=0.01)
    schedule.keep_drafting(0.5)
    assert schedule.uncalibrated_answers == 1
    schedule.calibration = fresh
    schedule.keep_drafting(0.5)
    assert schedule.uncalibrated_answers == 1


# the chains a user's levels [middle, drafter] allow, each under the default schedule and the constant one
# (K = 4, mu = 8); each chain's calls start from nothing learned (calibrations, verdicts)
def _chains(middle, draft):
    constant = hp.PolybasicConfig(schedule="constant", draft_alternatives=0)
    return {"[middle]": ([middle], WITHOUT_ALTERNATIVES), "[drafter]": ([draft], WITHOUT_ALTERNATIVES),
            "[middle] constant": ([middle], constant),
            "[drafter] constant": ([draft], constant), "[middle, drafter] constant": ([middle, draft], constant)}


def _fresh_seconds_per_token(target, chain, costs, config=None, seeds=range(3), new_tokens=96):
    from hf_polybasic.schedule import calibration

    shape_gate.remembered = shape_gate._Memory()
    calibration.remembered = calibration._Remembered()
    seconds = tokens = 0.0
    for seed in seeds:
        with simulated_machine({m: costs[m] for m in [target, *chain]}) as generate:
            extra = {} if config is None else {"polybasic_config": config}
            out = target.generate(prompt(8, seed=seed), custom_generate=generate, assistant_models=chain,
                                  do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                  return_dict_in_generate=True, **extra)
        assert torch.equal(out.sequences, target.generate(prompt(8, seed=seed), do_sample=False,
                                                          max_new_tokens=new_tokens, eos_token_id=None))
        seconds, tokens = seconds + out.polybasic_stats.seconds, tokens + out.polybasic_stats.new_tokens
    return seconds / tokens, out.polybasic_stats


def _cpu_like(seconds: float):
    """A forward scoring n tokens costs 5 % more per token past the first (a CPU's verification grows)."""
    return lambda n: seconds * (1 + 0.05 * (n - 1))


def _gpu_like(seconds: float):
    return lambda n: seconds


MACHINES = {  # middle: cost, noise; drafter: cost, noise; the cost curve
    "costly middle": (0.8, 0.01, 0.02, 0.3, _gpu_like),
    "cheap close middle": (0.12, 0.01, 0.02, 0.3, _cpu_like),
    "gpu-like": (0.45, 0.01, 0.1, 0.3, _gpu_like),
}
# the default's seconds per token against the best chain the levels allow (issue 35's target: the first
# call's measuring rounds are what the default pays over the best)
BOUND = 1.05


@pytest.mark.parametrize("machine", list(MACHINES))
def test_the_default_given_middle_and_drafter_is_about_as_fast_as_the_best_chain_they_allow(machine):
    middle_cost, middle_noise, draft_cost, draft_noise, curve = MACHINES[machine]
    target = tiny_chain("llama", depth=1, seed=1)[0]
    middle, draft = noisy_copy(target, middle_noise, 11), noisy_copy(target, draft_noise, 12)
    costs = {target: curve(1.0), middle: curve(middle_cost), draft: curve(draft_cost)}
    seconds = {name: _fresh_seconds_per_token(target, chain, costs, config)[0]
               for name, (chain, config) in _chains(middle, draft).items()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        default, stats = _fresh_seconds_per_token(target, [middle, draft], costs, WITHOUT_ALTERNATIVES)
    # with the alternatives (the default), the rounds that reach the target from a model drafter score them:
    # never slower than without (a three-model default trails the two-model one with them, which
    # Theorem 3.2 does not price: on "costly middle" 0.54 s a token against 0.47)
    with_alternatives, used = _fresh_seconds_per_token(target, [middle, draft], costs)
    assert with_alternatives <= 1.02 * default
    if machine != "cheap close middle":  # the drafter bypasses the middle level, or the middle one drafts alone
        assert used.levels[0].alternative_hits > 0
    best = min(seconds.values())
    print(machine, f"default {default:.3f}", {name: round(value, 3) for name, value in seconds.items()},
          f"ratio {default / best:.3f}")
    assert default <= BOUND * best and default < 1.0  # plain decoding: 1.0 s per token
    if machine != "costly middle":  # the middle level alone is the best there: the drafter sat out, and said so
        assert stats.levels[2].dropped_rounds > stats.levels[0].verifications / 2
        assert "Lemma 3.1" in stats.levels[2].sat_out
        assert any(re.search(r"let M3 LlamaForCausalLM sit out: the chain ran faster without it \(Lemma 3.1.*"
                             r"\(dropped_rounds\)", str(w.message)) for w in said)


# --- dropped rounds are exact ----------------------------------------------------------------------------
@pytest.fixture
def drop_early(monkeypatch):
    _every_gate_starts(monkeypatch, DROPPED)


def test_dropped_rounds_sample_the_target_distribution(drop_early, distribution_models, exact_distribution):
    counts, stats = _sampled(distribution_models, "dropped_rounds")
    target, middle, drafter = stats.levels
    # the middle level's samples went straight to the target, which accepted some and rejected some
    assert middle.proposed > 0 and 0 < target.accepted < target.drafted
    assert middle.verifications == 0 and drafter.proposed == 0
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) > ALPHA


def test_negative_control_a_drop_that_reports_the_wrong_positions_distribution(
        drop_early, distribution_models, exact_distribution, monkeypatch):
    """The middle level's sampled drafts handed up with each position's distribution shifted by one: the
    same test fails, so it can see a dropped round's mistakes."""
    drop = IntermediateLevel._drop

    def shifted(self, requests):
        return {row: Proposal(p.tokens, None if p.probs is None else p.probs.roll(1, dims=0), p.ids)
                for row, p in drop(self, requests).items()}

    monkeypatch.setattr(IntermediateLevel, "_drop", shifted)
    counts, _ = _sampled(distribution_models, "dropped_rounds")
    assert chi_square_p_value(counts, exact_distribution("temperature+top_k+top_p")) < ALPHA


def test_what_the_middle_level_drafting_alone_learned_is_kept_for_it_proposing_to_the_level_above(drop_early):
    """With the drafter dropped the middle level drafts straight to the target, under a calibration of
    its own: what it learned there (the target's acceptance of its drafts by its confidences) is kept
    for the next call of this chain under the pair that judged those drafts, the middle level
    proposing to the target (a pair keyed by the drafter below instead would hand it to a chain with
    another target above the same two models)."""
    from hf_polybasic.schedule import calibration

    target, middle, draft, _ = _machine(0.05, 0.01, 0.005, 0.6)
    with simulated_machine(cheap_drafting_costs(target, [middle, draft])) as generate:
        out = target.generate(prompt(8, seed=1), custom_generate=generate, assistant_models=[middle, draft],
                              do_sample=False, max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    assert out.polybasic_stats.levels[2].dropped_rounds > 0
    assert calibration.remembered.start(middle, target, (draft,)).carried > 0
