"""The stopping-rule replay (``python -m benchmarks stopping-replay``): its streams are the drafter's own greedy
drafts along the target's path, and its rounds add up as the module says."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import benchmarks.cli
from benchmarks.stopping_replay import (RANKS_KEPT, Costs, Oracle, Rule, Schedule, Siblings, Stream, Threshold, compare,
                                       drafter_stream, line_through, load_streams, miss_ranks, rank_of, replay,
                                       save_streams)
from hf_polybasic.costs import CostCurve
from hf_polybasic.testing import make_target, noisy_copy, prompt


@torch.no_grad()
def _drafts_from_scratch(drafter, prefix: torch.LongTensor, depth: int) -> tuple[list[int], list[float]]:
    """The drafter's greedy drafts after ``prefix`` ``[1, L]`` and its largest probability at each, without a cache."""
    ids, tokens, confidences = prefix, [], []
    for _ in range(depth):
        probs = drafter(ids).logits[0, -1].float().softmax(-1)
        confidence, token = probs.max(-1)
        tokens.append(int(token))
        confidences.append(float(confidence))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return tokens, confidences


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_streams_hold_the_drafters_greedy_drafts_along_the_targets_path(noise):
    target = make_target(seed=1)
    drafter = target if noise == 0.0 else noisy_copy(target, noise, seed=2)
    ids, depth = prompt(6, seed=3), 5
    stream, output = drafter_stream(target, drafter, ids, 12, depth)
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)[0, 6:]
    assert output.tolist() == expected.tolist() and stream.tokens == 12
    for position in range(stream.tokens):
        tokens, confidences = _drafts_from_scratch(drafter, torch.cat([ids[0], output[:position]])[None], depth)
        ahead = output[position : position + depth].tolist()
        matched = next((i for i, (a, b) in enumerate(zip(tokens, ahead)) if a != b), min(depth, len(ahead)))
        assert stream.matches[position] == matched
        assert stream.confidences[position] == pytest.approx(confidences, abs=2e-4)
        logits = drafter(torch.cat([ids[0], output[:position]])[None]).logits[0, -1].float()
        rank = 1 + int((logits > logits[output[position]]).sum())
        assert stream.ranks[position] == (rank if rank <= RANKS_KEPT else 0)
    if noise == 0.0:  # the target drafting for itself matches everything ahead
        assert stream.matches == [min(depth, 12 - p) for p in range(12)] and stream.ranks == [1] * 12
    else:  # a negative control: a noisy drafter does not
        assert stream.matches != [min(depth, 12 - p) for p in range(12)] and stream.ranks != [1] * 12


FLAT = Costs(CostCurve({1: 1.0, 2: 1.0, 16: 1.0, 32: 1.0}), 0.25)


def test_a_threshold_rule_replays_round_by_round():
    # position 0: drafts stop after the 0.3 token (kept), 2 drafted, 1 accepted: 2 tokens for 1.5 s
    # position 2: all 3 drafts confident, cap 3, 3 accepted of matches 5: 4 tokens for 1.75 s
    # position 6: one token left, budget 0: plain, 1 token for 1 s
    stream = Stream(matches=[1, 0, 5, 4, 3, 2, 0],
                    confidences=[[0.9, 0.3, 0.9], [0.1] * 3, [0.8, 0.9, 0.95], [0.9] * 3, [0.9] * 3, [0.9] * 3,
                                 [0.9] * 3])
    result = replay([stream], Threshold(0.4, 3), FLAT)
    assert (result.tokens, result.rounds) == (7, 3)
    assert result.seconds == pytest.approx(1.5 + 1.75 + 1.0)
    # a negative control: a lower threshold drafts the whole first window (3 drafted, 1 accepted)
    assert replay([stream], Threshold(0.2, 3), FLAT).seconds == pytest.approx(1.75 + 1.75 + 1.0)
    # a token exactly at the threshold does not stop the drafts (transformers stops below it)
    assert Threshold(0.3, 3)(stream, 0, 6) == 3 and Threshold(0.31, 3)(stream, 0, 6) == 2


SLOPED = Costs(CostCurve({1: 1.0, 2: 1.1, 64: 7.3}), 0.25)  # T(k) = 0.9 + 0.1 k


def test_leaves_emit_a_token_more_where_the_first_rejected_draft_held_the_targets_token_among_them():
    # Threshold(0, 2) drafts 2 a round. Position 0: draft 1 accepted, draft 2 rejected where the target's
    # token is the drafter's second choice (rank 2): with leaves the round emits 3 (the leaf, then the
    # target's token after it) and verifies 2 drafts, their leaves and the leaf again; position 3: both
    # drafts accepted, nothing for a leaf to do
    stream = Stream(matches=[1, 0, 0, 2, 1, 0], confidences=[[0.9, 0.9]] * 6, ranks=[1, 2, 1, 1, 3, 2])
    plain = replay([stream], Threshold(0.0, 2), SLOPED)
    assert (plain.tokens, plain.rounds) == (6, 3)  # without leaves: 2 + 1 + 3 tokens
    second = replay([stream], Threshold(0.0, 2), SLOPED, Siblings(1))
    assert (second.tokens, second.rounds) == (6, 2)
    assert second.seconds == pytest.approx((0.5 + 0.9 + 0.1 * (2 + 2 + 1 + 1)) + (0.5 + 0.9 + 0.1 * (2 + 2 + 1)))
    # a negative control: the target's token third among the drafter's choices needs two leaves a draft
    third = Stream(stream.matches, stream.confidences, ranks=[1, 3, 1, 1, 3, 2])
    assert replay([third], Threshold(0.0, 2), SLOPED, Siblings(1)).rounds == 3
    two = replay([third], Threshold(0.0, 2), SLOPED, Siblings(2))
    assert two.rounds == 2 and two.seconds == pytest.approx(2 * 0.5 + 2 * 0.9 + 0.1 * ((2 + 4 + 1 + 1) + (2 + 4 + 1)))
    # a leaf at the last draft only: the rejection at position 0's second draft is there; at a first draft it is not
    assert replay([stream], Threshold(0.0, 2), SLOPED, Siblings(1, last_only=True)).rounds == 2
    early = Stream([0, 0, 0, 2, 1, 0], stream.confidences, ranks=[2, 1, 1, 1, 3, 2])
    assert replay([early], Threshold(0.0, 2), SLOPED, Siblings(1, last_only=True)).rounds == 4
    assert replay([early], Threshold(0.0, 2), SLOPED, Siblings(1)).rounds == 3
    # a round that drafted nothing (the last position) verifies no leaf; one that stopped drafting where
    # the drafter's next draft would have missed has no leaf there (position 0 here: 2 drafted and accepted)
    late = replay([Stream([2, 0, 0, 0], [[0.9] * 2] * 4, ranks=[1, 1, 2, 1])], Threshold(0.0, 2), SLOPED,
                  Siblings(1, last_only=True))
    assert (late.rounds, late.seconds) == (2, pytest.approx((0.5 + 0.9 + 0.1 * (2 + 1 + 1)) + (0.9 + 0.1)))
    with pytest.raises(ValueError, match="needs streams with ranks"):
        replay([Stream([0], [[0.9]])], Threshold(0.0, 2), SLOPED, Siblings(1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, RANKS_KEPT)), min_size=1, max_size=30),
       st.integers(1, 2), st.booleans())
def test_leaves_emit_each_stream_exactly_and_where_none_can_hit_only_add_their_verification(rows, per_draft, last_only):
    matches = [min(m, len(rows) - 1 - p) for p, (m, _) in enumerate(rows)]
    stream = Stream(matches, [[0.9] * 6] * len(rows), ranks=[rank for _, rank in rows])
    siblings = Siblings(per_draft, last_only)
    assert replay([stream], Threshold(0.5, 4), SLOPED, siblings).tokens == stream.tokens
    missed = Stream(matches, stream.confidences, ranks=[0 if 2 <= rank <= 1 + per_draft else rank for _, rank in rows])
    without, result = replay([missed], Threshold(0.5, 4), SLOPED), replay([missed], Threshold(0.5, 4), SLOPED, siblings)
    assert (result.tokens, result.rounds, result.drafted) == (without.tokens, without.rounds, without.drafted)
    assert result.seconds >= without.seconds


def test_a_rank_counts_the_choices_above_a_token_ties_alike_and_stops_at_the_kept_ones():
    logits = torch.tensor([0.1, 0.5, 0.3, 0.2, 0.9, 0.5, -1.0])
    assert [rank_of(logits, token) for token in range(7)] == [0, 2, 4, 0, 1, 2, 0]
    assert RANKS_KEPT == 4


def test_streams_keep_their_ranks_on_disk_and_older_files_have_none(tmp_path):
    named = {"1/0": Stream([1, 0], [[0.5], [0.25]], ranks=[1, 0]), "1/1": Stream([0], [[0.5]]),
             "2/0": Stream([], [], ranks=[])}
    save_streams(tmp_path / "streams.jsonl", named)
    assert load_streams(tmp_path / "streams.jsonl") == named


def test_ours_drafts_the_longest_rounds_where_drafts_are_free_and_none_where_they_cannot_pay():
    sure = Stream(matches=[min(24, 40 - 1 - p) for p in range(40)], confidences=[[0.999] * 24] * 40)
    free = replay([sure], Schedule(FLAT), FLAT)
    assert free.drafted / free.rounds > 8 and free.rounds <= 5  # up to 16 a round (MAX_DRAFT_TOKENS)
    # every verified token costs a whole forward, and a draft a quarter of one: no proposal can pay
    steep = Costs(CostCurve({1: 1.0, 2: 2.0, 32: 32.0}), 0.25)
    assert replay([sure], Schedule(steep), steep).drafted <= 2  # the back-off's probes at most
    # where a verified draft costs half a target step, an unsure drafter's rounds decline to draft once
    # calibrated, each decline paying for the drafter forward that saw the first distribution
    sloped = Costs(CostCurve({1: 1.0, 2: 1.5, 32: 16.5}), 0.1)
    unsure = Stream(matches=[0] * 60, confidences=[[0.05] * 24] * 60)
    rule = Schedule(sloped)
    replay([unsure], rule, sloped)
    again = replay([unsure], rule, sloped)
    assert again.drafted <= 6
    assert 60.0 + 0.1 < again.seconds - again.drafted * 0.6 <= 60.0 + 0.1 * 60


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6)),
                min_size=1, max_size=30))
def test_every_rule_emits_each_stream_exactly_and_the_oracle_never_wastes_a_draft(rows):
    """Whatever the rule, the rounds emit the stream's tokens (each round 1 + its accepted drafts, never
    past the end); the oracle's drafts are all accepted, and on flat costs its seconds bound the others'
    rounds from below (each of its rounds emits the most a round can from there, at the least cost)."""
    matches = [min(m, len(rows) - 1 - p) for p, (m, _) in enumerate(rows)]
    stream = Stream(matches, [c for _, c in rows])
    for rule in (Threshold(0.5, 4), Threshold(0.0, 6), Oracle(), Schedule(FLAT)):
        result = replay([stream], rule, FLAT)
        assert result.tokens == stream.tokens and 1 <= result.rounds <= stream.tokens
    oracle = replay([stream], Oracle(), FLAT)
    assert oracle.seconds == pytest.approx(oracle.rounds * 1.0 + (stream.tokens - oracle.rounds) * 0.25)


def test_a_round_that_ran_the_drafter_and_drafted_nothing_pays_one_step_and_the_oracle_stays_in_the_stream():
    class DeclinesOnce(Rule):
        def __call__(self, stream, position, budget):
            if position == 0:
                self.extra_forwards = 1  # replay resets it after the round
            return 0

    stream = Stream(matches=[3, 2, 1], confidences=[[0.9] * 3] * 3)
    assert replay([stream], DeclinesOnce(), FLAT).seconds == pytest.approx(3 * 1.0 + 0.25)
    # the last position matches the one token left: a round there has nothing to draft
    oracle = replay([stream], Oracle(), FLAT)
    assert (oracle.rounds, oracle.drafted, oracle.seconds) == (1, 2, pytest.approx(1.0 + 2 * 0.25))


def test_compare_puts_transformers_at_one_and_the_oracle_on_top():
    stream = Stream(matches=[3, 2, 1, 0] * 6, confidences=[[0.9, 0.8, 0.7, 0.2, 0.1]] * 24)
    stream.matches[-4:] = [3, 2, 1, 0]
    table = compare([stream], FLAT)
    ours = Schedule(FLAT)
    replay([stream], ours, FLAT)  # ours is scored on its second pass, its calibration carried
    assert table["ours (CostAwareSchedule)"]["x_plain"] == pytest.approx(replay([stream], ours, FLAT).rate)
    assert table["transformers (0.4, up to 20)"]["x_transformers"] == pytest.approx(1.0)
    best = max(row["x_plain"] for row in table.values())
    assert table["oracle (hindsight)"]["x_plain"] == pytest.approx(best)
    assert sum(name.startswith("best threshold in hindsight (") for name in table) == 1


def test_the_command_runs_on_tiny_models(capsys, tmp_path):
    assert benchmarks.cli.main(["stopping-replay", "--models", "tiny", "--questions-per-group", "1",
                                "--max-new-tokens", "6", "--depth", "3",
                                "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| ours (CostAwareSchedule) |" in text and "flags" in text
    assert "| ours, its second choice at every draft |" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    missed = miss_ranks(load_streams(tmp_path / "streams.jsonl").values())
    assert summary["miss_ranks"] == {str(rank): count for rank, count in missed.items()}
    assert f"Where the drafter's first choice missed ({sum(missed.values())} positions)" in text
    assert {path.name for path in tmp_path.iterdir()} == {"streams.jsonl", "summary.json", "results.md"}
    saved = (tmp_path / "streams.jsonl").read_text()
    assert benchmarks.cli.main(["stopping-replay", "--models", "tiny", "--streams", str(tmp_path / "streams.jsonl"),
                                "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "streams.jsonl").read_text() == saved
    # the costs are measured up to a verification of the saved streams' depth (not --depth's default) and,
    # every 4th width, up to the widest round with leaves (16 drafts, 2 leaves each, the leaf fed again)
    verify = json.loads((tmp_path / "again" / "summary.json").read_text())["costs"]["verify"]
    assert sorted(int(k) for k in verify) == [1, 2, 3, 4, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 50]
    # a streams file without ranks (before they were kept): the same rules, none with leaves
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "ranks"}) + "\n"
                           for line in saved.splitlines()))
    capsys.readouterr()
    assert benchmarks.cli.main(["stopping-replay", "--models", "tiny", "--streams", str(old),
                                "--out", str(tmp_path / "older")]) == 0
    text = capsys.readouterr().out
    assert "| ours (CostAwareSchedule) |" in text and "choice" not in text
    verify = json.loads((tmp_path / "older" / "summary.json").read_text())["costs"]["verify"]
    assert max(int(k) for k in verify) == 3 + 1
    # --fit-line prices the rounds by the line through the measured costs, and keeps what was measured
    assert benchmarks.cli.main(["stopping-replay", "--models", "tiny", "--streams", str(old), "--fit-line",
                                "--out", str(tmp_path / "line")]) == 0
    assert "the line through the measured T(k)" in capsys.readouterr().out
    costs = json.loads((tmp_path / "line" / "summary.json").read_text())["costs"]
    fitted = line_through({int(k): v for k, v in costs["measured"].items()})
    assert {int(k): v for k, v in costs["verify"].items()} == pytest.approx(fitted)


def test_the_line_through_measured_costs_is_least_squares():
    assert line_through({1: 1.0, 2: 2.0, 3: 3.0}) == pytest.approx({1: 1.0, 2: 2.0, 3: 3.0})
    # the noisy middle point pulls the line's level, not its slope: residuals sum to zero
    assert line_through({1: 1.0, 2: 3.0, 3: 3.0}) == pytest.approx({1: 4 / 3, 2: 7 / 3, 3: 10 / 3})
    assert line_through({1: 1.0, 5: 3.0}) == pytest.approx({1: 1.0, 5: 3.0}) and line_through({4: 2.0}) == {4: 2.0}


def test_skip_questions_replays_the_questions_after_the_first_n(tmp_path):
    def turns(*extra):
        out = tmp_path / "-".join(extra or ("all",))
        assert benchmarks.cli.main(["stopping-replay", "--models", "tiny", "--questions-per-group", "1",
                                    "--max-new-tokens", "3", "--depth", "2", "--out", str(out), *extra]) == 0
        return json.loads((out / "summary.json").read_text())["turns"]

    first, later = turns(), turns("--skip-questions", "1")
    assert first and later and not set(first) & set(later)
    # a streams file replays the turns of the selected questions only
    both = tmp_path / "both.jsonl"
    both.write_text((tmp_path / "all" / "streams.jsonl").read_text()
                    + (tmp_path / "--skip-questions-1" / "streams.jsonl").read_text())
    assert turns("--streams", str(both), "--skip-questions", "1") == later
    assert turns("--streams", str(both)) == first
    with pytest.raises(ValueError, match="no turn of .* belongs to the selected questions"):
        turns("--streams", str(tmp_path / "all" / "streams.jsonl"), "--skip-questions", "1")


def test_miss_ranks_counts_the_target_token_s_rank_where_the_first_choice_missed():
    # a token tied with the first choice ranks 1: not counted
    streams = [Stream([0, 1, 0, 0, 0], [[0.5]] * 5, [2, 1, 3, 0, 4]), Stream([0, 0, 2], [[0.5]] * 3, [2, 1, 1])]
    assert miss_ranks(streams) == {2: 2, 3: 1, 4: 1, 0: 1}
    assert miss_ranks([Stream([0], [[0.5]])]) == {2: 0, 3: 0, 4: 0, 0: 0}  # no ranks kept
