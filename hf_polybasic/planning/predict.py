"""Predicted speed of a chain with given K and mu, from a `Profile`.

The time model (`predict`), bottom-up. The bottom drafts a block of K tokens for K x cost(bottom,
1) (a `Drafter`: one ``propose`` call, its own draft length). A level verifying a block of b tokens
pays cost(level, b + 1) plus the block's own time, and emits L(b) tokens
(`hf_polybasic.planning.acceptance`). An intermediate level with threshold mu repeats that until it
holds mu tokens: v = E[verifications to reach mu], so it hands up v x L tokens (Wald) for v x (its
verification + the block below). The target's time per token is (its verification + the block
below) / L_1; plain decoding costs cost(target, 1) per token. Lemma 3.1 with the predicted L_i and
beta = K is reported next to it (`ChainPrediction.lemma_time_per_token`).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import PolybasicConfig
from .. import theory
from .acceptance import expected_verifications, is_int
from .profile_data import TARGET, Profile


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


def checked_chain(profile: Profile, chain: Sequence[str]) -> tuple[str, ...]:
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
    values = (mus,) * count if is_int(mus, 1) else tuple(mus) if isinstance(mus, Sequence) else (mus,)
    if len(values) != count or not all(is_int(v, 1) for v in values):
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
    chain = checked_chain(profile, chain)
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
        if not is_int(K, 1):
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
