"""A `Profile`: the measured costs and agreements of a pool, as data (saved and loaded as JSON).

Vocabulary: the **pool** is the target (label ``"target"``) and the **candidates** (label -> a
model or a `hf_polybasic.drafters.Drafter`); a profile holds each level's forward **cost** per
number of tokens fed (``cost(label, k)``) and, for every ordered pair (upper, lower), the
per-position **agreement** along the target's own greedy text (under sampling also the
**overlap** sum_x min(p_u, p_l)). `hf_polybasic.planning.measure.profile` makes one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..costs import interpolate_cost
from .acceptance import Acceptance

TARGET = "target"
MODEL, DRAFTER = "model", "drafter"
PROFILE_FORMAT = 1


def cost_order(kinds: Mapping[str, str], costs: Mapping[str, Mapping[int, float]]) -> tuple[str, ...]:
    """The target, then models by 1-token cost (most expensive first; ties keep their order), then
    Drafters (which can only be the bottom)."""

    def by_cost(label: str) -> float:
        return -interpolate_cost(costs[label], 1)

    models = [label for label, kind in kinds.items() if kind == MODEL and label != TARGET]
    drafters = [label for label, kind in kinds.items() if kind == DRAFTER]
    return (TARGET, *sorted(models, key=by_cost), *sorted(drafters, key=by_cost))


def pair_key(upper: str, lower: str) -> str:
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
                f"the profile has no agreement data for {pair_key(upper, lower)}; chains must list levels in the "
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
        """Cost table (relative to the target's forward of the same length) and pair table
        (`profile_markdown`)."""
        return profile_markdown(self)

    def __str__(self) -> str:
        return self.markdown()


def profile_markdown(profile: Profile) -> str:
    """Cost table (relative to the target's forward of the same length) and pair table."""
    sizes = sorted({k for points in profile.costs.values() for k in points})
    target_ms = 1000 * profile.cost(TARGET, 1)
    lines = [
        f"Costs: one forward feeding k tokens against a warm cache, relative to the target's "
        f"forward of the same k (target 1-token forward: {target_ms:.2f} ms); a Drafter: one propose call.",
        "",
        "| level | kind | ms (k=1) | prefill ms | " + " | ".join(f"k={k}" for k in sizes) + " |",
        "|---|---|---:|---:|" + "---:|" * len(sizes),
    ]
    for label in profile.order:
        cells = [f"{profile.cost(label, k) / profile.cost(TARGET, k):.3f}" for k in sizes]
        ms, prefill = 1000 * profile.cost(label, 1), 1000 * profile.prefill.get(label, 0.0)
        lines.append(f"| {label} | {profile.kinds[label]} | {ms:.2f} | {prefill:.1f} | " + " | ".join(cells) + " |")
    what = "mean overlap sum_x min(p_upper, p_lower)" if profile.sampling else "per-token greedy agreement"
    lines += [
        "",
        f"Acceptance along the target's greedy text ({what}); L(b) = predicted tokens per verification of a "
        "b-token block (accepted + 1).",
        "",
        "| upper <- lower | acceptance rate | L(2) | L(4) | L(8) |",
        "|---|---:|---:|---:|---:|",
    ]
    for upper, lower in profile.agreement:
        acceptance = profile.acceptance(upper, lower)
        lengths = " | ".join(f"{acceptance.length(b):.2f}" for b in (2, 4, 8))
        lines.append(f"| {pair_key(upper, lower)} | {profile.acceptance_rate(upper, lower):.3f} | {lengths} |")
    return "\n".join(lines)
