"""Choosing the chain: every chain of the pool at its best K and mu, fastest first.

A **chain** is a list of labels, target first, in the profile's cost order (most expensive first);
the bottom drafts, every other level verifies the stream of the level below. A **plan** (`plan`,
`Plan`) is the chain, K and mu with the least predicted time, or plain decoding when no chain beats
it, with an explanation for every candidate (`hf_polybasic.planning.explain`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import PolybasicConfig
from ..generation import generate
from .acceptance import is_int
from .explain import Explanation, explain_candidate, plan_markdown
from .predict import ChainPrediction, checked_chain, predict
from .profile_data import TARGET, Profile

# more (K, mu) combinations than this per chain: coordinate search instead of the full grid
MAX_EXHAUSTIVE_SETTINGS = 20_000
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
    chain = checked_chain(profile, chain)
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
    if max_levels is not None and not is_int(max_levels, 2):
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
        """The plan, the ranking of every chain and why each candidate is in or out
        (`hf_polybasic.planning.explain.plan_markdown`)."""
        return plan_markdown(self)

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
        if not grid or not all(is_int(v, 1) for v in grid):
            raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {grid!r}")
    if new_tokens is not None and not is_int(new_tokens, 1):
        raise ValueError(f"new_tokens must be an int >= 1 or None, got {new_tokens!r}")
    plain = predict((TARGET,), None, None, profile)
    best_of = {chain: best_setting(profile, chain, k_grid, mu_grid) for chain in candidate_chains(profile, max_levels)}
    best_of[(TARGET,)] = plain
    # fastest first; on a tie the shorter chain, so plain decoding wins unless a chain beats it
    ranking = sorted(best_of.values(), key=lambda p: (p.seconds_for(new_tokens), len(p.chain)))
    best = ranking[0]

    def best_of_chain(chain: tuple[str, ...]) -> ChainPrediction:
        if chain not in best_of:  # the insertion test needs the grown chain at its best setting
            best_of[chain] = best_setting(profile, chain, k_grid, mu_grid)
        return best_of[chain]

    explanations = [
        explanation
        for label in profile.candidates
        if (explanation := explain_candidate(profile, label, ranking, best.chain, best_of_chain, new_tokens)) is not None
    ]
    return Plan(best, ranking, explanations, dict(profile.decoding), new_tokens, models)
