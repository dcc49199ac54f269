"""`CostCurve`: T(k), the seconds of one forward scoring k new tokens, from measured points."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CURVE_FORMAT = 1
CALIBRATION_CONTEXT = 64


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The lower nondecreasing envelope of ``values``: each becomes the least of it and every later one.

    Forward costs grow with the tokens fed, and noise on a timing is one-sided: preemption or another
    process on the core only ever makes a forward look slower. So where a longer forward measured
    cheaper than a shorter one, the shorter one was slowed, and the longer one bounds it. (A
    least-squares fit spread one preempted timing over its neighbours instead: a profile's T(4)
    measured 10x too slow made T(8) 5x too slow, and every chain looked slower than plain decoding.)
    """
    envelope, least = [], math.inf
    for value in reversed(values):
        least = min(least, float(value))
        envelope.append(least)
    return envelope[::-1]


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


@dataclass
class CostCurve:
    """T(k): seconds of one forward of a model scoring k new tokens against a warm cache.

    Attributes:
        points: measured ``{k: seconds}``; in between and beyond, `interpolate_cost`.
        context: tokens in the cache when the points were measured.
        description: the model and machine the curve belongs to (for people reading it).
        observations: forwards of decoding that refreshed the points since they were measured.
    """

    points: dict[int, float]
    context: int = CALIBRATION_CONTEXT
    description: dict = field(default_factory=dict)
    observations: int = 0

    def seconds(self, k: float) -> float:
        return interpolate_cost(self.points, k)

    def ratio(self, k: float) -> float:
        """T(k) / T(1): what scoring k tokens costs in steps."""
        return self.seconds(k) / max(self.seconds(1), 1e-12)

    def to_dict(self) -> dict:
        return {
            "format": CURVE_FORMAT,
            "points": {str(k): v for k, v in sorted(self.points.items())},
            "context": self.context,
            "description": self.description,
            "observations": self.observations,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> CostCurve:
        """Inverse of `to_dict`; a `ValueError` for anything else (other formats, wrong shapes or
        types, impossible values), so a foreign or torn file is told apart from a curve."""
        try:
            if data.get("format") != CURVE_FORMAT:
                raise ValueError(f"not a cost curve of format {CURVE_FORMAT}")
            points = {int(k): float(v) for k, v in data["points"].items()}
            context = int(data.get("context", CALIBRATION_CONTEXT))
            description = dict(data.get("description", {}))
            observations = int(data.get("observations", 0))
        except (AttributeError, KeyError, TypeError) as error:
            raise ValueError(f"not a cost curve: {error!r}") from error
        if not points or any(k < 1 or not v > 0 for k, v in points.items()):
            raise ValueError(f"a cost curve needs seconds > 0 for k >= 1 tokens, got {points}")
        return cls(points, context, description, observations)
