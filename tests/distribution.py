"""Shared machinery of the distribution tests: an 8-token target, its exact processed distribution
over 3-token continuations (plain `generate`'s own scores are the oracle), sampling through a
chain, and a chi-square goodness-of-fit test."""

import numpy as np
import torch
from scipy.stats import chisquare

import hf_polybasic as hp
from hf_polybasic.testing import make_target, noisy_copy, prompt

VOCAB = 8
STEPS = 3
SAMPLES = 2000
ALPHA = 1e-3

SETTINGS = {
    "temperature+top_k+top_p": dict(temperature=0.8, top_k=5, top_p=0.9),
    "repetition_penalty": dict(repetition_penalty=1.8, top_k=0),
    "min_p": dict(min_p=0.15, temperature=1.2, top_k=0),
}


def build_models(arch: str = "llama", layers: int = 2) -> tuple:
    """An 8-token target and three noisy copies of it (noise 0.3, 0.6, 0.9); no EOS. ``arch``: any of
    `hf_polybasic.testing.make_target`'s, e.g. a hybrid model (test_hybrid.py)."""
    target = make_target(arch, seed=3, vocab=VOCAB, logit_scale=1.5, layers=layers)
    target.generation_config.eos_token_id = None  # every sample has exactly STEPS tokens
    copies = [noisy_copy(target, noise, seed) for seed, noise in enumerate((0.3, 0.6, 0.9), 1)]
    for model in copies:
        model.generation_config.eos_token_id = None
    return (target, *copies)


def exact_joint(target, setting: str, ids=None) -> np.ndarray:
    """P(x1, x2, x3) after ``ids`` (default: the tests' 3-token prompt) under the target's processed
    distribution, from plain generate's own scores."""
    ids = prompt(3, seed=5, vocab=VOCAB) if ids is None else ids
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


def sample_counts(target, setting: str, assistants, seed: int, generate=hp.generate, samples: int = SAMPLES, **config):
    """Histogram over the 512 outcomes of ``samples`` continuations of ``target`` sampled through the
    chain (``generate``: the `custom_generate` callable, e.g. one built from deliberately wrong parts,
    or one on a simulated machine), and the call's `PolybasicStats` (to prove every level took part)."""
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(seed)
    out = target.generate(
        ids,
        do_sample=True,
        max_new_tokens=STEPS,
        num_return_sequences=samples,
        custom_generate=generate,
        assistant_models=list(assistants),
        polybasic_config=hp.PolybasicConfig(**config),
        return_dict_in_generate=True,
        **SETTINGS[setting],
    )
    return outcome_counts(out.sequences[:, ids.shape[1] :], samples), out.polybasic_stats


def assert_every_level_took_part(stats, rejections: bool = True, acceptances: bool = True) -> str:
    """Fail unless the chain ran the algorithm it is meant to test: every level below the target
    handed up tokens, every level above the bottom verified drafts from the level below (the
    target and each intermediate level), with ``acceptances`` accepted some of them and, with
    ``rejections``, every verifier also rejected some (so the residual path of speculative sampling ran too). Returns one line per level
    (drafted/accepted/proposed/paused), for the record."""
    lines = []
    for index, level in enumerate(stats.levels):
        lines.append(
            f"{level.name.split()[0]}: drafted {level.drafted}, accepted {level.accepted}, "
            f"proposed {level.proposed}, paused {level.paused_rounds}"
        )
        if index > 0:
            assert level.proposed > 0, f"{level.name} never handed a token up: " + "; ".join(lines)
        if index < len(stats.levels) - 1:
            assert level.drafted > 0 and level.verifications > 0, f"{level.name} never verified a draft: " + "; ".join(lines)
            if acceptances:
                assert level.accepted > 0, f"{level.name} never accepted a draft: " + "; ".join(lines)
            if rejections:
                assert level.accepted < level.drafted, f"{level.name} never rejected a draft: " + "; ".join(lines)
    return "; ".join(lines)


def outcome_counts(new_tokens: torch.Tensor, samples: int = SAMPLES) -> np.ndarray:
    new = new_tokens.numpy()
    assert new.shape == (samples, STEPS)
    return np.bincount(np.ravel_multi_index(tuple(new.T), (VOCAB,) * STEPS), minlength=VOCAB**STEPS)


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


def assert_target_could_sample(target, sequences, prompt_length: int, top_k: int) -> None:
    """Every new token is one the target itself can sample there: its logit is at least the k-th
    largest at that prefix. That is what transformers' top-k leaves possible (`TopKLogitsWarper`
    removes only scores below the k-th value, so every id tied with it stays: in bf16 exact ties are
    common); a leaked draft of an assistant or a stale cache would break it."""
    for row in sequences:
        logits = target(row.unsqueeze(0)).logits[0, prompt_length - 1 : -1]  # row j predicts new token j
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        new = row[prompt_length:].to(logits.device)
        chosen = logits.gather(-1, new.unsqueeze(-1))
        below = ((chosen < kth) | (chosen == float("-inf"))).squeeze(-1)
        assert not bool(below.any()), (
            f"a sampled token the target gives probability 0: new token {int(below.nonzero()[0])} "
            f"(id {int(new[below][0])}) is below the target's {top_k}-th largest logit there"
        )
