"""`CostEstimate`: T(k) of one model during one call, corrected online by the forwards it makes."""

from __future__ import annotations

import math

from .curve import CostCurve, nondecreasing

# forwards feeding more tokens than this (prefills, long catch-ups) do not update an estimate
ONLINE_MAX_TOKENS = 32
# weight of the newest forward in the running scale of an estimate
ONLINE_DECAY = 0.8


def affine_fit(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line a + b k through ``{k: seconds}``, with b >= 0 (a single
    point: a constant)."""
    ks, ys = list(points), list(points.values())
    if len(ks) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mean_k, mean_y = sum(ks) / len(ks), sum(ys) / len(ys)
    spread = sum((k - mean_k) ** 2 for k in ks)
    slope = max(sum((k - mean_k) * (y - mean_y) for k, y in zip(ks, ys)) / spread, 0.0) if spread else 0.0
    if slope == 0.0:
        return mean_y, 0.0
    return mean_y - slope * mean_k, slope


class CostEstimate:
    """T(k) of one model during one call: the curve, corrected by what its forwards cost now.

    Every forward of at most `ONLINE_MAX_TOKENS` tokens updates a running, decayed mean of
    log(observed / predicted): one for the curve as a whole (a busy machine scales every cost
    alike) and one at the measured point nearest to the forward's size (so a wrong shape is
    corrected where decoding works). Longer forwards (prefills, catch-ups) are left out.

    Attributes:
        observed: forwards that updated the estimate.
        last_seconds: seconds of the most recent forward, whatever its size.
    """

    def __init__(self, curve: CostCurve):
        self.curve = curve
        self._whole = [0.0, 0.0]  # decayed sum of log ratios, decayed weight
        self._at = {k: [0.0, 0.0] for k in curve.points}
        self.observed = 0
        self.last_seconds: float | None = None
        self._line: tuple[float, float] | None = None  # the fit `seconds` uses, until the next observation

    def _nearest_point(self, tokens: int) -> int:
        return min(self.curve.points, key=lambda k: abs(math.log(k) - math.log(tokens)))

    def observe(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """A forward computed ``tokens`` tokens (over ``rows`` rows of a batch) in ``seconds``. Only
        one-row forwards correct the curve, which prices one row: a batch's forward of n rows of k
        tokens differs from one row of n k (its attention spans n caches)."""
        self.last_seconds = seconds
        if rows != 1 or not 1 <= tokens <= ONLINE_MAX_TOKENS or seconds <= 0:
            return
        self._line = None
        ratio = math.log(seconds / self.curve.seconds(tokens))
        for running in (self._whole, self._at[self._nearest_point(tokens)]):
            running[0] = ONLINE_DECAY * running[0] + ratio
            running[1] = ONLINE_DECAY * running[1] + 1.0
        self.observed += 1

    def scale(self, point: int | None = None) -> float:
        """observed / measured at a measured ``point`` (that point's own evidence when it has some,
        else the whole curve's), or for the curve as a whole."""
        running = self._at.get(point) if point is not None else None
        if running is None or running[1] < 1.0:
            running = self._whole
        return math.exp(running[0] / running[1]) if running[1] else 1.0

    def priced_points(self) -> set[int]:
        """The measured points that forwards of this call priced themselves (each forward prices the
        point nearest its size)."""
        return {k for k, running in self._at.items() if running[1] >= 1.0}

    def points(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k, as this call sees them now."""
        return {k: v * self.scale(k) for k, v in self.curve.points.items()}

    def seconds(self, k: float) -> float:
        """T(k) as the schedule prices it: the least-squares line through the (nondecreasing) points,
        T(k) = a + b k with b >= 0. A shared machine's measurements of neighbouring points can differ
        by a third (T(2) above T(4)); the differences T(j + 2) - T(j + 1) that price one more token
        must come from the curve's trend, not from two noisy points."""
        if self._line is None:  # asked many times per drafted token: fitted once per observation
            self._line = affine_fit(self.snapshot())
        intercept, slope = self._line
        return max(intercept + slope * k, 1e-9)

    def snapshot(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k as the schedule uses them (made nondecreasing in k)."""
        points = dict(sorted(self.points().items()))
        return dict(zip(points, nondecreasing(list(points.values()))))
