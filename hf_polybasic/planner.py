"""Planning a chain from measurements: which models to stack, with which K and mu.

Vocabulary (used the same way in the code):

* the **pool**: the target (label ``"target"``) and the **candidates** (label -> a model or a
  `hf_polybasic.drafters.Drafter`);
* a **profile** (`profile`, `Profile`): each level's forward **cost** per number of tokens fed
  (``cost(label, k)``), and for every ordered pair (upper, lower) the per-position **agreement**
  along the target's own greedy text (under sampling also the **overlap** sum_x min(p_u, p_l));
* a **chain**: labels, target first, in the profile's cost order (most expensive first); the bottom
  drafts, every other level verifies the stream of the level below;
* a **block**: the tokens a level hands up per call (K drafts, or an intermediate's >= mu tokens);
* a **plan** (`plan`, `Plan`): the chain, K and mu with the least predicted time per token.

The time model (`predict`), bottom-up. The bottom drafts a block of K tokens for K x cost(bottom,
1) (a `Drafter`: one ``propose`` call, its own draft length). A level verifying a block of b tokens
pays cost(level, b + 1) plus the block's own time, and emits L(b) tokens (accepted + 1, the tau
convention of `hf_polybasic.stats`). An intermediate level with threshold mu repeats that until it
holds mu tokens: v = E[verifications to reach mu] (the renewal recursion `expected_verifications`
over the distribution of tokens emitted per verification, a smooth version of ceil(mu / L), which
it equals when every verification emits exactly L), so it hands up v x L tokens (Wald) for
v x (its verification + the block below). The target's time per token is (its verification + the
block below) / L_1; plain decoding costs cost(target, 1) per token. Lemma 3.1 with the predicted
L_i and beta = K is reported next to it (`ChainPrediction.lemma_time_per_token`).

L(b): greedy, tokens per verification along `verification_walk`: from the first position of the
target's text, each verification accepts the leading agreements of the pair (capped at b, at the
budget, and for a Drafter at what it proposed there), emits one more token, and the next starts
where it ended; so copy regions with long runs count as such, and as often as decoding visits them
(averaging over every position, `expected_run_length`, would overstate L: a verification jumps over
a long run). Under sampling, the geometric model of `hf_polybasic.theory` with alpha = the mean
overlap. A real-valued b interpolates linearly between the integers around it.

Assumptions, each a source of error that ``hf-polybasic plan --validate`` measures:

* greedy: the stream a level hands up is its own greedy continuation, and it agrees with the
  level above exactly where their argmaxes agree along the *target's* text (the agreement of two
  assistants along their own, diverging text is approximated by it);
* successive verifications are independent draws from the positions of the text;
* the budget cuts blocks near the end of the text (greedy), but EOS and the per-call costs outside
  forward passes (logits processing, Python) are ignored, so tiny models, whose forwards cost
  little, are predicted poorly;
* costs are forward passes against a warm cache of one context length (the first prompt's).
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from . import theory
from .config import PolybasicConfig
from .drafters import Drafter
from .processing import process_positions
from .profiling import forward_cost

TARGET = "target"
MODEL, DRAFTER = "model", "drafter"
PROFILE_FORMAT = 1
# transformers' values for options that neither the call nor the model's generation config sets
HF_DECODING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
# more (K, mu) combinations than this per chain: coordinate search instead of the full grid
MAX_EXHAUSTIVE_SETTINGS = 20_000


# ============================================================================ pure functions
def _is_int(value, minimum: int) -> bool:
    """An int (not a bool) >= minimum."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= minimum


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares nondecreasing fit of ``values`` (isotonic regression, pool adjacent violators).

    Forward costs grow with the tokens fed; a measured decrease is noise, which this spreads over
    its neighbours instead of letting it make a longer forward look cheaper.
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def interpolate_cost(points: Mapping[int, float], k: float) -> float:
    """Seconds of a forward feeding ``k`` tokens from measured ``{tokens: seconds}`` points.

    The points are first made nondecreasing in tokens (`nondecreasing`); then linear in k between
    them, extrapolated from the last two beyond the last (and from the first two below the first);
    one point is a constant.
    """
    if not points:
        raise ValueError("interpolate_cost needs at least one measured (tokens, seconds) point")
    ks = sorted(points)
    ys = nondecreasing([points[x] for x in ks])
    if len(ks) == 1:
        return float(ys[0])
    upper = next((i for i, x in enumerate(ks) if x >= k), len(ks) - 1)
    upper = min(max(upper, 1), len(ks) - 1)
    k0, k1, y0, y1 = ks[upper - 1], ks[upper], ys[upper - 1], ys[upper]
    return float(max(y0 + (y1 - y0) * (k - k0) / (k1 - k0), 0.0))


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
    if not _is_int(threshold, 1):
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


# ================================================================================= profile
def cost_order(kinds: Mapping[str, str], costs: Mapping[str, Mapping[int, float]]) -> tuple[str, ...]:
    """The target, then models by 1-token cost (most expensive first; ties keep their order), then
    Drafters (which can only be the bottom)."""

    def by_cost(label: str) -> float:
        return -interpolate_cost(costs[label], 1)

    models = [label for label, kind in kinds.items() if kind == MODEL and label != TARGET]
    drafters = [label for label, kind in kinds.items() if kind == DRAFTER]
    return (TARGET, *sorted(models, key=by_cost), *sorted(drafters, key=by_cost))


def _pair_key(upper: str, lower: str) -> str:
    return f"{upper} <- {lower}"


@dataclass
class Profile:
    """Measured costs and agreements of a pool; everything `predict` and `plan` need.

    Attributes:
        kinds: label -> "model" or "drafter"; ``"target"`` is a model.
        costs: label -> {tokens fed: seconds of one forward against a warm cache}; a Drafter's
            single entry {1: seconds} is one ``propose`` call, whatever its length.
        agreement: (upper, lower) -> per prompt, 1/0 per position of the target's greedy text:
            whether lower's next token (argmax; a Drafter's first proposed token, none = 0)
            equals upper's (argmax of its processed scores; the target's: the text itself).
        overlaps: (upper, lower) -> per prompt, sum_x min(p_upper, p_lower) per position (a
            Drafter: p_upper of its token, none = 0); measured only under sampling.
        proposal_lengths: Drafter label -> per prompt, tokens it proposed at each position.
        draft_lengths: Drafter label -> its longest draft (used when proposal lengths are absent).
        prefill: model label -> seconds of its forward over a (mean-length) prompt, paid once per
            ``generate`` call by every model of a chain; missing labels count 0.
        decoding: the decoding options profiled (``do_sample``, ``temperature``, ...).
        info: free-form description (prompts, budget, machine).
        models: label -> the objects profiled; not saved to JSON (a loaded profile has none).
    """

    kinds: dict[str, str]
    costs: dict[str, dict[int, float]]
    agreement: dict[tuple[str, str], list[list[int]]]
    overlaps: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    proposal_lengths: dict[str, list[list[int]]] = field(default_factory=dict)
    draft_lengths: dict[str, int] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)
    decoding: dict[str, Any] = field(default_factory=lambda: {"do_sample": False})
    info: dict[str, Any] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    _acceptances: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.kinds = dict(self.kinds)
        self.costs = {label: {int(k): float(v) for k, v in points.items()} for label, points in self.costs.items()}
        self.prefill = {label: float(seconds) for label, seconds in self.prefill.items()}
        self._check_levels()
        self._check_pairs()

    def _check_levels(self) -> None:
        if self.kinds.get(TARGET) != MODEL:
            raise ValueError(f"Profile.kinds must hold {TARGET!r} as a 'model', got {self.kinds.get(TARGET)!r}")
        for table_name, table in (("costs", self.costs), ("prefill", self.prefill)):
            unknown = sorted(set(table) - set(self.kinds))
            if unknown:
                raise ValueError(f"Profile.{table_name} has labels {unknown} that are not in Profile.kinds")
        for label, kind in self.kinds.items():
            if kind not in (MODEL, DRAFTER):
                raise ValueError(f"Profile.kinds[{label!r}] must be 'model' or 'drafter', got {kind!r}")
            if not self.costs.get(label):
                raise ValueError(f"Profile.costs has no measurements for {label!r}")
            for k, seconds in self.costs[label].items():
                if k < 1 or not seconds > 0:
                    raise ValueError(
                        f"Profile.costs[{label!r}][{k}] must be > 0 seconds for k >= 1 tokens, got {seconds!r}"
                    )
            if kind == DRAFTER and label not in self.proposal_lengths and label not in self.draft_lengths:
                raise ValueError(f"Drafter {label!r} needs proposal_lengths or draft_lengths in the Profile")
        if any(seconds < 0 for seconds in self.prefill.values()):
            raise ValueError(f"Profile.prefill must hold seconds >= 0, got {self.prefill}")

    def _check_pairs(self) -> None:
        for table_name, table in (("agreement", self.agreement), ("overlaps", self.overlaps)):
            for upper, lower in table:
                for label in (upper, lower):
                    if label not in self.kinds:
                        raise ValueError(f"Profile.{table_name} pair ({upper!r}, {lower!r}): unknown label {label!r}")
                if self.kinds[upper] == DRAFTER:
                    raise ValueError(f"Profile.{table_name} pair ({upper!r}, {lower!r}): a Drafter never verifies")
        if self.sampling:
            missing = sorted(set(self.agreement) - set(self.overlaps))
            if missing:
                raise ValueError(f"a sampling Profile needs overlaps for every pair; missing {missing}")

    # --- reading ----------------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        return bool(self.decoding.get("do_sample"))

    @property
    def order(self) -> tuple[str, ...]:
        """The target, then models by 1-token cost (most expensive first), then Drafters."""
        return cost_order(self.kinds, self.costs)

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.order[1:]

    def is_drafter(self, label: str) -> bool:
        return self.kinds[label] == DRAFTER

    def cost(self, label: str, k: float) -> float:
        """Seconds of one forward of ``label`` feeding k tokens (interpolated; a Drafter: one call)."""
        if label not in self.costs:
            raise ValueError(f"unknown label {label!r}; the profile has {list(self.order)}")
        return interpolate_cost(self.costs[label], k)

    def draft_length(self, label: str) -> int:
        """A Drafter's longest draft."""
        if label in self.draft_lengths:
            return int(self.draft_lengths[label])
        return max((max(p, default=0) for p in self.proposal_lengths[label]), default=0)

    def _pair(self, upper: str, lower: str) -> tuple[str, str]:
        key = (upper, lower)
        if key not in self.agreement:
            raise ValueError(
                f"the profile has no agreement data for {_pair_key(upper, lower)}; chains must list levels in the "
                f"profile's cost order {list(self.order)}"
            )
        return key

    def acceptance_rate(self, upper: str, lower: str) -> float:
        """Mean per-token agreement of the pair (greedy) or mean overlap (sampling)."""
        key = self._pair(upper, lower)
        values = [v for prompt in (self.overlaps if self.sampling else self.agreement)[key] for v in prompt]
        return float(np.mean(values)) if values else 0.0

    def acceptance(self, upper: str, lower: str) -> Acceptance:
        """The `Acceptance` model of ``upper`` verifying ``lower``'s stream (cached: treat the
        agreement and overlap tables as read-only once built)."""
        key = self._pair(upper, lower)
        if key not in self._acceptances:
            self._acceptances[key] = self._build_acceptance(*key)
        return self._acceptances[key]

    def _build_acceptance(self, upper: str, lower: str) -> Acceptance:
        indicators = tuple(tuple(p) for p in self.agreement[(upper, lower)])
        caps = None
        if self.is_drafter(lower):
            caps = self.proposal_lengths.get(lower) or [[self.draft_length(lower)] * len(p) for p in indicators]
            caps = tuple(tuple(p) for p in caps)
        if not self.sampling:
            return Acceptance(indicators=indicators, caps=caps)
        values = np.asarray([v for p in self.overlaps[(upper, lower)] for v in p], dtype=np.float64)
        if caps is not None:
            proposed = np.asarray([c for p in caps for c in p]) > 0
            values = values[proposed] if proposed.any() else values  # alpha of the tokens it did propose
        alpha = float(np.clip(values.mean(), 0.0, 1.0)) if values.size else 0.0
        return Acceptance(alpha=alpha, caps=caps)

    def models_for(self, chain: Sequence[str]) -> list:
        """The objects of ``chain[1:]`` (the ``assistant_models`` list), strongest first."""
        missing = [label for label in chain[1:] if label not in self.models]
        if missing:
            raise ValueError(
                f"the profile holds no objects for {missing} (a Profile loaded from JSON has none); "
                "pass them with plan(profile, candidates={label: model, ...})"
            )
        return [self.models[label] for label in chain[1:]]

    # --- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; the model objects are left out."""
        pairs = []
        for upper, lower in self.agreement:
            pairs.append(
                {
                    "upper": upper,
                    "lower": lower,
                    "agreement": [list(map(int, p)) for p in self.agreement[(upper, lower)]],
                    "overlaps": [list(map(float, p)) for p in self.overlaps[(upper, lower)]]
                    if (upper, lower) in self.overlaps
                    else None,
                }
            )
        return {
            "format": PROFILE_FORMAT,
            "kinds": dict(self.kinds),
            "costs": {label: {str(k): v for k, v in sorted(points.items())} for label, points in self.costs.items()},
            "pairs": pairs,
            "proposal_lengths": {k: [list(map(int, p)) for p in v] for k, v in self.proposal_lengths.items()},
            "draft_lengths": dict(self.draft_lengths),
            "prefill": dict(self.prefill),
            "decoding": dict(self.decoding),
            "info": dict(self.info),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Inverse of `to_dict`."""
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a profile of format {PROFILE_FORMAT} (got format {data.get('format')!r})")
        agreement, overlaps = {}, {}
        for pair in data["pairs"]:
            key = (pair["upper"], pair["lower"])
            agreement[key] = pair["agreement"]
            if pair.get("overlaps") is not None:
                overlaps[key] = pair["overlaps"]
        return cls(
            kinds=dict(data["kinds"]),
            costs={label: {int(k): v for k, v in points.items()} for label, points in data["costs"].items()},
            agreement=agreement,
            overlaps=overlaps,
            proposal_lengths=dict(data.get("proposal_lengths", {})),
            draft_lengths=dict(data.get("draft_lengths", {})),
            prefill=dict(data.get("prefill", {})),
            decoding=dict(data.get("decoding", {"do_sample": False})),
            info=dict(data.get("info", {})),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    # --- report ------------------------------------------------------------------------------
    def markdown(self) -> str:
        """Cost table (relative to the target's forward of the same length) and pair table."""
        sizes = sorted({k for points in self.costs.values() for k in points})
        target_ms = 1000 * self.cost(TARGET, 1)
        lines = [
            f"Costs: one forward feeding k tokens against a warm cache, relative to the target's "
            f"forward of the same k (target 1-token forward: {target_ms:.2f} ms); a Drafter: one propose call.",
            "",
            "| level | kind | ms (k=1) | prefill ms | " + " | ".join(f"k={k}" for k in sizes) + " |",
            "|---|---|---:|---:|" + "---:|" * len(sizes),
        ]
        for label in self.order:
            cells = [f"{self.cost(label, k) / self.cost(TARGET, k):.3f}" for k in sizes]
            ms, prefill = 1000 * self.cost(label, 1), 1000 * self.prefill.get(label, 0.0)
            lines.append(f"| {label} | {self.kinds[label]} | {ms:.2f} | {prefill:.1f} | " + " | ".join(cells) + " |")
        what = "mean overlap sum_x min(p_upper, p_lower)" if self.sampling else "per-token greedy agreement"
        lines += [
            "",
            f"Acceptance along the target's greedy text ({what}); L(b) = predicted tokens per verification of a "
            "b-token block (accepted + 1).",
            "",
            "| upper <- lower | acceptance rate | L(2) | L(4) | L(8) |",
            "|---|---:|---:|---:|---:|",
        ]
        for upper, lower in self.agreement:
            acceptance = self.acceptance(upper, lower)
            lengths = " | ".join(f"{acceptance.length(b):.2f}" for b in (2, 4, 8))
            lines.append(f"| {_pair_key(upper, lower)} | {self.acceptance_rate(upper, lower):.3f} | {lengths} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.markdown()


# ============================================================================== profiling
def decoding_options(target, **options) -> dict[str, Any]:
    """The decoding settings as `generate` resolves them: the call's value, else the target's
    generation config, else transformers' default (e.g. top_k=50 when sampling)."""
    config = getattr(target, "generation_config", None)
    do_sample = options.get("do_sample")
    resolved = {"do_sample": bool(getattr(config, "do_sample", False) if do_sample is None else do_sample)}
    for name, default in HF_DECODING_DEFAULTS.items():
        value = options.get(name)
        if value is None:
            value = getattr(config, name, None)
        resolved[name] = default if value is None else value
    return resolved


def decoding_processors(decoding: Mapping[str, Any]) -> LogitsProcessorList:
    """The logits processors `generate` builds for these options (in its order)."""
    processors = LogitsProcessorList()
    if decoding.get("repetition_penalty") not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(decoding["repetition_penalty"]))
    if decoding.get("do_sample"):
        if decoding.get("temperature") not in (None, 1.0):
            processors.append(TemperatureLogitsWarper(decoding["temperature"]))
        if decoding.get("top_k") not in (None, 0):
            processors.append(TopKLogitsWarper(top_k=decoding["top_k"], min_tokens_to_keep=1))
        if decoding.get("top_p") is not None and decoding["top_p"] < 1.0:
            processors.append(TopPLogitsWarper(top_p=decoding["top_p"], min_tokens_to_keep=1))
        if decoding.get("min_p") is not None:
            processors.append(MinPLogitsWarper(min_p=decoding["min_p"], min_tokens_to_keep=1))
    return processors


def encode_prompt(tokenizer, prompt) -> torch.LongTensor:
    """[1, L] ids: a string (chat-templated when the tokenizer has a template), chat messages, or ids."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(1, -1) if prompt.dim() == 1 else prompt
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"a prompt of token ids must have shape [L] or [1, L], got {tuple(prompt.shape)}")
        return ids.long().cpu()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return torch.tensor([list(prompt)], dtype=torch.long)
    if tokenizer is None:
        raise ValueError("text or chat prompts need a tokenizer; pass tokenizer= or give token ids")
    if isinstance(prompt, str):
        if getattr(tokenizer, "chat_template", None):
            prompt = [{"role": "user", "content": prompt}]
        else:
            return tokenizer(prompt, return_tensors="pt")["input_ids"].long()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        encoded = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return encoded["input_ids"].long()
    raise ValueError(f"a prompt must be a string, chat messages or token ids, got {type(prompt).__name__}")


def _checked_candidates(candidates) -> dict[str, Any]:
    if not isinstance(candidates, Mapping) or not candidates:
        raise ValueError("candidates must be a non-empty dict label -> model or Drafter")
    for label, candidate in candidates.items():
        if not isinstance(label, str) or not label or label == TARGET:
            raise ValueError(f"candidate labels must be non-empty strings other than {TARGET!r}, got {label!r}")
        is_model = isinstance(candidate, torch.nn.Module) and hasattr(candidate, "config")
        if not isinstance(candidate, Drafter) and not is_model:
            raise TypeError(
                f"candidates[{label!r}] must be a transformers model or a hf_polybasic.drafters.Drafter, "
                f"got {type(candidate).__name__}"
            )
    return dict(candidates)


def _vocab_size(model) -> int:
    return model.config.get_text_config(decoder=True).vocab_size


@torch.no_grad()
def _teacher_forced_logits(model, sequence: torch.LongTensor, count: int, vocab: int) -> torch.Tensor:
    """[count, vocab] float32 raw logits predicting the last ``count`` tokens of ``sequence`` ([1, L]),
    from one forward pass; columns cut or padded (-inf) to the target's vocabulary."""
    inputs = sequence[:, :-1].to(model.device)
    kwargs = {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(input_ids=inputs, use_cache=False, **kwargs).logits[0, -count:].float().cpu()
    if logits.shape[1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[1]), value=float("-inf"))
    return logits[:, :vocab]


@dataclass
class _LevelReading:
    """What one level did along one prompt's reference text (M positions)."""

    tokens: torch.LongTensor  # [M] its token at each position; -1 = no proposal (Drafter)
    probs: torch.Tensor | None = None  # [M, V] processed distribution (sampling, models)
    lengths: list[int] | None = None  # Drafter: tokens proposed at each position
    seconds_per_token: float | None = None  # models: the teacher-forced forward's seconds per token fed


def _read_drafter(drafter: Drafter, sequence: torch.LongTensor, start: int, budget: int, timings: list):
    """Propose at every position of the reference (its first token and length), timing each call."""
    tokens, lengths = [], []
    for t in range(sequence.shape[1] - start):
        started = time.perf_counter()
        proposal, _ = drafter.propose(sequence[:, : start + t], budget)
        timings.append(time.perf_counter() - started)
        lengths.append(int(proposal.shape[0]))
        tokens.append(int(proposal[0]) if proposal.shape[0] else -1)
    return _LevelReading(tokens=torch.tensor(tokens, dtype=torch.long), lengths=lengths)


def _read_model(model, sequence, start, processors, sampling: bool, vocab: int) -> _LevelReading:
    """Argmax (and, sampling, the processed distribution) at every position, from one forward."""
    count = sequence.shape[1] - start
    started = time.perf_counter()
    logits = _teacher_forced_logits(model, sequence, count, vocab)  # [M, V]
    per_token = (time.perf_counter() - started) / (sequence.shape[1] - 1)
    scores = process_positions(processors, sequence, start, logits)
    probs = scores.softmax(-1) if sampling else None
    return _LevelReading(tokens=scores.argmax(-1), probs=probs, seconds_per_token=per_token)


def _pair_readings(upper: _LevelReading, lower: _LevelReading, sampling: bool) -> tuple[list[int], list[float] | None]:
    agreement = (upper.tokens == lower.tokens).int().tolist()
    if not sampling:
        return agreement, None
    if lower.probs is not None:
        overlap = torch.minimum(upper.probs, lower.probs).sum(-1)
    else:  # a Drafter's point mass: p_upper of its token, 0 where it proposed nothing
        proposed = lower.tokens.clamp(min=0)
        overlap = upper.probs.gather(1, proposed.unsqueeze(1)).squeeze(1) * (lower.tokens >= 0)
    return agreement, overlap.tolist()


@torch.no_grad()
def profile(
    target,
    candidates: Mapping[str, Any],
    tokenizer,
    prompts: Sequence[Any],
    *,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    max_new_tokens: int = 48,
    block_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 3,
    progress: bool = True,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> Profile:
    """Measure the costs and agreements of a pool along the target's own greedy text.

    Args:
        target: the model whose output must not change.
        candidates: label -> a cheaper model or a `Drafter` (e.g. ``PromptLookup``).
        tokenizer: encodes text / chat prompts (chat template when it has one); None for id prompts.
        prompts: strings, chat message lists, or token ids ([L] / [1, L]).
        do_sample, temperature, top_p, top_k, min_p, repetition_penalty: the decoding the plan is
            for, resolved as `generate` resolves them (`decoding_options`).
        max_new_tokens: length of the reference text per prompt (the target's greedy continuation).
        block_sizes: tokens fed per timed forward; costs in between are interpolated.
        repeats: timed forwards per (model, block size); the median is kept.
        progress: show progress bars.
        generate_kwargs: extra options for the reference ``target.generate`` (e.g. ``eos_token_id``).
    """
    pool = _checked_candidates(candidates)
    prompts = list(prompts) if prompts is not None else []
    if not prompts:
        raise ValueError("prompts must not be empty: give a few prompts like the ones the plan is for")
    if not _is_int(max_new_tokens, 2):
        raise ValueError(f"max_new_tokens must be an int >= 2, got {max_new_tokens!r}")
    sizes = sorted({1, *(int(k) for k in block_sizes)})
    if sizes[0] < 1:
        raise ValueError(f"block_sizes must be ints >= 1, got {list(block_sizes)}")
    if not _is_int(repeats, 1):
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    decoding = decoding_options(
        target, do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sequences = _reference_texts(target, tokenizer, prompts, max_new_tokens, decoding, generate_kwargs, progress)
    models = {TARGET: target, **pool}
    kinds = {label: DRAFTER if isinstance(m, Drafter) else MODEL for label, m in models.items()}
    readings, propose_seconds = _read_levels(models, sequences, decoding, max_new_tokens, progress)
    costs = _measure_costs(models, sequences[0][0], sizes, repeats, propose_seconds, progress)
    agreement, overlaps = _pair_tables(cost_order(kinds, costs), kinds, readings, decoding["do_sample"])
    drafters = [label for label, kind in kinds.items() if kind == DRAFTER]
    proposal_lengths = {label: [r[label].lengths for r in readings] for label in drafters}
    draft_lengths = {
        label: int(getattr(models[label], "num_tokens", 0) or max(max(p, default=0) for p in proposal_lengths[label]))
        for label in drafters
    }
    info = {
        "prompts": len(sequences),
        "prompt_tokens": [start for _, start in sequences],
        "reference_tokens": [s.shape[1] - start for s, start in sequences],
        "max_new_tokens": max_new_tokens,
        "block_sizes": sizes,
        "repeats": repeats,
        "cost_context_tokens": int(sequences[0][0].shape[1]),
        "labels": {label: _describe(m) for label, m in models.items()},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    return Profile(
        kinds=kinds, costs=costs, agreement=agreement, overlaps=overlaps, proposal_lengths=proposal_lengths,
        draft_lengths=draft_lengths, prefill=_prefill_seconds(readings, sequences), decoding=decoding, info=info,
        models=models,
    )


def _reference_texts(target, tokenizer, prompts, max_new_tokens, decoding, generate_kwargs, progress):
    """(prompt + the target's greedy continuation [1, L + m] on CPU, L) per prompt that got m >= 1."""
    sequences = []
    for prompt in tqdm(prompts, desc="reference (target greedy)", disable=not progress):
        ids = encode_prompt(tokenizer, prompt).to(target.device)
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            repetition_penalty=decoding["repetition_penalty"], **dict(generate_kwargs or {}),
        )
        if out.shape[1] > ids.shape[1]:  # else EOS at once: no positions to profile
            sequences.append((out.cpu(), ids.shape[1]))
    if not sequences:
        raise ValueError("the target generated no token for any prompt; profile other prompts")
    return sequences


def _read_levels(models, sequences, decoding, max_new_tokens, progress):
    """Per prompt, label -> `_LevelReading`; and per Drafter the seconds of each propose call."""
    processors = decoding_processors(decoding)
    vocab = _vocab_size(models[TARGET])
    propose_seconds = {label: [] for label, m in models.items() if isinstance(m, Drafter)}
    bar = tqdm(total=len(sequences) * len(models), desc="teacher forcing", disable=not progress)
    readings = []
    for sequence, start in sequences:
        here = {}
        for label, model in models.items():
            if isinstance(model, Drafter):
                here[label] = _read_drafter(model, sequence, start, max_new_tokens, propose_seconds[label])
            else:  # the target's forward too: it times its prefill (and gives p_target when sampling)
                here[label] = _read_model(model, sequence, start, processors, decoding["do_sample"], vocab)
            bar.update()
        here[TARGET].tokens = sequence[0, start:]  # its argmax is the text (one long forward may round a tie)
        readings.append(here)
    bar.close()
    return readings, propose_seconds


def _measure_costs(models, prefix, sizes, repeats, propose_seconds, progress) -> dict[str, dict[int, float]]:
    """label -> {k: seconds}: `profiling.forward_cost` after ``prefix``; a Drafter: median propose."""
    costs = {}
    total = sum(1 if isinstance(m, Drafter) else len(sizes) for m in models.values())
    bar = tqdm(total=total, desc="forward costs", disable=not progress)
    for label, model in models.items():
        if isinstance(model, Drafter):
            costs[label] = {1: max(statistics.median(propose_seconds[label]), 1e-9)}
            bar.update()
            continue
        costs[label] = {}
        for k in sizes:
            costs[label][k] = forward_cost(model, prefix.to(model.device), k, repeats)
            bar.update()
    bar.close()
    return costs


def _pair_tables(order, kinds, readings, sampling: bool):
    """(agreement, overlaps) for every (upper, lower) with upper above lower in ``order``."""
    agreement, overlaps = {}, {}
    for i, upper in enumerate(order):
        if kinds[upper] == DRAFTER:
            continue
        for lower in order[i + 1 :]:
            pairs = [_pair_readings(here[upper], here[lower], sampling) for here in readings]
            agreement[(upper, lower)] = [indicators for indicators, _ in pairs]
            if sampling:
                overlaps[(upper, lower)] = [overlap for _, overlap in pairs]
    return agreement, overlaps


def _prefill_seconds(readings, sequences) -> dict[str, float]:
    """Prefill of the mean prompt per model: the median per-token rate of its teacher-forced
    forwards (robust to a first, cold call) times the mean prompt length."""
    mean_prompt = statistics.mean(start for _, start in sequences)
    labels = [label for label, reading in readings[0].items() if reading.seconds_per_token is not None]
    return {
        label: statistics.median(here[label].seconds_per_token for here in readings) * mean_prompt for label in labels
    }


def _describe(model) -> str:
    if isinstance(model, Drafter):
        return repr(model)
    dtype = next((p.dtype for p in model.parameters()), None)
    name = str(getattr(model.config, "name_or_path", "") or "").rstrip("/").split("/")[-1]
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", "?")
    return f"{type(model).__name__}({name or '-'}, {layers} layers, {str(dtype).replace('torch.', '')})"


# ============================================================================== prediction
@dataclass(frozen=True)
class LevelPrediction:
    """One level of a predicted chain.

    Attributes:
        label: the level.
        role: "target", "intermediate" or "drafter".
        block_below: tokens of the stream below per verification (b); None for the bottom.
        verify_seconds: cost(label, b + 1) of one verification; for the bottom, one draft's time.
        acceptance_length: L(b), tokens emitted per verification; None for the bottom.
        verifications: per block handed up (intermediates; 1 for the target, 0 for the bottom).
        block: tokens handed up per call (the target: tokens emitted per verification).
        seconds: time of one call of this level, everything below included.
    """

    label: str
    role: str
    block_below: float | None
    verify_seconds: float
    acceptance_length: float | None
    verifications: float
    block: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ChainPrediction:
    """Predicted speed of one chain with one (K, mu) setting.

    Attributes:
        chain: labels, target first; ``("target",)`` is plain decoding.
        num_draft_tokens: K, or None when the bottom is a Drafter (it sets its own length) or plain.
        block_thresholds: mu per intermediate level, strongest first.
        time_per_token: predicted seconds per generated token.
        plain_time_per_token: cost(target, 1).
        levels: per level, target first.
        lemma_time_per_token: Lemma 3.1 (`theory.polybasic_time_per_token`) with T_i = 1-token
            costs, the predicted per-verification L_i and beta = K (1 for a Drafter); None for plain.
        prefill_seconds: every model's prefill of the prompt, paid once per ``generate`` call.
        plain_prefill_seconds: the target's alone.
    """

    chain: tuple[str, ...]
    num_draft_tokens: int | None
    block_thresholds: tuple[int, ...]
    time_per_token: float
    plain_time_per_token: float
    levels: tuple[LevelPrediction, ...] = ()
    lemma_time_per_token: float | None = None
    prefill_seconds: float = 0.0
    plain_prefill_seconds: float = 0.0

    @property
    def speedup(self) -> float:
        """Over plain decoding, per token of a long generation (prefills amortised away)."""
        return self.plain_time_per_token / self.time_per_token

    def seconds_for(self, new_tokens: int | None) -> float:
        """Predicted seconds of a ``generate`` call making ``new_tokens`` tokens, prefills included
        (None: seconds per token of a long generation)."""
        if new_tokens is None:
            return self.time_per_token
        return self.prefill_seconds + new_tokens * self.time_per_token

    def speedup_for(self, new_tokens: int | None) -> float:
        """Over plain decoding, for calls making ``new_tokens`` tokens (None: `speedup`)."""
        if new_tokens is None:
            return self.speedup
        return (self.plain_prefill_seconds + new_tokens * self.plain_time_per_token) / self.seconds_for(new_tokens)

    @property
    def lemma_speedup(self) -> float | None:
        return None if self.lemma_time_per_token is None else self.plain_time_per_token / self.lemma_time_per_token

    @property
    def is_plain(self) -> bool:
        return len(self.chain) == 1

    @property
    def name(self) -> str:
        return "plain generate (target alone)" if self.is_plain else " <- ".join(self.chain)

    @property
    def settings(self) -> str:
        parts = []
        if self.num_draft_tokens is not None:
            parts.append(f"K={self.num_draft_tokens}")
        if self.block_thresholds:
            mu = self.block_thresholds
            parts.append(f"mu={mu[0] if len(mu) == 1 else mu}")
        return ", ".join(parts) or "-"

    def config(self) -> PolybasicConfig | None:
        """The `PolybasicConfig` to run this chain with (None for plain decoding); the constant
        schedule, which is what the prediction models."""
        if self.is_plain:
            return None
        options = {"schedule": "constant"}
        if self.num_draft_tokens is not None:
            options["num_draft_tokens"] = self.num_draft_tokens
        if self.block_thresholds:
            mu = self.block_thresholds
            options["block_threshold"] = mu[0] if len(mu) == 1 else tuple(mu)
        return PolybasicConfig(**options)

    def level(self, label: str) -> LevelPrediction:
        return next(level for level in self.levels if level.label == label)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": list(self.chain),
            "num_draft_tokens": self.num_draft_tokens,
            "block_thresholds": list(self.block_thresholds),
            "time_per_token": self.time_per_token,
            "speedup": self.speedup,
            "lemma_time_per_token": self.lemma_time_per_token,
            "lemma_speedup": self.lemma_speedup,
            "prefill_seconds": self.prefill_seconds,
            "levels": [level.to_dict() for level in self.levels],
        }


def _checked_chain(profile: Profile, chain: Sequence[str]) -> tuple[str, ...]:
    if isinstance(chain, str) or not isinstance(chain, Sequence) or not chain:
        raise ValueError(f"chain must be a non-empty list of labels, target first, got {chain!r}")
    chain = tuple(chain)
    if chain[0] != TARGET:
        raise ValueError(f"chain must start with {TARGET!r}, got {list(chain)}")
    unknown = [label for label in chain if label not in profile.kinds]
    if unknown:
        raise ValueError(f"chain has unknown label(s) {unknown}; the profile has {list(profile.order)}")
    if len(set(chain)) != len(chain):
        raise ValueError(f"chain lists a level twice: {list(chain)}")
    for label in chain[:-1]:
        if profile.is_drafter(label):
            raise ValueError(f"{label!r} is a Drafter: it only drafts, so it can only be the bottom (last) of a chain")
    order = profile.order
    positions = [order.index(label) for label in chain]
    if positions != sorted(positions):
        raise ValueError(f"chain {list(chain)} is not in the profile's cost order {list(order)} (most expensive first)")
    return chain


def _checked_thresholds(mus, count: int) -> tuple[int, ...]:
    if count == 0:
        return ()
    if mus is None:
        raise ValueError(f"the chain has {count} intermediate level(s): give mu (an int or one per level)")
    values = (mus,) * count if _is_int(mus, 1) else tuple(mus) if isinstance(mus, Sequence) else (mus,)
    if len(values) != count or not all(_is_int(v, 1) for v in values):
        raise ValueError(f"mus must be an int >= 1 or {count} of them (one per intermediate level), got {mus!r}")
    return tuple(int(v) for v in values)


def predict(chain: Sequence[str], K: int | None, mus, profile: Profile) -> ChainPrediction:
    """Predicted time per token of ``chain`` with K drafts and thresholds ``mus`` (see module doc).

    Args:
        chain: labels, target first, in the profile's cost order; a Drafter only last.
        K: drafts per round of a model bottom (ignored, may be None, for a Drafter bottom).
        mus: mu per intermediate level (an int for all, or one each, strongest first); unused
            (may be None) without intermediate levels.
        profile: the measurements.
    """
    chain = _checked_chain(profile, chain)
    plain = profile.cost(TARGET, 1)
    prefills = {"prefill_seconds": sum(profile.prefill.get(label, 0.0) for label in chain),
                "plain_prefill_seconds": profile.prefill.get(TARGET, 0.0)}
    if len(chain) == 1:
        return ChainPrediction(chain, None, (), plain, plain, **prefills)
    thresholds = _checked_thresholds(mus, len(chain) - 2)
    bottom = chain[-1]
    if profile.is_drafter(bottom):
        K = None
        block = float(profile.draft_length(bottom))  # its longest draft; where it proposed less is in its caps
        seconds = profile.cost(bottom, 1)  # one propose call, whatever it returns
    else:
        if not _is_int(K, 1):
            raise ValueError(f"K (num_draft_tokens) must be an int >= 1 for a model at the bottom, got {K!r}")
        K = int(K)
        block = float(K)
        seconds = K * profile.cost(bottom, 1)
    levels = [LevelPrediction(bottom, "drafter", None, seconds, None, 0.0, block, seconds)]
    for index in range(len(chain) - 2, -1, -1):
        label, below_label = chain[index], chain[index + 1]
        at = profile.acceptance(label, below_label).at(block)
        # the stream below costs in proportion to the drafts a verification really gets (the budget cuts
        # blocks near the end); a Drafter's call costs the same whatever it returns
        below_seconds = seconds if profile.is_drafter(below_label) else seconds * at.drafted / block
        verify = profile.cost(label, at.drafted + 1)
        per_verification = verify + below_seconds
        if index == 0:
            target = LevelPrediction(label, "target", at.drafted, verify, at.length, 1.0, at.length, per_verification)
            levels.append(target)
            time_per_token = per_verification / at.length
            break
        rounds = expected_verifications(at.emitted_pmf, thresholds[index - 1])
        block, seconds = rounds * at.length, rounds * per_verification
        levels.append(LevelPrediction(label, "intermediate", at.drafted, verify, at.length, rounds, block, seconds))
    levels.reverse()
    lemma = theory.polybasic_time_per_token(
        [profile.cost(label, 1) for label in chain],
        [level.acceptance_length for level in levels[:-1]],
        1 if K is None else K,
    )
    return ChainPrediction(chain, K, thresholds, time_per_token, plain, tuple(levels), float(lemma), **prefills)


def predict_time_per_token(chain: Sequence[str], K: int | None, mus, profile: Profile) -> float:
    """`predict`'s time per token (seconds)."""
    return predict(chain, K, mus, profile).time_per_token


# ================================================================================== planning
DEFAULT_K_GRID = range(1, 13)
DEFAULT_MU_GRID = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24)


def best_setting(
    profile: Profile,
    chain: Sequence[str],
    k_grid: Sequence[int] = DEFAULT_K_GRID,
    mu_grid: Sequence[int] = DEFAULT_MU_GRID,
) -> ChainPrediction:
    """The (K, mu) on the grids with the least predicted time for ``chain``.

    Exhaustive up to `MAX_EXHAUSTIVE_SETTINGS` combinations, else coordinate search (each mu in
    turn, from the middle of the grid, until no change helps). Ties keep the smaller K and mu.
    """
    chain = _checked_chain(profile, chain)
    if len(chain) == 1:
        return predict(chain, None, None, profile)
    ks = [None] if profile.is_drafter(chain[-1]) else list(k_grid)
    intermediates = len(chain) - 2
    mu_grid = sorted(set(mu_grid))
    if not ks or (intermediates and not mu_grid):
        raise ValueError("k_grid and mu_grid must not be empty")
    best = None
    for K in ks:
        if intermediates == 0 or len(mu_grid) ** intermediates <= MAX_EXHAUSTIVE_SETTINGS:
            combos = itertools.product(mu_grid, repeat=intermediates)
            candidates = (predict(chain, K, combo, profile) for combo in combos)
            found = min(candidates, key=lambda p: p.time_per_token)
        else:
            found = _coordinate_search(profile, chain, K, mu_grid, intermediates)
        if best is None or found.time_per_token < best.time_per_token:
            best = found
    return best


def _coordinate_search(profile, chain, K, mu_grid, intermediates) -> ChainPrediction:
    current = [mu_grid[len(mu_grid) // 2]] * intermediates
    best = predict(chain, K, current, profile)
    improved = True
    while improved:
        improved = False
        for position in range(intermediates):
            for mu in mu_grid:
                trial = list(current)
                trial[position] = mu
                found = predict(chain, K, trial, profile)
                if found.time_per_token < best.time_per_token:
                    best, current, improved = found, trial, True
    return best


def candidate_chains(profile: Profile, max_levels: int | None = None) -> list[tuple[str, ...]]:
    """Every chain: the target plus a non-empty subset of the candidates in cost order, at most
    one Drafter (at the bottom), at most ``max_levels`` models in all."""
    if max_levels is not None and not _is_int(max_levels, 2):
        raise ValueError(f"max_levels must be an int >= 2 (the target and one assistant), got {max_levels!r}")
    candidates = profile.candidates
    limit = len(candidates) if max_levels is None else min(len(candidates), max_levels - 1)
    chains = []
    for size in range(1, limit + 1):
        for subset in itertools.combinations(candidates, size):  # combinations keep the cost order
            if any(profile.is_drafter(label) for label in subset[:-1]):
                continue
            chains.append((TARGET, *subset))
    return chains


@dataclass(frozen=True)
class Insertion:
    """Theorem 3.2 for inserting a candidate between ``upper`` and ``lower`` of the best chain
    without it, with the planner's predicted numbers (T = 1-token costs, L per verification).

    ``before`` is that chain at the K of ``after`` (the best setting of the chain with it), so that
    beta is the same on both sides.
    """

    upper: str
    new: str
    lower: str
    t_i: float
    t_new: float
    t_next: float
    l_i: float
    l_i_new: float
    l_new: float
    beta: float
    verdict: theory.InsertionVerdict
    before: ChainPrediction
    after: ChainPrediction

    def to_dict(self) -> dict[str, Any]:
        names = ("upper", "new", "lower", "t_i", "t_new", "t_next", "l_i", "l_i_new", "l_new", "beta")
        numbers = {name: getattr(self, name) for name in names}
        verdict = dict(self.verdict.__dict__, paper_says_helps=self.verdict.paper_says_helps)
        return {**numbers, "verdict": verdict, "before": self.before.to_dict(), "after": self.after.to_dict()}


@dataclass(frozen=True)
class Explanation:
    """Why a candidate is in or out of the plan.

    Attributes:
        label: the candidate.
        included: whether the chosen chain uses it.
        best_with: the best chain that uses it.
        best_without: the best chain (or plain decoding) that does not.
        insertion: Theorem 3.2 for inserting it into ``best_without``; None when it would not be a
            middle level there (it would be the new bottom, or ``best_without`` is plain).
        text: one readable paragraph.
    """

    label: str
    included: bool
    best_with: ChainPrediction
    best_without: ChainPrediction
    insertion: Insertion | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "included": self.included,
            "best_with": self.best_with.to_dict(),
            "best_without": self.best_without.to_dict(),
            "insertion": None if self.insertion is None else self.insertion.to_dict(),
            "text": self.text,
        }


def _grown(profile: Profile, chain: tuple[str, ...], label: str) -> tuple[str, ...] | None:
    """``chain`` with ``label`` added at its place in the cost order; None when that is no chain
    (``chain`` is plain decoding, or both would hold a Drafter)."""
    if len(chain) == 1 or (profile.is_drafter(label) and profile.is_drafter(chain[-1])):
        return None
    return tuple(sorted((*chain, label), key=profile.order.index))


def _insertion(profile: Profile, label: str, base: ChainPrediction, best_of: Mapping) -> Insertion | None:
    """Theorem 3.2 for adding ``label`` to ``base``; None unless it lands between two levels."""
    chain = _grown(profile, base.chain, label)
    if chain is None or chain.index(label) == len(chain) - 1:
        return None
    position = chain.index(label)
    after = best_of[chain]
    thresholds = tuple(mu for level, mu in zip(chain[1:-1], after.block_thresholds) if level != label)
    before = predict(base.chain, after.num_draft_tokens, thresholds, profile)
    upper, lower = chain[position - 1], chain[position + 1]
    numbers = dict(
        t_i=profile.cost(upper, 1),
        t_new=profile.cost(label, 1),
        t_next=profile.cost(lower, 1),
        l_i=before.level(upper).acceptance_length,
        l_i_new=after.level(upper).acceptance_length,
        l_new=after.level(label).acceptance_length,
        beta=float(after.num_draft_tokens or 1),
    )
    verdict = theory.insertion_test(**numbers, next_is_drafter=lower == chain[-1])
    return Insertion(upper, label, lower, **numbers, verdict=verdict, before=before, after=after)


def _explanation_text(label: str, included: bool, best_with, best_without, insertion, profile, new_tokens) -> str:
    verb = "in" if included else "out"
    text = (
        f"{label}: {verb}. Best chain with it: {best_with.name} ({best_with.settings}), predicted "
        f"{best_with.speedup_for(new_tokens):.2f}x; best without it: {best_without.name}"
        + ("" if best_without.is_plain else f" ({best_without.settings})")
        + f", {best_without.speedup_for(new_tokens):.2f}x."
    )
    if insertion is None:
        if best_without.is_plain:
            return text + " Nothing without it beats plain decoding, so Theorem 3.2 (a middle level) does not apply."
        if profile.is_drafter(label) and profile.is_drafter(best_without.chain[-1]):
            return text + f" A chain holds one Drafter (at the bottom): it competes with {best_without.chain[-1]}."
        where = "Drafter" if profile.is_drafter(label) else "cheapest model"
        return text + (
            f" As the {where} it would be the new bottom of {best_without.name}, not a middle level, so Theorem 3.2 "
            "does not apply."
        )
    v = insertion.verdict
    exact = "accepts" if v.helps else "rejects"
    paper = "accept" if v.paper_says_helps else "reject"
    return text + (
        f" Theorem 3.2, inserting it between {insertion.upper} and {insertion.lower} of {best_without.name} "
        f"(beta={insertion.beta:g}): the exact Lemma-3.1 test {exact} it "
        f"(saves {v.time_saved_per_token * 1000:+.3f} ms/token: "
        f"{v.upper_saving_per_token * 1000:.3f} at {insertion.upper} + {v.lower_saving_per_token * 1000:.3f} at "
        f"{insertion.lower} - {v.new_cost_per_token * 1000:.3f} running it); the paper's conditions {paper} it "
        f"(1: T_new/T_i = {v.condition_1_lhs:.3f} < L_new(1/L_i - 1/L_i-new) = {v.condition_1_rhs:.3f} "
        f"is {v.condition_1}; "
        f"2: T_new/T_i+1 = {v.condition_2_lhs:.3f} < beta(L_new/L_i - 1) = {v.condition_2_rhs:.3f} is {v.condition_2}; "
        f"T_i={insertion.t_i * 1000:.2f} ms, T_new={insertion.t_new * 1000:.2f} ms, "
        f"T_i+1={insertion.t_next * 1000:.3f} ms, "
        f"L_i={insertion.l_i:.2f}, L_i-new={insertion.l_i_new:.2f}, L_new={insertion.l_new:.2f})."
    )


@dataclass
class Plan:
    """The chosen chain and setting, every evaluated alternative, and why each candidate is in or out.

    Run it with::

        out = target.generate(**inputs, custom_generate=hp.generate,
                              assistant_models=plan.assistant_models, polybasic_config=plan.config)

    (or ``target.generate(**inputs, **plan.generate_kwargs())``, which is plain generate when no
    chain pays).

    Attributes:
        best: the chosen prediction; plain decoding (``chain == ("target",)``) when no chain pays.
        ranking: every chain at its best setting, plain decoding included, fastest first.
        explanations: one per candidate, in the profile's order.
        decoding: the decoding options the profile (and so the plan) is for.
        new_tokens: the plan minimises the time of calls making this many tokens, prefills
            included; None: the time per token of long generations.
    """

    best: ChainPrediction
    ranking: list[ChainPrediction]
    explanations: list[Explanation]
    decoding: dict[str, Any]
    new_tokens: int | None = None
    models: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def chain(self) -> tuple[str, ...]:
        return self.best.chain

    @property
    def is_plain(self) -> bool:
        return self.best.is_plain

    @property
    def config(self) -> PolybasicConfig | None:
        return self.best.config()

    @property
    def predicted_speedup(self) -> float:
        """Over plain decoding, for calls of `new_tokens` tokens (None: long generations)."""
        return self.best.speedup_for(self.new_tokens)

    @property
    def predicted_time_per_token(self) -> float:
        return self.best.time_per_token

    @property
    def assistant_models(self) -> list:
        """The chain below the target, strongest first ([] for plain decoding)."""
        missing = [label for label in self.chain[1:] if label not in self.models]
        if missing:
            raise ValueError(
                f"this plan has no objects for {missing} (its Profile was loaded from JSON); "
                "pass them with plan(profile, candidates={label: model, ...})"
            )
        return [self.models[label] for label in self.chain[1:]]

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``target.generate``: the chain, or nothing (plain decoding)."""
        if self.is_plain:
            return {}
        from .integration import generate

        return {"custom_generate": generate, "assistant_models": self.assistant_models, "polybasic_config": self.config}

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": list(self.chain),
            "config": None if self.config is None else self.config.to_dict(),
            "predicted_speedup": self.predicted_speedup,
            "predicted_time_per_token": self.predicted_time_per_token,
            "plain_time_per_token": self.best.plain_time_per_token,
            "new_tokens": self.new_tokens,
            "decoding": dict(self.decoding),
            "ranking": [row.to_dict() for row in self.ranking],
            "explanations": [e.to_dict() for e in self.explanations],
        }

    def markdown(self) -> str:
        best, n = self.best, self.new_tokens
        horizon = "per token of long generations" if n is None else f"for calls of {n} new tokens, prefills included"
        if self.is_plain:
            runner_up = next((row for row in self.ranking if not row.is_plain), None)
            closest = "" if runner_up is None else f" (closest: {runner_up.name}, {runner_up.speedup_for(n):.2f}x)"
            lines = [
                f"**No chain is predicted to beat plain decoding**{closest}. Use plain `target.generate` "
                "(`plan.assistant_models` is empty; `plan.generate_kwargs()` is {}).",
            ]
        else:
            lines = [
                f"**Plan: {best.name}** (`{self.config!r}`): predicted {self.predicted_speedup:.2f}x plain decoding "
                f"{horizon} ({best.time_per_token * 1000:.2f} vs {best.plain_time_per_token * 1000:.2f} ms/token; "
                f"{best.speedup:.2f}x for long generations).",
                "",
                "    out = target.generate(**inputs, custom_generate=hp.generate,",
                "                          assistant_models=plan.assistant_models, polybasic_config=plan.config)",
            ]
        lines += [
            "",
            f"Chains ranked {horizon}; each at its best setting on the grids.",
            "",
            "| rank | chain | setting | ms/token | prefill ms | predicted speedup (long) | "
            + ("" if n is None else f"predicted speedup ({n} tokens) | ")
            + "Lemma 3.1 speedup | L per level, target first |",
            "|---:|---|---|---:|---:|---:|" + ("" if n is None else "---:|") + "---:|---|",
        ]
        for rank, row in enumerate(self.ranking, 1):
            lemma = "-" if row.lemma_speedup is None else f"{row.lemma_speedup:.2f}x"
            lengths = [f"{level.acceptance_length:.2f}" for level in row.levels if level.acceptance_length is not None]
            horizon_cell = "" if n is None else f"{row.speedup_for(n):.2f}x | "
            lines.append(
                f"| {rank} | {row.name} | {row.settings} | {row.time_per_token * 1000:.2f} | "
                f"{row.prefill_seconds * 1000:.1f} | {row.speedup:.2f}x | {horizon_cell}"
                f"{lemma} | {', '.join(lengths) or '-'} |"
            )
        lines += ["", "Why each candidate is in or out:", ""]
        lines += [f"- {e.text}" for e in self.explanations]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.markdown()


def plan(
    profile: Profile,
    *,
    max_levels: int | None = None,
    k_grid: Sequence[int] = DEFAULT_K_GRID,
    mu_grid: Sequence[int] = DEFAULT_MU_GRID,
    new_tokens: int | None = None,
    candidates: Mapping[str, Any] | None = None,
) -> Plan:
    """The chain (and K, mu) with the least predicted time (per token, or per call of ``new_tokens``
    tokens), or plain decoding when no chain beats it.

    Args:
        profile: from `profile` (or `Profile.load`).
        max_levels: most models in a chain, the target included (default: all candidates).
        k_grid: K values tried for a model at the bottom.
        mu_grid: mu values tried for each intermediate level.
        new_tokens: minimise the time of ``generate`` calls making this many tokens, each model's
            prefill of the prompt included (it does not change a chain's best K and mu, only which
            chain wins: a big middle level pays a big prefill); None: the time per token of long
            generations.
        candidates: label -> object, for a profile loaded from JSON (which holds none).
    """
    if not isinstance(profile, Profile):
        raise TypeError(f"plan() needs a Profile, got {type(profile).__name__}")
    models = dict(profile.models)
    if candidates is not None:
        unknown = sorted(set(candidates) - set(profile.kinds))
        if unknown:
            raise ValueError(f"candidates has label(s) {unknown} that the profile does not know: {list(profile.order)}")
        models.update(candidates)
    k_grid, mu_grid = list(k_grid), list(mu_grid)
    for name, grid in (("k_grid", k_grid), ("mu_grid", mu_grid)):
        if not grid or not all(_is_int(v, 1) for v in grid):
            raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {grid!r}")
    if new_tokens is not None and not _is_int(new_tokens, 1):
        raise ValueError(f"new_tokens must be an int >= 1 or None, got {new_tokens!r}")
    plain = predict((TARGET,), None, None, profile)
    best_of = {chain: best_setting(profile, chain, k_grid, mu_grid) for chain in candidate_chains(profile, max_levels)}
    best_of[(TARGET,)] = plain
    # fastest first; on a tie the shorter chain, so plain decoding wins unless a chain beats it
    ranking = sorted(best_of.values(), key=lambda p: (p.seconds_for(new_tokens), len(p.chain)))
    best = ranking[0]

    explanations = []
    for label in profile.candidates:
        with_it = next((row for row in ranking if label in row.chain), None)
        if with_it is None:  # max_levels excluded every chain with it
            continue
        without = next(row for row in ranking if label not in row.chain)
        grown = _grown(profile, without.chain, label)
        if grown is not None and grown not in best_of:  # the insertion test needs it at its best setting
            best_of[grown] = best_setting(profile, grown, k_grid, mu_grid)
        insertion = _insertion(profile, label, without, best_of)
        included = label in best.chain
        text = _explanation_text(label, included, with_it, without, insertion, profile, new_tokens)
        explanations.append(Explanation(label, included, with_it, without, insertion, text))
    return Plan(best, ranking, explanations, dict(profile.decoding), new_tokens, models)
