"""The call's ledger against plain decoding (`hf_polybasic.schedule.ledger`): its arithmetic, the
schedule it stops, and on a simulated machine a chain whose estimates say drafting pays while the
clock says it does not, bounded by the ledger (and not without it: the negative control)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hf_polybasic.costs import CostCurves, cost_key
from hf_polybasic.generation import make_generate
from hf_polybasic.schedule import CostAwareSchedule, ledger as ledger_module
from hf_polybasic.schedule.factory import RowSchedules
from hf_polybasic.schedule.ledger import ALLOWANCE_SHARE, ALLOWANCE_STEPS, CallLedger
from hf_polybasic.testing import SimulatedClock, make_target, noisy_copy, prompt

STEP = 0.010


def _step_at_two(k):
    """The fp32 target as loaded on issue 47's AVX2 EPYC: 2 tokens cost two steps, 8 hardly more."""
    return STEP if k <= 1 else 2 * STEP + 0.001 * max(k - 8, 0)


def test_the_first_round_is_left_out_and_plain_rounds_price_the_step():
    ledger = CallLedger()
    assert ledger.plain_step() is None and ledger.allows()
    ledger.observe(4, 1, 5.0, 4.0, plain_estimate=STEP)  # the prefill: not counted, however slow
    assert ledger.seconds == 0 and ledger.emitted == 0 and ledger.behind() == 0
    ledger.observe(2, 1, 0.021, 0.020, plain_estimate=STEP)  # a rejected draft: about one step lost
    assert ledger.plain_step() == STEP  # no plain round yet: the estimate
    assert ledger.behind() == pytest.approx(0.011)
    ledger.observe(0, 1, 0.013, 0.012, plain_estimate=STEP)  # a plain round: the machine is slower now
    assert ledger.plain_step() == pytest.approx(0.012)
    assert ledger.behind() == pytest.approx(0.034 - 2 * 0.012)  # every round repriced at the step now
    uncosted = CallLedger()  # no cost curve: the cheapest verification seen, until a plain round
    for verify in (1.0, 0.025, 0.021, 0.03):
        uncosted.observe(2, 1, verify, verify)
    assert uncosted.plain_step() == 0.021


def test_it_allows_proposals_while_within_the_allowance_and_again_once_plain_rounds_earned_it():
    ledger = CallLedger()
    ledger.observe(0, 1, 1.0, 1.0, plain_estimate=STEP)
    ledger.observe(0, 1, STEP, STEP, plain_estimate=STEP)
    losses = 0
    while ledger.allows() and losses < 50:  # rounds that each lose a step
        ledger.observe(1, 1, 2 * STEP, 2 * STEP, plain_estimate=STEP)
        losses += 1
    assert losses == int(ALLOWANCE_STEPS) + 1
    assert ledger.behind() > ALLOWANCE_STEPS * STEP
    plain = 0
    while not ledger.allows() and plain < 1000:  # plain rounds cost a step each: the allowance grows with the tokens
        ledger.observe(0, 1, STEP, STEP, plain_estimate=STEP)
        plain += 1
    expected = (ledger.behind() / STEP - ALLOWANCE_STEPS) / ALLOWANCE_SHARE
    assert ledger.emitted == pytest.approx(expected, abs=1) and plain > 1
    ahead = CallLedger()
    ahead.observe(4, 5, 1.0, 1.0, plain_estimate=STEP)
    for _ in range(20):  # rounds that emit 5 tokens for 2 steps: never limited
        ahead.observe(4, 5, 2 * STEP, 2 * STEP, plain_estimate=STEP)
        assert ahead.allows() and ahead.behind() < 0


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.tuples(st.integers(1, 8), st.floats(0.5, 4.0)), min_size=1, max_size=80))
def test_a_row_that_proposes_only_when_allowed_stays_within_the_allowance_and_one_round(rounds):
    """Whatever the rounds yield, a row that asks the ledger before each proposal ends at most the
    allowance plus its dearest round's loss behind plain decoding."""
    ledger = CallLedger()
    ledger.observe(3, 1, 1.0, 1.0, plain_estimate=STEP)
    worst = 0.0
    for emitted, steps in rounds:
        if ledger.allows():
            ledger.observe(emitted - 1 if emitted > 1 else 1, emitted, steps * STEP, steps * STEP, plain_estimate=STEP)
            worst = max(worst, (steps - emitted) * STEP)
        else:
            ledger.observe(0, 1, STEP, STEP, plain_estimate=STEP)
    assert ledger.behind() <= (ALLOWANCE_STEPS + ALLOWANCE_SHARE * ledger.emitted) * STEP + worst + 1e-12


class _StepAtTwo:
    """The parent's costs as `CostAwareSchedule` reads them: `_step_at_two`, right (no online correction)."""

    last_seconds = None

    def seconds(self, tokens):
        return _step_at_two(tokens)


def test_a_schedule_with_a_ledger_stops_proposing_where_its_rounds_lose_by_the_clock(monkeypatch):
    """Two schedules whose average test says proposing pays (forced: an acceptance estimate that is
    wrong for the text) and whose drafts are all rejected, each round losing steps by the clock: the
    one with a ledger sits out (counted as its paused rounds) long before its own safety net would;
    the one without proposes on."""
    monkeypatch.setattr(CostAwareSchedule, "round_pays", lambda self, margin=1.0: True)

    def run(ledger):
        schedule = CostAwareSchedule(4, 16, per_token=True, verifier_costs=_StepAtTwo(), step_seconds=0.0005,
                                     ledger=ledger)
        lengths = []
        for index in range(8):
            length = min(schedule.length(), 3)
            lengths.append(length)
            schedule.observe_proposal(length, 0.0005 * length)
            verify = 1.0 if index == 0 else _step_at_two(length + 1)
            schedule.observe_verification(length, 0, verify)
        return schedule, lengths

    limited, lengths = run(CallLedger())
    assert lengths[:3] == [3, 3, 3] and lengths[3:] == [0] * 5, lengths
    assert limited.paused_rounds == 5 and not limited.backoff.paused
    assert limited.ledger.behind() > ALLOWANCE_STEPS * STEP
    free, lengths = run(None)
    assert lengths == [3] * 8 and free.paused_rounds == 0


def test_each_row_of_a_call_alone_gets_a_ledger_its_level_under_the_target_shares():
    made = RowSchedules("cost_aware", [0])
    under = made.for_level(4, 16, _StepAtTwo(), under_target=True)
    also_under = made.for_level(4, 16, _StepAtTwo(), under_target=True)
    below = made.for_level(4, 16, _StepAtTwo(), under_target=False)
    assert isinstance(under[0].ledger, CallLedger) and also_under[0].ledger is under[0].ledger
    assert below[0].ledger is None
    assert RowSchedules("constant", [0]).ledgers == {}


@pytest.mark.parametrize("bounded", [True, False], ids=["ledger", "negative control: no allowance"])
def test_a_chain_whose_estimates_are_wrong_stays_within_the_ledgers_bound_of_plain_decoding(monkeypatch, bounded):
    """Rounds the schedule believes pay (its first-draft gate and its average test forced to say yes)
    while a random drafter's drafts are rejected, at two steps per verification: the call ends within
    the allowance and a round or two of plain decoding's simulated time; with no allowance limit
    (the negative control) it falls well behind."""
    monkeypatch.setattr(CostAwareSchedule, "first_draft_pays", lambda self, top: True)
    monkeypatch.setattr(CostAwareSchedule, "round_pays", lambda self, margin=1.0: True)
    if not bounded:
        monkeypatch.setattr(ledger_module, "ALLOWANCE_STEPS", float("inf"))
    target = make_target("llama", seed=13, layers=4)
    drafter = noisy_copy(target, 1.0, seed=3)
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
    target_level, drafter_level = out.polybasic_stats.levels
    assert target_level.drafted > 0 and target_level.accepted < target_level.drafted  # it drafted, and lost
    plain = _step_at_two(6) + 63 * STEP
    # the allowance, a losing round past it, and the first round's drafts (the ledger leaves that round out)
    bound = plain + (ALLOWANCE_STEPS + ALLOWANCE_SHARE * 64 + 6) * STEP
    assert (seconds <= bound) is bounded, (seconds, bound)


def test_a_round_nobody_proposed_in_still_charges_what_its_proposer_ran():
    """A first draft declined (`CostAwareSchedule.first_draft_pays`) cost a drafter forward: each row's
    schedule is charged its share, so the ledger counts it; rounds with proposals split by tokens."""
    from hf_polybasic.decoding.round import Proposer
    from hf_polybasic.stats import LevelStats

    class Seen:
        def __init__(self):
            self.charged = []

        def observe_proposal(self, tokens, seconds):
            self.charged.append((tokens, seconds))

    proposer = Proposer()
    proposer.stats = LevelStats(name="drafter", role="drafter")
    proposer._active = {0: Seen(), 1: Seen()}
    proposer._record({0: 0, 1: 0}, 0.5)
    proposer._record({0: 3, 1: 1}, 0.4)
    assert proposer._active[0].charged == [(0, 0.25), (3, pytest.approx(0.3))]
    assert proposer._active[1].charged == [(0, 0.25), (1, pytest.approx(0.1))]
