"""`CostEstimate`: T(k) of one model during one call, corrected online by the forwards it makes."""

from __future__ import annotations

import math

from .curve import CostCurve, interpolate_prepared, unslowed

# forwards feeding more tokens than this (prefills, long catch-ups) do not update an estimate
ONLINE_MAX_TOKENS = 32
# weight of the newest forward in the running scale of an estimate
ONLINE_DECAY = 0.8
# forwards' worth of the whole curve's correction in each point's own (`CostEstimate.scale`): a point one
# forward priced takes a fifth of that forward's departure from the whole curve's correction, one that
# forwards priced round after round (a decayed weight of 5 at most) five ninths, and the call's refresh
# of the stored curve carries it on to the next call (`hf_polybasic.costs.store.CostCurves.refresh`)
POINT_PRIOR = 4.0


class CostEstimate:
    """T(k) of one model during one call: the curve, corrected by what its forwards cost now.

    Every forward of at most `ONLINE_MAX_TOKENS` tokens updates a running, decayed mean of
    log(observed / predicted): one for the curve as a whole (a busy machine scales every cost
    alike) and one at the measured point nearest to the forward's size (so a wrong shape is
    corrected where decoding works, once forwards there agree: a point's own mean is shrunk towards the
    whole curve's by `POINT_PRIOR` forwards' worth, since one forward's timing on a shared machine can be
    off by a tenth or more, while on a flat curve a token more costs a fortieth of a step, and a point
    one slowed forward priced alone made the schedule stop before it). Longer forwards (prefills,
    catch-ups) are left out.

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
        # the points `seconds` prices on (tokens, costs), made from `snapshot` once per observation
        self._prepared: tuple[list[int], list[float]] | None = None

    def _nearest_point(self, tokens: int) -> int:
        return min(self.curve.points, key=lambda k: abs(math.log(k) - math.log(tokens)))

    def observe(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """A forward computed ``tokens`` tokens (over ``rows`` rows of a batch) in ``seconds``. Only
        one-row forwards correct the curve, which prices one row: a batch's forward of n rows of k
        tokens differs from one row of n k (its attention spans n caches)."""
        self.last_seconds = seconds
        if rows != 1 or not 1 <= tokens <= ONLINE_MAX_TOKENS or seconds <= 0:
            return
        self._prepared = None
        ratio = math.log(seconds / self.curve.seconds(tokens))
        for running in (self._whole, self._at[self._nearest_point(tokens)]):
            running[0] = ONLINE_DECAY * running[0] + ratio
            running[1] = ONLINE_DECAY * running[1] + 1.0
        self.observed += 1

    def scale(self, point: int) -> float:
        """observed / measured at the measured ``point``: its own mean log ratio, shrunk towards the whole
        curve's by `POINT_PRIOR` forwards' worth (the whole curve's alone before a forward priced it)."""
        whole = self._whole[0] / self._whole[1] if self._whole[1] else 0.0
        own, weight = self._at[point]
        return math.exp((own + POINT_PRIOR * whole) / (weight + POINT_PRIOR))

    def priced_points(self) -> set[int]:
        """The measured points that forwards of this call priced themselves (each forward prices the
        point nearest its size)."""
        return {k for k, running in self._at.items() if running[1] >= 1.0}

    def points(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k, as this call sees them now."""
        return {k: v * self.scale(k) for k, v in self.curve.points.items()}

    def seconds(self, k: float) -> float:
        """T(k) as the schedule prices it: linear between the points as this call sees them, slowed
        timings replaced (`hf_polybasic.costs.curve.interpolate_cost`). Not a line through them: a curve
        with a step (unpacked fp32 on many CPUs: T(2) = 2 T(1), T(3) = 2.9 T(1), T(4) = 2 T(1)) priced
        on its least-squares line made plain decoding look 1.5x dearer than it is and a second token
        nearly free (in simulation the default then ran at 0.7x plain decoding where drafts were often
        rejected), and a width that costs more than a wider one must be seen to be avoided."""
        if self._prepared is None:  # asked many times per drafted token: made once per observation
            points = self.snapshot()
            self._prepared = (list(points), list(points.values()))
        return max(interpolate_prepared(*self._prepared, k), 1e-9)

    def snapshot(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k as the schedule uses them (slowed timings replaced)."""
        points = dict(sorted(self.points().items()))
        return dict(zip(points, unslowed(list(points.values()))))
