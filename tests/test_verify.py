"""The acceptance math alone, without models: exact outputs and distributions over many samples."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from hf_polybasic.decoding.acceptance import (
    align_vocabulary,
    greedy_decision,
    leading_true,
    point_mass_decision,
    speculative_decision,
)

SAMPLES = 20_000
ALPHA = 1e-3


def _random_distribution(vocab: int, generator: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(vocab, generator=generator), -1)


def _first_token_counts(decide, p: torch.Tensor, q: torch.Tensor | None, draw, vocab: int) -> np.ndarray:
    """Histogram of the first emitted token over SAMPLES one-token drafts."""
    counts = np.zeros(vocab)
    target = torch.stack([p, p])  # position 0 and the bonus position
    for _ in range(SAMPLES):
        draft = draw()
        num_accepted, next_token = decide(draft, q, target).tolist()
        first = int(draft[0]) if num_accepted >= 1 else next_token
        counts[first] += 1
    return counts


def _chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected_probs = np.asarray(expected_probs, dtype=np.float64)
    expected = expected_probs / expected_probs.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return chisquare(counts[keep], expected[keep]).pvalue


def test_leading_true():
    assert int(leading_true(torch.tensor([True, True, False, True]))) == 2
    assert int(leading_true(torch.tensor([False, True]))) == 0
    assert int(leading_true(torch.tensor([True, True]))) == 2
    assert int(leading_true(torch.tensor([], dtype=torch.bool))) == 0


@pytest.mark.parametrize("vocab", [2, 6])
def test_speculative_sampling_emits_the_target_distribution(vocab):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(vocab)
    p, q = _random_distribution(vocab, generator), _random_distribution(vocab, generator)
    counts = _first_token_counts(
        speculative_decision, p, q.unsqueeze(0), lambda: torch.multinomial(q, 1), vocab
    )
    assert _chi_square_p(counts, p.numpy()) > ALPHA


def test_speculative_sampling_negative_control_wrong_proposal_is_detected():
    """Drafts drawn from q but reported as coming from another q' must fail the same test."""
    torch.manual_seed(1)
    vocab = 6
    generator = torch.Generator().manual_seed(11)
    p, q, wrong = (_random_distribution(vocab, generator) for _ in range(3))
    counts = _first_token_counts(
        speculative_decision, p, wrong.unsqueeze(0), lambda: torch.multinomial(q, 1), vocab
    )
    assert _chi_square_p(counts, p.numpy()) < ALPHA


def test_point_mass_rule_emits_the_target_distribution():
    torch.manual_seed(2)
    vocab = 5
    p = _random_distribution(vocab, torch.Generator().manual_seed(3))
    counts = _first_token_counts(speculative_decision, p, None, lambda: torch.tensor([1]), vocab)
    assert _chi_square_p(counts, p.numpy()) > ALPHA


def test_second_position_is_conditionally_exact():
    """With two draft positions, the token emitted at position 2 (given position 1 kept) is p2."""
    torch.manual_seed(4)
    vocab = 4
    generator = torch.Generator().manual_seed(5)
    p1, p2, p3 = (_random_distribution(vocab, generator, 1.0) for _ in range(3))
    q1, q2 = (_random_distribution(vocab, generator, 1.0) for _ in range(2))
    target = torch.stack([p1, p2, p3])
    proposal = torch.stack([q1, q2])
    counts = np.zeros(vocab)
    for _ in range(SAMPLES):
        draft = torch.cat([torch.multinomial(q1, 1), torch.multinomial(q2, 1)])
        num_accepted, next_token = speculative_decision(draft, proposal, target).tolist()
        if num_accepted >= 1:
            counts[int(draft[1]) if num_accepted == 2 else next_token] += 1
    assert _chi_square_p(counts, p2.numpy()) > ALPHA


def test_all_accepted_draws_the_bonus_from_the_last_row():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert speculative_decision(torch.tensor([1]), p[:1].clone(), p).tolist() == [1, 2]
    assert point_mass_decision(torch.tensor([1]), p).tolist() == [1, 2]


@given(
    draft=st.lists(st.integers(0, 7), min_size=0, max_size=6),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_greedy_decision_accepts_exactly_the_matching_prefix(draft, seed):
    scores = torch.randn(len(draft) + 1, 8, generator=torch.Generator().manual_seed(seed))
    choice = scores.argmax(-1).tolist()
    num_accepted, next_token = greedy_decision(torch.tensor(draft, dtype=torch.long), scores).tolist()
    expected = 0
    while expected < len(draft) and draft[expected] == choice[expected]:
        expected += 1
    assert num_accepted == expected
    assert next_token == choice[expected]


def test_drafts_outside_the_verifier_vocabulary_are_rejected():
    target = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    # the proposal lives on a padded 4-token vocabulary and drafted id 3, which the verifier lacks
    proposal = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    num_accepted, next_token = speculative_decision(torch.tensor([3]), proposal, target).tolist()
    assert num_accepted == 0 and next_token in (0, 1)
    assert int(greedy_decision(torch.tensor([3]), target)[0]) == 0


def test_align_vocabulary_slices_without_renormalising_and_pads_with_zero():
    probs = torch.tensor([[0.25, 0.25, 0.5]])
    assert torch.equal(align_vocabulary(probs, 2), torch.tensor([[0.25, 0.25]]))
    assert torch.equal(align_vocabulary(probs, 4), torch.tensor([[0.25, 0.25, 0.5, 0.0]]))
    assert align_vocabulary(probs, 3) is probs


def test_the_sampling_decisions_draw_from_the_generator_they_are_given():
    """point_mass_decision / speculative_decision (with and without a proposal) draw from
    ``generator``: the same seed gives the same draws whatever the global RNG did in between (one
    that dropped it would follow the global)."""
    probs = torch.full((4, 16), 1 / 16)
    drafts = torch.tensor([3, 5, 7])
    for decide in (lambda g: point_mass_decision(drafts, probs, g),
                   lambda g: speculative_decision(drafts, None, probs, g),
                   lambda g: speculative_decision(drafts, torch.full((3, 16), 1 / 16), probs, g)):
        runs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            generator = torch.Generator().manual_seed(0)
            runs.append([decide(generator).tolist() for _ in range(20)])
        assert runs[0] == runs[1]
