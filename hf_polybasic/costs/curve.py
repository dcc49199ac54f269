"""`CostCurve`: T(k), the seconds of one forward scoring k new tokens, from measured points."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CURVE_FORMAT = 1
CALIBRATION_CONTEXT = 64


# a timing over this many times a longer forward's of the same model was slowed by something else on
# the machine (CI's installs made a target's T(4) 10x its T(8)). A kernel's own shape stays below it:
# an unpacked fp32 forward of the 1.5B over 3 tokens costs 1.45x one over 4 (MKL's row blocks, measured
# on AVX2 and AVX-512 alike, docs/speed.md), and decoding must see that to avoid it.
SLOWED = 2.0


def unslowed(values: Sequence[float]) -> list[float]:
    """``values`` (costs by increasing tokens) with every slowed timing replaced: a value over `SLOWED`
    times the least later one becomes that least later one.

    Noise on a timing is one-sided: preemption or another process on the core only ever makes a forward
    look slower, and a longer forward bounds a shorter one's true cost from above unless the kernel
    itself runs slower on fewer rows. A shorter forward measured more than twice a longer one's was
    slowed; within that, what was measured stands (kernels do cost more at some widths). (A
    least-squares fit spread one preempted timing over its neighbours: a profile's T(4) measured 10x
    too slow made T(8) 5x too slow, and every chain looked slower than plain decoding. The lower
    nondecreasing envelope that replaced it hid real widths that cost more than wider ones.)
    """
    cleaned, least = [], math.inf
    for value in reversed(values):
        value = float(value)
        cleaned.append(least if value > SLOWED * least else value)
        least = min(least, value)
    return cleaned[::-1]


def interpolate_cost(points: Mapping[int, float], k: float) -> float:
    """Seconds of a forward feeding ``k`` tokens from measured ``{tokens: seconds}`` points.

    Slowed timings are replaced first (`unslowed`); then linear in k between neighbouring points;
    beyond the last point k_n, along the line from the last point at or below k_n / 2 to k_n (the
    trend, not the step between two neighbours of a dense curve; flat where that falls); below the
    first, from the first two; one point is a constant.
    """
    if not points:
        raise ValueError("interpolate_cost needs at least one measured (tokens, seconds) point")
    ks = sorted(points)
    return interpolate_prepared(ks, unslowed([points[x] for x in ks]), k)


def interpolate_prepared(ks: Sequence[int], ys: Sequence[float], k: float) -> float:
    """`interpolate_cost` over points already prepared: ``ks`` increasing (at least one), ``ys`` their
    costs with slowed timings replaced (`unslowed`). For callers that price many k on one curve."""
    if len(ks) == 1:
        return float(ys[0])
    if k > ks[-1]:  # costs do not fall past the last point: a falling trend there is noise
        lower = bisect_right(ks, ks[-1] / 2) - 1  # the last point at or below half the last width
        lower = lower if lower >= 0 else len(ks) - 2
        k0, k1, y0, y1 = ks[lower], ks[-1], min(ys[lower], ys[-1]), ys[-1]
    else:
        upper = min(max(bisect_left(ks, k), 1), len(ks) - 1)
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
