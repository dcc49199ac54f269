"""``curve-noise``: what noise in the measured costs costs the default schedule, replayed without the models.

A ``stopping-replay`` report (`benchmarks.stopping_replay`) holds the drafter's streams along the target's
greedy answers and the costs measured with them (``summary.json``). Taking those costs as the truth, this
replays ``calls`` calls of decoding whose forwards are timed off by a lognormal factor (``sigma`` on the
log scale: a shared machine), thirty a call at the widths the default schedule verifies along the streams:
each call's `CostEstimate` corrects the curve from its forwards and the call's refresh moves the stored
curve (`CostCurves.refresh`), as decoding does. Then the default schedule is replayed along the streams
seeing the stored curve, and seeing the last call's estimate, its rounds priced by the true costs, against
transformers' rule priced the same (`stopping_replay.compare`'s x transformers). Each width's correction is
taken as the package takes it (shrunk towards the whole curve's by `POINT_PRIOR` forwards' worth) and by
its own forwards alone (a prior of ~0: the rule before `POINT_PRIOR`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hf_polybasic.costs import CostCurve, CostEstimate
from hf_polybasic.costs import estimate as estimate_module
from hf_polybasic.costs.store import CostCurves

from .stopping_replay import (TRANSFORMERS_RULE, Costs, Schedule, Stream, Threshold, load_streams, replay,
                             second_pass)

FORWARDS_PER_CALL = 30
# a width's correction "by its own forwards alone": POINT_PRIOR -> 0 (exactly 0 divides by nothing at a
# width no forward priced)
OWN_FORWARDS_ONLY = 1e-9


class _Recording(Schedule):
    """The default schedule (`stopping_replay.Schedule`), recording the width of every verification it makes."""

    def __init__(self, costs: Costs, seen: CostEstimate):
        super().__init__(costs, seen=seen)
        self.widths = []

    def observe(self, drafted: int, accepted: int, costs: Costs) -> None:
        self.widths.append(drafted + 1)
        super().observe(drafted, accepted, costs)


def schedule_rate(streams: Sequence[Stream], costs: Costs, seen: CostEstimate) -> tuple[float, list[int]]:
    """Tokens per second of the default schedule seeing ``seen``, its second pass along ``streams`` (its
    calibration carried from the first, as `stopping_replay.compare` counts it), and the widths it verified."""
    rule = _Recording(costs, seen)
    return second_pass(streams, rule, costs).rate, rule.widths


@contextmanager
def _point_prior(prior: float) -> Iterator[None]:
    """`CostEstimate` with each width's correction shrunk by ``prior`` forwards' worth inside the block."""
    saved = estimate_module.POINT_PRIOR
    estimate_module.POINT_PRIOR = prior
    try:
        yield
    finally:
        estimate_module.POINT_PRIOR = saved


def drifted(costs: Costs, widths: Sequence[int], sigma: float, calls: int, prior: float,
            rng: random.Random) -> tuple[CostCurve, CostEstimate]:
    """The stored curve after ``calls`` calls of `FORWARDS_PER_CALL` forwards at ``widths`` (drawn
    uniformly from the list), each timed at the true cost times exp(N(0, ``sigma``)), with each width's
    correction shrunk by ``prior`` forwards' worth; and the last call's estimate."""
    with _point_prior(prior):
        store = CostCurves(None, measure=lambda *args, **kwargs: CostCurve(dict(costs.verify.points)),
                           key=lambda model: "replayed")
        curve = store.curve_for(None)
        for _ in range(calls):
            estimate = CostEstimate(curve)
            for _ in range(FORWARDS_PER_CALL):
                width = rng.choice(widths)
                estimate.observe(width, costs.verify.seconds(width) * math.exp(rng.gauss(0.0, sigma)))
            store.refresh(None, estimate)
        return curve, estimate


def _frozen(estimate: CostEstimate, prior: float) -> CostEstimate:
    """``estimate`` as it prices with ``prior`` whatever `POINT_PRIOR` says later: its points fixed now."""
    with _point_prior(prior):
        return CostEstimate(CostCurve(estimate.points()))


def log_error(curve: CostCurve, truth: CostCurve) -> float:
    """The spread (standard deviation) of log(stored / true) over the curve's widths."""
    return statistics.pstdev(math.log(curve.points[k] / truth.points[k]) for k in truth.points)


def compare_noise(streams: Sequence[Stream], costs: Costs, sigmas: Sequence[float], calls: int,
                  seeds: int) -> list[dict]:
    """For each ``sigma`` and each way of taking a width's correction, over ``seeds`` seeded runs: the
    schedule's speed over transformers' rule seeing the stored curve and a call's estimate (median and
    least), and the stored curve's `log_error` (median)."""
    reference = replay(streams, Threshold(*TRANSFORMERS_RULE), costs).rate
    exact, widths = schedule_rate(streams, costs, CostEstimate(costs.verify))
    rows = [{"sigma": 0.0, "rule": "the costs as measured", "stored": [exact / reference],
             "call": [exact / reference], "error": [0.0]}]
    for sigma in sigmas:
        for name, prior in (("each width by its own forwards", OWN_FORWARDS_ONLY),
                            (f"shrunk by {estimate_module.POINT_PRIOR:g} forwards' worth", estimate_module.POINT_PRIOR)):
            row = {"sigma": sigma, "rule": name, "stored": [], "call": [], "error": []}
            for seed in range(seeds):
                curve, last = drifted(costs, widths, sigma, calls, prior, random.Random(seed))
                row["stored"].append(schedule_rate(streams, costs, CostEstimate(curve))[0] / reference)
                row["call"].append(schedule_rate(streams, costs, _frozen(last, prior))[0] / reference)
                row["error"].append(log_error(curve, costs.verify))
            rows.append(row)
    return rows


def run_curve_noise(replays: Sequence[str], sigmas: Sequence[float], calls: int, seeds: int,
                    out: str | None = None) -> str:
    """`compare_noise` for each ``stopping-replay`` report directory in ``replays`` (its ``streams.jsonl``
    and the costs in its ``summary.json``); the table as markdown, and with ``out`` ``summary.json`` and
    ``results.md`` there."""
    lines = ["| replay | forwards timed off by (sigma) | a width's correction | x transformers seeing the stored "
             "curve: median (least) | seeing a call's estimate: median (least) | stored curve off by (median) |",
             "|---|---|---|---|---|---|"]
    results = {}
    for directory in replays:
        summary = json.loads((Path(directory) / "summary.json").read_text())
        costs = Costs(CostCurve({int(k): v for k, v in summary["costs"]["verify"].items()}), summary["costs"]["step"])
        streams = list(load_streams(Path(directory) / "streams.jsonl").values())
        rows = compare_noise(streams, costs, sigmas, calls, seeds)
        results[directory] = rows
        for row in rows:
            lines.append(f"| {Path(directory).name} | {row['sigma']:g} | {row['rule']} | "
                         f"{statistics.median(row['stored']):.3f}x ({min(row['stored']):.3f}x) | "
                         f"{statistics.median(row['call']):.3f}x ({min(row['call']):.3f}x) | "
                         f"{statistics.median(row['error']):.1%} |")
    text = (f"{calls} calls of {FORWARDS_PER_CALL} forwards, {seeds} seeds; rounds priced by each replay's "
            "measured costs.\n\n" + "\n".join(lines) + "\n")
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "summary.json").write_text(json.dumps(
            {"replays": list(replays), "sigmas": list(sigmas), "calls": calls, "seeds": seeds,
             "point_prior": estimate_module.POINT_PRIOR, "results": results}, indent=1) + "\n")
        (directory / "results.md").write_text(text)
    return text
