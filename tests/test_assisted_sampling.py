"""Sampling through transformers' assisted loop over the chain (`hp.assisted_generate`) is
distributed exactly as the target's processed distribution.

transformers' loop verifies, accepts (its own `_speculative_sampling`, against the distributions
`hp.PolybasicCandidateGenerator` reports) and crops; the chain only proposes. The exact distribution
of 3-token continuations of an 8-token target is enumerated (tests/helpers.py), continuations are
sampled one call each (the loop decodes one prompt at a time: about 20 ms a sample here, so 1000 by
default, the 4-level chain `slow`) and compared by chi-square; the same test fails when the
generator reports the bottom drafter's distribution instead of the middle level's, or a uniform one
(`slow`). Every test asserts from the calls' statistics that every level took part.
"""

import pytest
import torch
from helpers import (ALPHA, SETTINGS, STEPS, VOCAB, assert_every_level_took_part, chi_square_p_value,
                     outcome_counts)

import hf_polybasic as hp
from hf_polybasic import assisted
from hf_polybasic.assisted import make_assisted_generate
from hf_polybasic.candidates import PolybasicCandidateGenerator
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import IntermediateLevel, ModelDrafter
from hf_polybasic.testing import cheap_drafting_costs, prompt, simulated_machine


class RememberingDrafter(ModelDrafter):
    """A model drafter that keeps its last proposals (for the negative control below)."""

    def propose(self, requests, schedules=None):
        self.last = super().propose(requests, schedules)
        return self.last


class DrafterDistributionIntermediate(IntermediateLevel):
    """A plausible bug: the middle level hands up, for each token of its block, the distribution the
    bottom drafter drew it from (where the drafter drew one there) instead of its own."""

    def _extend(self, row, block, round_, threshold):
        drafted = self.verifier.child.last[row]
        own = round_.scores.softmax(-1)
        shared = min(len(drafted), own.shape[0]) if drafted.probs is not None else 0
        block.extend(round_.tokens, torch.cat([drafted.probs[:shared], own[shared:]]), ids=round_.ids)
        return not block.closed and block.size < threshold


class UniformCandidates(PolybasicCandidateGenerator):
    """A plausible bug: the block is reported as drawn from the uniform distribution."""

    def candidate_logits(self, proposal):
        logits = super().candidate_logits(proposal)
        return None if logits is None else torch.zeros_like(logits)


SETTING = "temperature+top_k+top_p"
CONFIG = dict(schedule="constant", num_draft_tokens=2, block_threshold=2)


def assisted_counts(target, assistants, seed: int, samples: int, generate=hp.assisted_generate, **config):
    """Histogram over the 512 outcomes of ``samples`` 3-token continuations sampled one call each
    (transformers' loop: one prompt at a time), and the calls' statistics, merged."""
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(seed)
    rows, total = [], None
    for _ in range(samples):
        out = target.generate(ids, do_sample=True, max_new_tokens=STEPS, custom_generate=generate,
                              assistant_models=list(assistants), return_dict_in_generate=True,
                              polybasic_config=hp.PolybasicConfig(**config), **SETTINGS[SETTING])
        rows.append(out.sequences[0, ids.shape[1]:])
        if total is None:
            total = out.polybasic_stats
        else:
            total.merge(out.polybasic_stats)
    return outcome_counts(torch.stack(rows), samples), total


@pytest.mark.parametrize("depth, samples", [(3, 1000), pytest.param(4, 2000, marks=pytest.mark.slow)])
def test_sampled_through_the_loop_the_distribution_is_the_targets(depth, samples, distribution_models,
                                                                   exact_distribution):
    target, *assistants = distribution_models[:depth]
    counts, stats = assisted_counts(target, assistants, seed=depth, samples=samples, **CONFIG)
    print(depth, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(SETTING)) > ALPHA


def test_negative_control_the_bottom_drafters_distribution_reported_fails(distribution_models, exact_distribution):
    """800 samples make it fail at p < 1e-7 on every seed tried (1e-13 to 1e-22 at 1000)."""
    target, *assistants = distribution_models[:3]
    wrong = make_assisted_generate(ChainParts(model_drafter=RememberingDrafter,
                                              intermediate=DrafterDistributionIntermediate))
    counts, stats = assisted_counts(target, assistants, seed=11, samples=800, generate=wrong, **CONFIG)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(SETTING)) < ALPHA


@pytest.mark.slow
def test_negative_control_a_uniform_distribution_reported_fails(distribution_models, exact_distribution, monkeypatch):
    target, *assistants = distribution_models[:3]
    monkeypatch.setattr(assisted, "PolybasicCandidateGenerator", UniformCandidates)
    counts, stats = assisted_counts(target, assistants, seed=12, samples=800, **CONFIG)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(SETTING)) < ALPHA


@pytest.mark.slow
def test_drafts_read_after_the_drafting_sample_the_targets_distribution(drafts_read_with_the_decision,
                                                                       distribution_models, exact_distribution):
    """As on a GPU, with schedules that cut drafts after any token of probability <= 0.6 (the
    fixture): the drafter right under the target drafts a width unread and the generator reads where
    its block ends (`hf_polybasic.candidates.settled`), a cut that depends only on the drafts."""
    target, assistant = distribution_models[:2]
    with simulated_machine(cheap_drafting_costs(target, [assistant]), assisted=True) as generate:
        counts, stats = assisted_counts(target, [assistant], seed=31, samples=1000, generate=generate)
    print(assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(SETTING)) > ALPHA
