"""Greedy decoding through any chain equals the target's own greedy `generate`, token for token."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_every_level_took_part

from hf_polybasic.schedule import SCHEDULES
from hf_polybasic.testing import EOS, cheap_drafting_costs, prompt, simulated_machine

import hf_polybasic as hp

ARCHITECTURES = ["llama", "qwen2", "gemma3"]  # gemma3: sliding window of 6, far shorter than the outputs


@pytest.fixture(scope="module")
def chain_of(shared_models):
    """(arch, depth) -> the session's shared chain (built once)."""
    return lambda arch, depth: shared_models.chain(arch, depth, seed=7)


def _greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@given(
    depth=st.integers(2, 4),
    k=st.integers(1, 6),
    mu=st.integers(1, 10),
    prompt_length=st.integers(1, 12),
    budget=st.integers(1, 40),
    eos_step=st.one_of(st.none(), st.integers(0, 39)),
    seed=st.integers(0, 1000),
    schedule=st.sampled_from(SCHEDULES),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_greedy_output_equals_plain_generate(arch, depth, k, mu, prompt_length, budget, eos_step, seed, schedule, chain_of):
    """Any chain, K, mu, budget, EOS position and schedule. The cost-aware schedule runs on a
    simulated machine where drafting pays (on the real one these equal-cost tiny models rightly
    make it back off); every level drafts and verifies whenever 2 or more tokens are allowed."""
    target, *assistants = chain_of(arch, depth)
    ids = prompt(prompt_length, seed=seed)
    reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=EOS)
    eos = EOS
    if eos_step is not None and eos_step < reference.shape[1] - ids.shape[1]:
        # make a token the target really produces the EOS token, so generation stops mid-output
        eos = int(reference[0, ids.shape[1] + eos_step])
        reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=[eos, EOS])
    with simulated_machine(cheap_drafting_costs(target, assistants)) as simulated:
        out = _greedy(
            target,
            ids,
            max_new_tokens=budget,
            eos_token_id=[eos, EOS],
            custom_generate=simulated if schedule == "cost_aware" else hp.generate,
            assistant_models=assistants,
            polybasic_config=hp.PolybasicConfig(num_draft_tokens=k, block_threshold=mu, schedule=schedule),
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, reference)
    assert out.sequences.shape[1] - ids.shape[1] <= budget
    if budget >= 2:
        assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_greedy_equality_with_every_prefix_dependent_processor(depth, chain_of):
    target, *assistants = chain_of("llama", depth)
    ids = prompt(4, seed=3)
    options = dict(
        max_new_tokens=30,
        min_new_tokens=25,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        eos_token_id=EOS,
    )
    reference = _greedy(target, ids, **options)
    out = _greedy(target, ids, custom_generate=hp.generate, assistant_models=assistants, return_dict_in_generate=True,
                  polybasic_config=hp.PolybasicConfig(schedule="constant"), **options)
    assert torch.equal(out.sequences, reference)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)


def test_statistics_count_what_happened(chain_of):
    target, m2, m3 = chain_of("llama", 3)
    ids = prompt(5, seed=1)
    out = _greedy(
        target,
        ids,
        max_new_tokens=30,
        min_new_tokens=30,
        custom_generate=hp.generate,
        assistant_models=[m2, m3],
        # constant K and mu: the block-size invariant below is about a fixed mu
        polybasic_config=hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant"),
        return_dict_in_generate=True,
    )
    stats = out.polybasic_stats
    assert hp.last_stats(target) is stats
    top, middle, bottom = stats.levels
    assert [level.role for level in stats.levels] == ["target", "intermediate", "drafter"]
    assert stats.new_tokens == 30
    # every new token is emitted by exactly one target verification: accepted + 1 per round
    assert sum(top.acceptance_lengths) == 30
    assert top.forward_passes == top.verifications == len(top.acceptance_lengths)
    assert top.mean_acceptance_length == pytest.approx(30 / top.verifications)
    # what a level hands up is what the level above receives
    assert middle.proposed == top.drafted
    assert bottom.proposed == middle.drafted
    assert middle.forward_passes == middle.verifications
    # the drafter runs one forward per drafted token (catching up after a rollback is part of it)
    assert bottom.forward_passes == bottom.proposed and bottom.verifications == 0
    assert all(level.seconds > 0 for level in stats.levels)
    # an intermediate level hands up at least mu tokens unless the budget or EOS ended the block
    assert top.drafted >= 4 * (top.verifications - 1)
