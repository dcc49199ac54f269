"""Whether signals beyond a draft's confidence foretell its acceptance (``python -m benchmarks
acceptance-features``): the signals each revealed draft gets, and held-out log-losses that find a signal the
acceptance depends on and no gain where it does not."""

from __future__ import annotations

import json
import math
import random

import pytest

import benchmarks.cli
from benchmarks.acceptance_features import RECENT, compare_signals as compare_turns, held_out_loss, revealed_drafts
from benchmarks.stopping_replay import Stream, save_streams


def _streams(accept, count: int = 6, tokens: int = 120, depth: int = 8, seed: int = 0) -> list[Stream]:
    """Streams whose draft j at position p, of confidence c, is accepted with probability ``accept(c, p)``
    (after every draft before it was); confidences uniform."""
    rng = random.Random(seed)
    streams = []
    for _ in range(count):
        confidences = [[rng.random() for _ in range(depth)] for _ in range(tokens)]
        matches = [next((j for j, c in enumerate(row) if rng.random() >= accept(c, p)), depth)
                   for p, row in enumerate(confidences)]
        streams.append(Stream(matches, confidences))
    return streams


def compare_signals(streams: list[Stream]) -> dict[str, float]:
    return compare_turns([revealed_drafts(stream) for stream in streams])


def test_each_revealed_draft_gets_its_signals_known_when_it_is_made():
    stream = Stream([2, 0, 3] + [1] * RECENT, [[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4]]
                    + [[0.5] * 4] * RECENT)
    rows, accepted = revealed_drafts(stream)
    # position 0: drafts 0, 1 accepted, 2 rejected; position 1: draft 0 rejected; position 2: 0 - 2 accepted, 3 not
    assert accepted[:8] == [True, True, False, False, True, True, True, False]
    assert [row["confidence"] for row in rows[:4]] == [0.9, 0.8, 0.7, 0.5]
    assert [row["previous"] for row in rows[:4]] == [1.0, 0.9, 0.8, 1.0]
    assert [row["depth"] for row in rows[:4]] == [0.0, 1.0, 2.0, 0.0]
    # recent: the first drafts' agreement at the positions before (none: 0.5; then 1 of 1; then 1 of 2)
    assert [row["recent"] for row in (rows[0], rows[3], rows[4])] == [0.5, 1.0, 0.5]
    # a full depth accepted reveals no rejection, and the window holds only the RECENT positions before
    last = RECENT + 2
    assert revealed_drafts(Stream([4], [[0.5] * 4]))[1] == [True] * 4
    assert rows[-1]["recent"] == sum(m > 0 for m in stream.matches[last - RECENT:last]) / RECENT


def test_where_acceptance_follows_the_confidence_alone_no_other_signal_helps():
    losses = compare_signals(_streams(lambda confidence, position: confidence))
    assert losses["confidence"] < 0.85 * losses["none"]  # the signal the schedule reads does the work
    for name in ("confidence + previous", "confidence + depth", "confidence + recent"):
        assert losses[name] > 0.99 * losses["confidence"], name


def test_each_turn_is_scored_by_a_fit_to_the_others_alone():
    """Two turns accepting 3 of 4 and 1 of 4 drafts: the overall rate fitted to the other turn is 1/4 for the
    first and 3/4 for the second, so each draft costs (3 log 4 + log 4/3) / 4 on average (log 2 had a turn's
    own drafts been fitted too)."""
    row = {"confidence": 0.5, "previous": 1.0, "depth": 0.0, "recent": 0.5}
    turns = [([row] * 4, [True, True, True, False]), ([row] * 4, [True, False, False, False])]
    assert held_out_loss(turns, ()) == pytest.approx((3 * math.log(4) + math.log(4 / 3)) / 4, rel=1e-3)


def test_a_signal_the_acceptance_depends_on_lowers_the_held_out_loss():
    """Negative control of the test above: acceptance that follows stretches of text (good and bad runs of 30
    positions) regardless of the confidence is found by ``recent``, not by the confidence."""
    losses = compare_signals(_streams(lambda confidence, position: 0.95 if (position // 30) % 2 else 0.3))
    assert losses["confidence"] > 0.99 * losses["none"]
    assert losses["confidence + recent"] < 0.92 * losses["confidence"]


def test_the_command_writes_its_table_and_summary(tmp_path, capsys):
    report = tmp_path / "replay"
    report.mkdir()
    save_streams(report / "streams.jsonl", {f"{index}/0": stream for index, stream in
                                            enumerate(_streams(lambda confidence, position: confidence, count=3))})
    out = tmp_path / "out"
    assert benchmarks.cli.main(["acceptance-features", str(report), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["turns"] == 3 and set(summary["log_loss"]) == {
        "none", "confidence", "confidence + previous", "confidence + depth", "confidence + recent",
        "confidence + previous + depth + recent"}
    table = (out / "results.md").read_text()
    assert "| confidence | " in table and "| none | " in table and "revealed drafts" in capsys.readouterr().out
    assert f"| confidence | {summary['log_loss']['confidence']:.4f} | +0.0% |" in table  # the rows against it


def test_a_directory_without_streams_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="streams.jsonl"):
        benchmarks.cli.main(["acceptance-features", str(tmp_path)])
