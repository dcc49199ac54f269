"""Schedules that move K and mu during generation: their rules in isolation, and losslessness.

Greedy equality with every schedule runs in `test_greedy_equality`; here the exact-distribution
test runs with the schedules that vary the proposal length, next to a negative control: a drafter
that decides its length *after* seeing its draft (it drops a trailing low-probability token) is
lossy, and the test catches it.
"""

import pytest
import torch
from distribution import ALPHA, chi_square_p_value, sample_counts

from hf_polybasic.chain import ChainParts
from hf_polybasic.drafting import ModelDrafter
from hf_polybasic.integration import make_generate
from hf_polybasic.protocol import Proposal
from hf_polybasic.config import PolybasicConfig
from hf_polybasic.schedule import ProposalSchedule, acceptance_rate_estimate, cost_aware_length
from hf_polybasic.testing import make_chain, prompt

import hf_polybasic as hp


def test_constant_schedule_never_moves():
    schedule = ProposalSchedule("constant", 4, 16)
    for drafted, accepted in [(4, 4), (4, 0), (4, 4), (4, 2)]:
        schedule.observe_proposal(drafted, 0.01)
        schedule.observe_verification(drafted, accepted, 0.1)
        assert schedule.length() == 4


def test_heuristic_schedule_is_transformers_rule():
    schedule = ProposalSchedule("heuristic", 4, 7)
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


def test_cost_aware_length_follows_cost_and_acceptance():
    # a nearly free drafter that is usually right: propose as much as allowed
    assert cost_aware_length(0.95, 1e-4, 0.3, maximum=16) == 16
    # an expensive drafter that is usually wrong: propose the minimum
    assert cost_aware_length(0.2, 0.15, 0.3, maximum=16) == 1
    # in between it is the Leviathan optimum: alpha 0.8, c = 0.1 gives 5 (checked by enumeration)
    ratios = [(1 - 0.8 ** (g + 1)) / (1 - 0.8) / (g * 0.1 + 1) for g in range(17)]
    assert cost_aware_length(0.8, 0.03, 0.3, maximum=16) == max(range(1, 17), key=lambda g: ratios[g])


def test_cost_aware_schedule_moves_after_warmup():
    schedule = ProposalSchedule("cost_aware", 4, 16)
    schedule.observe_proposal(4, 0.0004)
    schedule.observe_verification(4, 4, 0.3)
    assert schedule.length() == 4  # still warming up
    for _ in range(5):
        schedule.observe_proposal(schedule.length(), 0.0001 * schedule.length())
        schedule.observe_verification(schedule.length(), schedule.length(), 0.3)
    assert schedule.length() == 16


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="PolybasicConfig.schedule must be one of"):
        PolybasicConfig(schedule="adaptive")


@pytest.mark.parametrize("schedule", ["heuristic", "cost_aware"])
@pytest.mark.parametrize("depth", [2, 3])
def test_varying_schedules_sample_the_target_distribution(schedule, depth, distribution_models, exact_distribution):
    setting = "temperature+top_k+top_p"
    counts = sample_counts(distribution_models[0], setting, distribution_models[1:depth], seed=11, num_draft_tokens=1, block_threshold=1, schedule=schedule)
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class PeekingDrafter(ModelDrafter):
    """Chooses its length after drafting: drops a trailing draft whose own probability is low.
    (transformers' confidence stop keeps that token, which is why it stays exact.)"""

    def propose(self, sequence, budget):
        proposal = super().propose(sequence, budget)
        tokens, probs = proposal.tokens, proposal.probs
        while probs is not None and tokens.shape[0] and probs[-1, tokens[-1]] < 0.25:
            tokens, probs = tokens[:-1], probs[:-1]
        return Proposal(tokens, probs)


def test_negative_control_length_chosen_after_drafting_is_rejected(distribution_models, exact_distribution):
    lossy = make_generate(ChainParts(model_drafter=PeekingDrafter))
    setting = "temperature+top_k+top_p"
    counts = sample_counts(distribution_models[0], setting, distribution_models[1:2], seed=11, generate=lossy, num_draft_tokens=2)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_cost_aware_schedule_is_exact_and_moves_on_a_longer_greedy_run():
    target, mid, draft = make_chain("llama", 3, seed=7)
    ids = prompt(6, seed=2)
    reference = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None)
    out = target.generate(
        ids,
        do_sample=False,
        max_new_tokens=60,
        eos_token_id=None,
        custom_generate=hp.generate,
        assistant_models=[mid, draft],
        polybasic_config=hp.PolybasicConfig(num_draft_tokens=2, block_threshold=3, schedule="cost_aware"),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    drafter = out.polybasic_stats.levels[-1]
    # the schedule left K = 2 behind: some round drafted a different number of tokens
    assert drafter.proposed != 2 * out.polybasic_stats.levels[1].verifications
