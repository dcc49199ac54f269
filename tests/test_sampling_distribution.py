"""Sampling through a chain is distributed exactly as the target's processed distribution.

On an 8-token vocabulary the exact distribution of 3-token continuations (512 outcomes) is
enumerated with the target's own `generate` as the oracle (its processed scores for every prefix),
then many continuations are sampled through the chain and compared with a chi-square test at a
fixed seed. A deliberately wrong chain (proposal reported as the raw instead of the processed
distribution) must fail the same test.
"""

import functools
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from hf_polybasic.testing import make_target, noisy_copy, prompt

import hf_polybasic as hp
from hf_polybasic import engine
from hf_polybasic.chain import ModelDrafter

VOCAB = 8
STEPS = 3
SAMPLES = 2000
ALPHA = 1e-3

SETTINGS = {
    "temperature+top_k+top_p": dict(temperature=0.8, top_k=5, top_p=0.9),
    "repetition_penalty": dict(repetition_penalty=1.8, top_k=0),
    "min_p": dict(min_p=0.15, temperature=1.2, top_k=0),
}


@functools.lru_cache(maxsize=None)
def models():
    target = make_target("llama", seed=3, vocab=VOCAB, logit_scale=1.5)
    target.generation_config.eos_token_id = None  # every sample has exactly STEPS tokens
    return [target, noisy_copy(target, 0.3, 1), noisy_copy(target, 0.6, 2), noisy_copy(target, 0.9, 3)]


@functools.lru_cache(maxsize=None)
def exact_distribution(setting: str) -> np.ndarray:
    """P(x1, x2, x3) under the target's processed distribution, from plain generate's own scores."""
    target = models()[0]
    ids = prompt(3, seed=5, vocab=VOCAB)
    options = SETTINGS[setting]

    def next_probs(prefix: tuple[int, ...]) -> np.ndarray:
        full = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], dim=1) if prefix else ids
        # an explicit mask: otherwise generate masks prompt tokens equal to pad_token_id (0 here)
        out = target.generate(
            full, attention_mask=torch.ones_like(full), do_sample=True, max_new_tokens=1, output_scores=True, return_dict_in_generate=True, **options
        )
        return out.scores[0][0].double().softmax(-1).numpy()

    joint = np.zeros((VOCAB,) * STEPS)
    first = next_probs(())
    for x1 in range(VOCAB):
        if first[x1] == 0:
            continue
        second = next_probs((x1,))
        for x2 in range(VOCAB):
            if second[x2] == 0:
                continue
            joint[x1, x2] = first[x1] * second[x2] * next_probs((x1, x2))
    return joint.reshape(-1)


def sample_counts(setting: str, depth: int, seed: int, **config) -> np.ndarray:
    target, *assistants = models()
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(seed)
    out = target.generate(
        ids,
        do_sample=True,
        max_new_tokens=STEPS,
        num_return_sequences=SAMPLES,
        custom_generate=hp.generate,
        assistant_models=assistants[: depth - 1],
        polybasic_config=hp.PolybasicConfig(**config),
        **SETTINGS[setting],
    )
    new = out[:, ids.shape[1] :].numpy()
    assert new.shape == (SAMPLES, STEPS)
    index = np.ravel_multi_index(tuple(new.T), (VOCAB,) * STEPS)
    return np.bincount(index, minlength=VOCAB**STEPS)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; outcomes expected fewer than 5 times are pooled into one cell."""
    expected = probs / probs.sum() * counts.sum()
    possible = expected > 0
    if counts[~possible].sum():
        return 0.0  # the chain produced an outcome the target never would
    counts, expected = counts[possible], expected[possible]
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum()) if small.any() else counts
    expected = np.append(expected[~small], expected[small].sum()) if small.any() else expected
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(
    "setting, depth, config",
    [
        ("temperature+top_k+top_p", 2, dict(num_draft_tokens=2)),
        ("temperature+top_k+top_p", 3, dict(num_draft_tokens=2, block_threshold=2)),
        ("temperature+top_k+top_p", 4, dict(num_draft_tokens=1, block_threshold=(3, 2))),
        ("repetition_penalty", 3, dict(num_draft_tokens=2, block_threshold=2)),
        ("min_p", 3, dict(num_draft_tokens=3, block_threshold=1)),
        ("temperature+top_k+top_p", 3, dict(num_draft_tokens=2, block_threshold=2, verification="greedy")),
    ],
)
def test_chain_samples_the_target_distribution(setting, depth, config):
    counts = sample_counts(setting, depth, seed=depth, **config)
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class RawProposalDrafter(ModelDrafter):
    """The classic bug (transformers #47932): report raw logits as q although drafts were sampled
    from the processed distribution."""

    @staticmethod
    def proposal_log_probs(scores, logits):
        return logits.log_softmax(-1)


def test_negative_control_raw_proposal_is_rejected(monkeypatch):
    monkeypatch.setattr(engine, "ModelDrafter", RawProposalDrafter)
    setting = "temperature+top_k+top_p"
    counts = sample_counts(setting, 2, seed=2, num_draft_tokens=2)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_negative_control_assistant_alone_is_rejected():
    """The test has the power to tell the target from its closest assistant."""
    target, m2, *_ = models()
    setting = "temperature+top_k+top_p"
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(0)
    m2.generation_config.eos_token_id = None
    out = m2.generate(ids, do_sample=True, max_new_tokens=STEPS, num_return_sequences=SAMPLES, **SETTINGS[setting])
    new = out[:, ids.shape[1] :].numpy()
    counts = np.bincount(np.ravel_multi_index(tuple(new.T), (VOCAB,) * STEPS), minlength=VOCAB**STEPS)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_exact_distribution_is_a_distribution():
    for setting in SETTINGS:
        probs = exact_distribution(setting)
        assert probs.sum() == pytest.approx(1.0)
        assert (probs > 0).sum() > 20  # not degenerate: many outcomes are possible
    assert list(itertools.islice(SETTINGS, 1)) == ["temperature+top_k+top_p"]
