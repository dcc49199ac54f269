"""The cost-noise replay (``python -m benchmarks curve-noise``): calls of noisy forwards refresh a stored curve
as decoding does, and the default schedule is replayed seeing what they leave."""

from __future__ import annotations

import json
import random

import benchmarks.cli
from benchmarks.curve_noise import OWN_FORWARDS_ONLY, compare_noise, drifted, log_error
from benchmarks.stopping_replay import Costs, Stream, save_streams
from hf_polybasic.costs import CostCurve
from hf_polybasic.costs import estimate as estimate_module


def _streams(count: int = 3, tokens: int = 40, depth: int = 8) -> list[Stream]:
    """Streams whose drafts match the target's for a run that the confidences roughly foretell."""
    rng = random.Random(1)
    streams = []
    for _ in range(count):
        confidences = [[round(rng.random(), 3) for _ in range(depth)] for _ in range(tokens)]
        matches = [next((i for i, c in enumerate(row) if rng.random() > c), depth) for row in confidences]
        streams.append(Stream(matches, confidences))
    return streams


FLAT = Costs(CostCurve({k: 0.25 + 0.0066 * (k - 1) for k in range(1, 18)}), 0.04)


def test_forwards_timed_exactly_leave_the_curve_and_the_schedule_as_measured():
    rows = compare_noise(_streams(), FLAT, [0.0], calls=5, seeds=1)
    exact = rows[0]["stored"][0]
    for row in rows[1:]:
        assert row["stored"] == [exact] and row["call"] == [exact] and row["error"] == [0.0]


def test_a_width_by_its_own_forwards_drifts_further_than_one_shrunk_and_the_prior_is_put_back():
    prior = estimate_module.POINT_PRIOR
    widths = [2, 2, 3, 3, 4, 5, 8, 17]
    own, _ = drifted(FLAT, widths, 0.2, 60, OWN_FORWARDS_ONLY, random.Random(0))
    shrunk, _ = drifted(FLAT, widths, 0.2, 60, prior, random.Random(0))
    assert estimate_module.POINT_PRIOR == prior
    assert log_error(own, FLAT.verify) > 1.5 * log_error(shrunk, FLAT.verify)


def test_the_command_reads_stopping_replay_reports_and_writes_its_own(tmp_path):
    report = tmp_path / "replay"
    report.mkdir()
    save_streams(report / "streams.jsonl", {f"{i}/0": stream for i, stream in enumerate(_streams())})
    (report / "summary.json").write_text(json.dumps(
        {"costs": {"verify": {str(k): v for k, v in FLAT.verify.points.items()}, "step": FLAT.step}}))
    out = tmp_path / "noise"
    assert benchmarks.cli.main(["curve-noise", str(report), "--sigmas", "0.2", "--calls", "3", "--seeds", "2",
                                "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["point_prior"] == estimate_module.POINT_PRIOR and summary["sigmas"] == [0.2]
    assert [row["rule"] for row in summary["results"][str(report)]][1:] == [
        "each width by its own forwards", f"shrunk by {estimate_module.POINT_PRIOR:g} forwards' worth"]
    assert "| replay |" in (out / "results.md").read_text()
