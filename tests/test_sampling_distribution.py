"""Sampling through a chain is distributed exactly as the target's processed distribution.

On an 8-token vocabulary the exact distribution of 3-token continuations (512 outcomes) is
enumerated with the target's own `generate` as the oracle (its processed scores for every prefix),
then many continuations are sampled through the chain and compared with a chi-square test at a
fixed seed. A deliberately wrong chain (proposal reported as the raw instead of the processed
distribution) must fail the same test. Every test asserts from the call's statistics that every
level of its chain drafted and verified: a chain whose lower levels sat out would only test plain
sampling.
"""

import pytest
import torch
from helpers import (
    ALPHA,
    SAMPLES,
    SETTINGS,
    STEPS,
    VOCAB,
    assert_every_level_took_part,
    chi_square_p_value,
    outcome_counts,
    sample_counts,
)

from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import ModelDrafter, Verifier
from hf_polybasic.schedule import batch_gate
from hf_polybasic.generation import make_generate
from hf_polybasic.testing import cheap_drafting_costs, prompt, simulated_machine


CASES = [
    ("temperature+top_k+top_p", 2, dict(num_draft_tokens=2)),
    ("temperature+top_k+top_p", 3, dict(num_draft_tokens=2, block_threshold=2)),
    ("temperature+top_k+top_p", 4, dict(num_draft_tokens=1, block_threshold=(3, 2))),
    ("temperature+top_k+top_p", 4, dict()),  # the default K and mu: every level drafts even 3 tokens from the end
    ("repetition_penalty", 3, dict(num_draft_tokens=2, block_threshold=2)),
    ("min_p", 3, dict(num_draft_tokens=3, block_threshold=1)),
    ("temperature+top_k+top_p", 3, dict(num_draft_tokens=2, block_threshold=2, verification="greedy")),
]


@pytest.mark.parametrize("setting, depth, config", CASES)
def test_chain_samples_the_target_distribution(setting, depth, config, distribution_models, exact_distribution):
    """The algorithm itself (a constant schedule, so every level drafts in every round)."""
    counts, stats = sample_counts(
        distribution_models[0], setting, distribution_models[1:depth], seed=depth, schedule="constant", **config
    )
    print(setting, depth, config, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


@pytest.mark.parametrize("setting, depth", [("temperature+top_k+top_p", 3), ("repetition_penalty", 4)])
def test_cost_aware_chain_samples_the_target_distribution_where_drafting_pays(
    setting, depth, distribution_models, exact_distribution, monkeypatch
):
    """The default schedule, on a simulated machine where every level's drafts pay (a flat, costly
    target and assistants 50 times cheaper than the level above): it drafts, and stays exact. The
    samples are one batch of 3 new tokens per row, which a batch's plain rounds timed first would
    use up: the gate starts with its short proposals at once."""
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    target, *assistants = distribution_models[:depth]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        counts, stats = sample_counts(target, setting, assistants, seed=17, generate=generate, block_threshold=2)
    print(setting, depth, "cost_aware", assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class PastTheCutVerifier(Verifier):
    """A plausible bug: past the drafter's cut it emits its own token from where its acceptance ended
    (position ``accepted``) instead of the draft it accepted at the cut."""

    def _read(self, proposals, decided, scores, deferred):
        settled, reads = super()._read(proposals, decided, scores, deferred)
        for row, read in reads.items():
            if read.kept < int(decided[row][0]):
                read.token, read.on_device = int(decided[row][1]), decided[row][1:]
        return settled, reads


@pytest.mark.parametrize("depth", [2, 3])
def test_drafts_read_with_the_verifiers_decision_sample_the_target_distribution(
        depth, drafts_read_with_the_decision, distribution_models, exact_distribution):
    setting = "temperature+top_k+top_p"
    target, *assistants = distribution_models[:depth]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        counts, stats = sample_counts(target, setting, assistants, seed=23, generate=generate, block_threshold=2)
    print(depth, drafts_read_with_the_decision, assert_every_level_took_part(stats))
    assert drafts_read_with_the_decision["accepted past the cut"] > 50
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


def test_rounds_decided_on_the_device_sample_the_target_distribution(drafts_read_with_the_decision,
                                                                   distribution_models, exact_distribution):
    """[middle, drafter] on static caches where reads wait for the device: the middle level's rounds
    are decided on the device, a batch per read (`hf_polybasic.decoding.device_blocks`), and the
    chain still samples the target's distribution."""
    setting = "temperature+top_k+top_p"
    target, *assistants = distribution_models[:3]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        counts, stats = sample_counts(target, setting, assistants, seed=29, generate=generate, block_threshold=3,
                                      cache_implementation="static")
    print(drafts_read_with_the_decision, assert_every_level_took_part(stats))
    assert stats.levels[1].device_rounds > 0.5 * stats.levels[1].verifications
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


def test_negative_control_rounds_on_the_device_emitting_the_rejected_draft(
        drafts_read_with_the_decision, distribution_models, exact_distribution, monkeypatch):
    """The same test fails when the device rounds hand up, where the middle level rejected a draft,
    that draft instead of its own token (a plausible off-by-one of ``accepted``)."""
    from hf_polybasic.decoding.device_blocks import DeviceBlocks

    verify = DeviceBlocks._verify

    def rejected_kept(self, state, drafts, probs, sequences, rules):
        active, accepted, emitted, scores, confidences = verify(self, state, drafts, probs, sequences, rules)
        w = drafts.shape[1]
        positions = torch.arange(w + 1, device=emitted.device)
        padded = torch.cat([drafts, emitted[:, w:]], 1)  # [rows, w + 1]: the drafts, then the level's last token
        wrong = torch.where(positions <= accepted.unsqueeze(1), padded, emitted)
        return active, accepted, wrong, scores, confidences

    monkeypatch.setattr(DeviceBlocks, "_verify", rejected_kept)
    setting = "temperature+top_k+top_p"
    target, *assistants = distribution_models[:3]
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        counts, stats = sample_counts(target, setting, assistants, seed=29, generate=generate, block_threshold=3,
                                      cache_implementation="static")
    assert stats.levels[1].device_rounds > 0
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_negative_control_emitting_the_wrong_token_past_the_cut(drafts_read_with_the_decision, distribution_models,
                                                                exact_distribution):
    setting = "temperature+top_k+top_p"
    target, assistant = distribution_models[:2]
    with simulated_machine(cheap_drafting_costs(target, [assistant]), parts=ChainParts(verifier=PastTheCutVerifier)
                           ) as generate:
        counts, stats = sample_counts(target, setting, [assistant], seed=23, generate=generate)
    assert_every_level_took_part(stats)
    assert drafts_read_with_the_decision["accepted past the cut"] > 50
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


class RawProposalDrafter(ModelDrafter):
    """The classic bug (transformers #47932): report raw logits as q although drafts were sampled
    from the processed distribution."""

    def proposal_probs(self, probs, logits):
        return logits.softmax(-1)


def test_negative_control_raw_proposal_is_rejected(distribution_models, exact_distribution):
    lossy = make_generate(ChainParts(model_drafter=RawProposalDrafter))
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(
        distribution_models[0], setting, distribution_models[1:2], seed=2, generate=lossy, num_draft_tokens=2,
        schedule="constant",
    )
    assert_every_level_took_part(stats)  # the same path the positive tests take
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_negative_control_assistant_alone_is_rejected(distribution_models, exact_distribution):
    """The test has the power to tell the target from its closest assistant."""
    target, m2, *_ = distribution_models
    setting = "temperature+top_k+top_p"
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(0)
    out = m2.generate(ids, do_sample=True, max_new_tokens=STEPS, num_return_sequences=SAMPLES, **SETTINGS[setting])
    counts = outcome_counts(out[:, ids.shape[1] :])
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_exact_distribution_is_a_distribution(exact_distribution):
    for setting in SETTINGS:
        probs = exact_distribution(setting)
        assert probs.sum() == pytest.approx(1.0)
        assert (probs > 0).sum() > 20  # not degenerate: many outcomes are possible
