"""How a verifier accepts the stream of the level below: pure functions of agreement data.

L(b), tokens emitted per verification of a b-token block (accepted + 1, the tau convention of
`hf_polybasic.stats`). Greedy: along `verification_walk`, from the first position of the target's
text each verification accepts the leading agreements of the pair (capped at b, at the budget, and
for a Drafter at what it proposed there), emits one more token, and the next starts where it
ended; so copy regions with long runs count as such, and as often as decoding visits them
(averaging over every position, `expected_run_length`, would overstate L: a verification jumps
over a long run). Under sampling, the geometric model of `hf_polybasic.theory` with alpha
= the mean overlap. A real-valued b interpolates linearly between the integers around it.

An intermediate level with threshold mu repeats verifications until it holds mu tokens:
`expected_verifications` is the renewal recursion over the distribution of tokens emitted per
verification (a smooth ceil(mu / L), which it equals when every verification emits exactly L).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import theory


def is_int(value, minimum: int) -> bool:
    """An int (not a bool) >= minimum."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= minimum


def _leading_ones(indicators: Sequence[int], where: str) -> list[int]:
    """Leading ones of ``indicators[t:]`` for every t."""
    values = [int(v) for v in indicators]
    if any(v not in (0, 1) for v in values):
        raise ValueError(f"{where} must hold only 0 and 1, got {sorted(set(values))}")
    runs, current = [0] * len(values), 0
    for t in range(len(values) - 1, -1, -1):
        current = current + 1 if values[t] else 0
        runs[t] = current
    return runs


def _checked_caps(caps_per_prompt, indicators_per_prompt) -> list[list[int]] | None:
    if caps_per_prompt is None:
        return None
    if len(caps_per_prompt) != len(indicators_per_prompt):
        raise ValueError(
            f"caps_per_prompt has {len(caps_per_prompt)} prompts, indicators_per_prompt {len(indicators_per_prompt)}"
        )
    for index, (caps, indicators) in enumerate(zip(caps_per_prompt, indicators_per_prompt)):
        if len(caps) != len(indicators):
            raise ValueError(
                f"caps_per_prompt[{index}] has {len(caps)} positions but indicators_per_prompt[{index}] "
                f"has {len(indicators)}"
            )
    return [[int(c) for c in caps] for caps in caps_per_prompt]


def run_lengths(
    indicators_per_prompt: Sequence[Sequence[int]], caps_per_prompt: Sequence[Sequence[int]] | None = None
) -> np.ndarray:
    """Leading ones of ``indicators[t:]`` at every start position t of every prompt, pooled.

    ``caps_per_prompt`` (same shapes) caps each run, e.g. by the tokens a Drafter proposed at t.
    A run stops at the end of its prompt's list.
    """
    caps = _checked_caps(caps_per_prompt, indicators_per_prompt)
    runs = []
    for index, indicators in enumerate(indicators_per_prompt):
        prompt_runs = _leading_ones(indicators, f"indicators_per_prompt[{index}]")
        if caps is not None:
            prompt_runs = [min(run, cap) for run, cap in zip(prompt_runs, caps[index])]
        runs.extend(prompt_runs)
    return np.asarray(runs, dtype=np.int64)


def _interpolated(fn, block: float):
    """fn at a real block size: linear between fn(floor) and fn(ceil) (arrays padded with zeros)."""
    if block < 0 or not math.isfinite(block):
        raise ValueError(f"block must be a finite number >= 0, got {block!r}")
    low = math.floor(block)
    weight = block - low
    if weight == 0:
        return fn(low)
    a, b = np.atleast_1d(fn(low)), np.atleast_1d(fn(low + 1))
    size = max(a.shape[0], b.shape[0])
    a, b = np.pad(a, (0, size - a.shape[0])), np.pad(b, (0, size - b.shape[0]))
    out = (1 - weight) * a + weight * b
    return out if out.shape[0] > 1 else float(out[0])


def expected_run_length(indicators_per_prompt: Sequence[Sequence[int]], block: float) -> float:
    """Mean over all start positions t (of all prompts) of the leading ones of ``indicators[t:]``,
    capped at ``block`` (a real block interpolates between its floor and ceiling).

    This is the expected accepted drafts of a verification that starts at a *uniformly random*
    position. Decoding does not start verifications uniformly: one that starts in a copy region
    jumps over it, so long runs are visited less often than their share of positions and this
    average overstates the acceptance length decoding sees; `walk_acceptance_length` follows the
    positions decoding visits and is what `predict` uses.
    """
    runs = run_lengths(indicators_per_prompt)
    if runs.size == 0:
        raise ValueError("no positions to average over: the indicator lists are empty")
    return float(_interpolated(lambda b: float(np.minimum(runs, b).mean()), block))


def verification_walk(
    indicators_per_prompt: Sequence[Sequence[int]], block: int, caps_per_prompt: Sequence[Sequence[int]] | None = None
) -> tuple[list[int], list[int]]:
    """The greedy verifications along each prompt's text, as decoding visits them.

    From the first position of each list: a verification at position t receives
    d = min(block, cap_t, M - t - 1) drafts (the budget of M tokens leaves room for one more),
    accepts the leading agreements among them and emits one token more; the next starts where it
    ended. Exact for a greedy 2-model chain whose drafter agrees with the text position by position.

    Returns:
        ``(emitted, drafted)``: per verification, tokens emitted (accepted + 1) and drafts received.
    """
    caps = _checked_caps(caps_per_prompt, indicators_per_prompt)
    emitted, drafted = [], []
    for index, indicators in enumerate(indicators_per_prompt):
        runs = _leading_ones(indicators, f"indicators_per_prompt[{index}]")
        length, t = len(runs), 0
        while t < length:
            drafts = min(block, length - t - 1, block if caps is None else caps[index][t])
            accepted = min(runs[t], drafts)
            emitted.append(accepted + 1)
            drafted.append(drafts)
            t += accepted + 1
    return emitted, drafted


def walk_acceptance_length(
    indicators_per_prompt: Sequence[Sequence[int]], block: float, caps_per_prompt: Sequence[Sequence[int]] | None = None
) -> float:
    """L(block): mean tokens emitted per verification along `verification_walk` (tau convention);
    a real block interpolates between its floor and ceiling."""

    def at(b: int) -> float:
        emitted, _ = verification_walk(indicators_per_prompt, b, caps_per_prompt)
        if not emitted:
            raise ValueError("no positions to walk: the indicator lists are empty")
        return float(np.mean(emitted))

    return float(_interpolated(at, block))


def geometric_pmf(alpha: float, block: float) -> np.ndarray:
    """Accepted drafts of one verification of ``block`` drafts, each accepted with probability
    ``alpha`` until the first rejection (`theory.acceptance_length_distribution`); real blocks
    interpolate, block 0 accepts nothing."""

    def at(n: int) -> np.ndarray:
        return np.ones(1) if n == 0 else np.asarray(theory.acceptance_length_distribution(alpha, n))

    return np.atleast_1d(_interpolated(at, block))


def expected_verifications(emitted_pmf: Sequence[float], threshold: int) -> float:
    """Expected verifications until the tokens emitted reach ``threshold`` (mu).

    ``emitted_pmf[j]`` = P(one verification emits j tokens), j >= 1 (``emitted_pmf[0]`` must be 0);
    verifications are independent. Renewal recursion: E[v(m)] = 1 + sum_j P(j) E[v(m - j)],
    E[v(m <= 0)] = 0. When every verification emits exactly L tokens this is ceil(mu / L).
    """
    pmf = np.asarray(emitted_pmf, dtype=np.float64)
    sums_to_one = pmf.ndim == 1 and math.isclose(pmf.sum(), 1.0, abs_tol=1e-9)
    is_distribution = sums_to_one and pmf.size >= 2 and bool(np.all(pmf >= 0))
    if not is_distribution or pmf[0] != 0:
        raise ValueError(
            f"emitted_pmf must be a distribution over j >= 1 tokens (entry 0 equal to 0), got {emitted_pmf!r}"
        )
    if not is_int(threshold, 1):
        raise ValueError(f"threshold (mu) must be an int >= 1, got {threshold!r}")
    expected = np.zeros(threshold + 1)  # expected[m]: verifications still needed for m more tokens
    for m in range(1, threshold + 1):
        steps = np.arange(1, min(m, pmf.shape[0] - 1) + 1)  # emitting j >= m tokens finishes: E[v(<= 0)] = 0
        expected[m] = 1 + float(np.dot(pmf[steps], expected[m - steps]))
    return float(expected[threshold])


# ============================================================================== acceptance
@dataclass(frozen=True)
class BlockAcceptance:
    """One verifier over a stream of blocks of one size.

    Attributes:
        emitted_pmf: P(one verification emits j tokens), j = 0, 1, ... (entry 0 is 0).
        drafted: mean drafts a verification receives (the block, less where the budget or a
            Drafter's shorter proposal cuts it).
    """

    emitted_pmf: np.ndarray
    drafted: float

    @property
    def length(self) -> float:
        """L: expected tokens emitted per verification (accepted + 1)."""
        return float(np.dot(np.arange(self.emitted_pmf.shape[0]), self.emitted_pmf))


@dataclass(frozen=True, eq=False)
class Acceptance:
    """How a verifier accepts the stream of the level below, as a function of the block size b.

    Greedy (``indicators`` set): `verification_walk` along the target's text, the leading
    agreements accepted, each verification's drafts capped by b, the budget and (``caps``, a Drafter
    below) what was proposed there. Sampling (``alpha`` set): each draft accepted with probability
    alpha until the first rejection, at every position (``caps``: only as many as were proposed).
    """

    indicators: tuple[tuple[int, ...], ...] | None = None
    alpha: float | None = None
    caps: tuple[tuple[int, ...], ...] | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def at(self, block: float) -> BlockAcceptance:
        """The verifier over blocks of ``block`` tokens (real sizes interpolate linearly)."""
        low = math.floor(block)
        weight = block - low
        lower = self._at_integer(low)
        if weight == 0:
            return lower
        upper = self._at_integer(low + 1)
        size = max(lower.emitted_pmf.shape[0], upper.emitted_pmf.shape[0])
        pmf = (1 - weight) * np.pad(lower.emitted_pmf, (0, size - lower.emitted_pmf.shape[0])) + weight * np.pad(
            upper.emitted_pmf, (0, size - upper.emitted_pmf.shape[0])
        )
        return BlockAcceptance(pmf, (1 - weight) * lower.drafted + weight * upper.drafted)

    def length(self, block: float) -> float:
        """L(b): expected tokens emitted per verification of a b-token block."""
        return self.at(block).length

    def _at_integer(self, block: int) -> BlockAcceptance:
        if block not in self._cache:
            self._cache[block] = self._greedy(block) if self.indicators is not None else self._sampled(block)
        return self._cache[block]

    def _greedy(self, block: int) -> BlockAcceptance:
        emitted, drafted = verification_walk(self.indicators, block, self.caps)
        if not emitted:
            raise ValueError("no positions to walk: the agreement lists are empty")
        pmf = np.bincount(emitted).astype(np.float64) / len(emitted)
        return BlockAcceptance(pmf, float(np.mean(drafted)))

    def _sampled(self, block: int) -> BlockAcceptance:
        caps = [block] if self.caps is None else [min(c, block) for prompt in self.caps for c in prompt]
        values, counts = np.unique(caps, return_counts=True)
        parts = [geometric_pmf(self.alpha, float(v)) * c for v, c in zip(values, counts)]
        size = max(p.shape[0] for p in parts)
        accepted = sum(np.pad(p, (0, size - p.shape[0])) for p in parts) / counts.sum()
        return BlockAcceptance(np.concatenate([[0.0], accepted]), float(np.dot(values, counts) / counts.sum()))
