"""The planner: its pure functions on hand-made data (exact values), plan choices on hand-made
profiles, and profile -> plan -> generate on tiny random models (no timing is asserted)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import hf_polybasic as hp
from hf_polybasic.cli import main as cli
from hf_polybasic.drafters import PromptLookup
from hf_polybasic.costs import interpolate_cost, unslowed
from hf_polybasic.planning import (
    Profile,
    candidate_chains,
    encode_prompt,
    expected_run_length,
    expected_verifications,
    plan,
    predict,
    predict_time_per_token,
    profile,
    verification_walk,
    walk_acceptance_length,
)
from hf_polybasic.testing import make_chain, make_tokenizer, prompt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _profile(costs, agreement, drafters=(), draft_lengths=None) -> Profile:
    kinds = {label: ("drafter" if label in drafters else "model") for label in costs}
    return Profile(kinds=kinds, costs=costs, agreement=agreement, draft_lengths=draft_lengths or {})


# ------------------------------------------------------------------------------ pure functions
def test_expected_run_length_is_the_capped_mean_of_leading_ones_over_every_start_position():
    # leading ones at t = 0..3: 2, 1, 0, 1
    assert expected_run_length([[1, 1, 0, 1]], 2) == 1.0
    assert expected_run_length([[1, 1, 0, 1]], 1) == 0.75
    assert expected_run_length([[1, 1, 0, 1]], 1.5) == pytest.approx(0.875)  # between the two
    # prompts are pooled, and a run stops at the end of its own prompt
    assert expected_run_length([[1, 1], [0]], 5) == 1.0
    assert expected_run_length([[0, 0, 0]], 4) == 0.0


def test_verification_walk_follows_the_positions_decoding_visits():
    # at 0: 2 drafts (block), both accepted, emits 3; at 3 the budget leaves no room to draft
    assert verification_walk([[1, 1, 0, 1]], 2) == ([3, 1], [2, 0])
    assert walk_acceptance_length([[1, 1, 0, 1]], 2) == 2.0
    # a Drafter's caps: at 0 it proposed 2 tokens, at 3 one
    assert verification_walk([[1, 1, 1, 1, 1]], 8, [[2, 0, 0, 1, 0]]) == ([3, 2], [2, 1])
    # a copy region is jumped over, so it counts once per verification, not once per position
    indicators = [[0] * 10 + [1] * 6]
    assert walk_acceptance_length(indicators, 8) == pytest.approx(16 / 11)
    assert expected_run_length(indicators, 8) + 1 > walk_acceptance_length(indicators, 8)


def test_expected_verifications_is_the_renewal_recursion():
    assert expected_verifications([0, 0, 0, 1.0], 7) == 3  # exactly 3 tokens each: ceil(7 / 3)
    assert expected_verifications([0, 1.0], 5) == 5
    # 1 or 2 tokens with equal odds: E[v(2)] = 1 + E[v(1)] / 2, E[v(3)] = 1 + (E[v(2)] + E[v(1)]) / 2
    assert expected_verifications([0, 0.5, 0.5], 2) == 1.5
    assert expected_verifications([0, 0.5, 0.5], 3) == 2.25


def test_interpolate_cost_is_linear_between_points_and_follows_the_trend_past_the_last():
    points = {1: 1.0, 3: 2.0}
    assert interpolate_cost(points, 2) == 1.5
    assert interpolate_cost(points, 5) == 3.0
    assert interpolate_cost({1: 0.25}, 12) == 0.25
    # past the last point of a dense curve: from the last point at or below half its k, not the last two
    dense = {k: 1.0 + 0.1 * k + (0.5 if k % 4 == 3 else 0.0) for k in range(1, 18)}  # a dearer width every 4
    assert interpolate_cost(dense, 33) == pytest.approx(1.0 + 0.1 * 33)
    assert interpolate_cost({1: 1.0, 8: 2.0, 16: 1.9}, 30) == pytest.approx(1.9)  # a falling trend: flat
    # timing noise only slows: a timing over twice a longer forward's was slowed, and that bounds it;
    # within twice, what was measured stands (a kernel may cost more on fewer rows)
    assert unslowed([1.0, 2.0, 1.9]) == [1.0, 2.0, 1.9]
    assert unslowed([3.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]
    assert interpolate_cost(dense, 3) == pytest.approx(1.8) and interpolate_cost(dense, 4) == pytest.approx(1.4)
    # one preempted timing (seen in CI under load: T(4) 10x too slow) does not slow its neighbours
    assert unslowed([0.0005, 0.0536, 0.0050]) == [0.0005, 0.0050, 0.0050]


def test_predict_two_models_exact_arithmetic():
    # target: 1 s for one token, + 1/8 s per extra token fed; draft: 0.1 s per token
    profile_ = _profile({"target": {1: 1.0, 9: 2.0}, "draft": {1: 0.1}}, {("target", "draft"): [[1, 1, 1, 0] * 3]})
    prediction = predict(["target", "draft"], 2, None, profile_)
    # walk with K = 2: emits 3, 1, 3, 1, 3, 1 (the last gets no drafts: budget); drafts 2 x 5 + 0
    drafted = 10 / 6
    target_verify = 1.0 + drafted / 8
    drafting = 2 * 0.1 * drafted / 2
    assert prediction.levels[0].acceptance_length == 2.0
    assert prediction.time_per_token == pytest.approx((target_verify + drafting) / 2.0)
    assert prediction.time_per_token == pytest.approx(33 / 48)
    assert prediction.speedup == pytest.approx(1.0 / (33 / 48))
    # Lemma 3.1: T_1 / L_1 + beta T_2 / L_1 with beta = K
    assert prediction.lemma_time_per_token == pytest.approx(1.0 / 2 + 2 * 0.1 / 2)
    assert predict_time_per_token(["target", "draft"], 2, None, profile_) == prediction.time_per_token


def test_predict_three_models_exact_arithmetic():
    profile_ = _profile(
        {"target": {1: 1.0}, "mid": {1: 0.5}, "draft": {1: 0.1}},
        {
            ("target", "mid"): [[1, 1, 1, 0] * 5],
            ("target", "draft"): [[1, 0] * 10],
            ("mid", "draft"): [[1, 0] * 10],
        },
    )
    prediction = predict(["target", "mid", "draft"], 1, 3, profile_)
    target, mid, draft = prediction.levels
    # mid verifies K = 1 draft: every verification emits 2, so 2 of them reach mu = 3, a block of 4
    assert mid.acceptance_length == 2.0 and mid.verifications == 2.0 and mid.block == 4.0
    assert mid.seconds == pytest.approx(2 * (0.5 + 0.1))
    # the target verifies blocks of 4: emits 4 each time; the last block is cut to 3 by the budget
    assert target.acceptance_length == 4.0 and target.block_below == pytest.approx(3.8)
    assert prediction.time_per_token == pytest.approx((1.0 + 1.2 * 3.8 / 4) / 4)
    # the constant schedule: the one the prediction models
    assert prediction.config() == hp.PolybasicConfig(num_draft_tokens=1, block_threshold=3, schedule="constant")


def test_candidate_chains_keep_the_cost_order_and_put_a_drafter_only_last():
    profile_ = _profile(
        {"target": {1: 1.0}, "small": {1: 0.1}, "big": {1: 0.5}, "lookup": {1: 1e-5}},
        {
            ("target", "big"): [[1]], ("target", "small"): [[1]], ("target", "lookup"): [[1]],
            ("big", "small"): [[1]], ("big", "lookup"): [[1]], ("small", "lookup"): [[1]],
        },
        drafters=("lookup",),
        draft_lengths={"lookup": 8},
    )
    assert profile_.order == ("target", "big", "small", "lookup")
    chains = candidate_chains(profile_)
    assert len(chains) == 7 and ("target", "big", "small", "lookup") in chains
    assert candidate_chains(profile_, max_levels=2) == [("target", "big"), ("target", "small"), ("target", "lookup")]


# ---------------------------------------------------------------------------------- planning
def _free_perfect_drafter_profile() -> Profile:
    return _profile(
        {"target": {1: 1.0}, "mid": {1: 0.5}, "lookup": {1: 1e-6}},
        {
            ("target", "mid"): [[1, 0] * 20],
            ("target", "lookup"): [[1] * 40],
            ("mid", "lookup"): [[1] * 40],
        },
        drafters=("lookup",),
        draft_lengths={"lookup": 8},
    )


def test_plan_picks_a_free_perfect_drafter():
    result = plan(_free_perfect_drafter_profile())
    assert result.chain == ("target", "lookup")
    assert result.predicted_speedup == pytest.approx(8.0, rel=1e-3)  # 40 tokens in 5 verifications
    assert result.ranking[0] is result.best
    assert {e.label: e.included for e in result.explanations} == {"mid": False, "lookup": True}
    assert "target <- lookup" in str(result)
    assert json.loads(json.dumps(result.to_dict()))["chain"] == ["target", "lookup"]


def test_two_drafters_compete_for_the_bottom():
    profile_ = _profile(
        {"target": {1: 1.0}, "mid": {1: 0.3}, "lookup": {1: 1e-6}, "other": {1: 1e-6}},
        {
            ("target", "mid"): [[1, 1, 0] * 10],
            ("target", "lookup"): [[1] * 30], ("target", "other"): [[1, 0] * 15],
            ("mid", "lookup"): [[1] * 30], ("mid", "other"): [[1, 0] * 15],
        },
        drafters=("lookup", "other"),
        draft_lengths={"lookup": 8, "other": 8},
    )
    assert all(sum(label in ("lookup", "other") for label in chain) <= 1 for chain in candidate_chains(profile_))
    result = plan(profile_)
    assert result.chain == ("target", "lookup")
    other = next(e for e in result.explanations if e.label == "other")
    assert not other.included and other.insertion is None and "competes with lookup" in other.text


def test_plan_drops_a_costly_useless_middle_model_and_theorem_3_2_rejects_it():
    profile_ = _profile(
        {"target": {1: 1.0}, "mid": {1: 0.9}, "draft": {1: 0.05}},
        {
            ("target", "mid"): [[1, 0, 0, 0] * 10],
            ("target", "draft"): [[1, 1, 1, 0] * 10],
            ("mid", "draft"): [[1, 1, 0] * 13 + [1]],
        },
    )
    result = plan(profile_)
    assert result.chain == ("target", "draft")
    assert result.config.num_draft_tokens >= 2
    mid = next(e for e in result.explanations if e.label == "mid")
    assert not mid.included
    assert mid.best_without.chain == ("target", "draft")
    assert mid.best_with.speedup < mid.best_without.speedup
    insertion = mid.insertion
    assert (insertion.upper, insertion.new, insertion.lower) == ("target", "mid", "draft")
    assert insertion.t_i == 1.0 and insertion.t_new == 0.9 and insertion.t_next == 0.05
    assert insertion.beta == insertion.after.num_draft_tokens
    assert not insertion.verdict.helps and not insertion.verdict.paper_says_helps
    assert "Lemma-3.1 test rejects it" in mid.text and "paper's conditions reject it" in mid.text


def test_prefill_decides_short_generations_but_not_long_ones():
    profile_ = Profile(
        kinds={"target": "model", "mid": "model", "draft": "model"},
        costs={"target": {1: 1.0}, "mid": {1: 0.3}, "draft": {1: 0.05}},
        agreement={
            ("target", "mid"): [[1] * 40],
            ("target", "draft"): [[1, 1, 0] * 13 + [1]],
            ("mid", "draft"): [[1, 1, 1, 0] * 10],
        },
        prefill={"target": 5.0, "mid": 5.0, "draft": 0.2},
    )
    assert plan(profile_).chain == ("target", "mid", "draft")  # per token, the strong middle level pays
    short = plan(profile_, new_tokens=8)  # but its prefill does not, over 8 tokens
    assert short.chain == ("target", "draft") and short.new_tokens == 8
    best = short.best
    assert best.prefill_seconds == 5.2
    assert best.seconds_for(8) == pytest.approx(5.2 + 8 * best.time_per_token)
    assert short.predicted_speedup == pytest.approx((5.0 + 8 * 1.0) / best.seconds_for(8))
    assert Profile.from_dict(json.loads(json.dumps(profile_.to_dict()))).prefill == profile_.prefill
    with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
        plan(profile_, new_tokens=0)


def test_plan_advises_plain_generate_when_no_chain_pays():
    profile_ = _profile({"target": {1: 1.0}, "draft": {1: 0.9}}, {("target", "draft"): [[0] * 20]})
    result = plan(profile_)
    assert result.is_plain and result.chain == ("target",)
    assert result.assistant_models == [] and result.config is None and result.generate_kwargs() == {}
    assert result.predicted_speedup == 1.0
    assert "No chain is predicted to beat plain decoding" in str(result)


def test_profile_json_round_trip(tmp_path):
    original = _free_perfect_drafter_profile()
    path = original.save(tmp_path / "profile.json")
    loaded = Profile.load(path)
    assert loaded == original
    assert Profile.from_dict(json.loads(json.dumps(original.to_dict()))) == original
    chain = ["target", "mid", "lookup"]
    assert predict(chain, None, 8, loaded).time_per_token == predict(chain, None, 8, original).time_per_token
    assert "| target <- lookup |" in loaded.markdown()


def test_a_plan_from_a_loaded_profile_needs_the_objects():
    loaded = Profile.from_dict(_free_perfect_drafter_profile().to_dict())
    with pytest.raises(ValueError, match="loaded from JSON"):
        plan(loaded).assistant_models
    drafter = PromptLookup()
    assert plan(loaded, candidates={"lookup": drafter}).assistant_models == [drafter]
    with pytest.raises(ValueError, match=r"does not know"):
        plan(loaded, candidates={"nope": drafter})


# ------------------------------------------------------------------------------------ errors
def test_predict_errors_name_the_problem():
    profile_ = _free_perfect_drafter_profile()
    with pytest.raises(ValueError, match=r"unknown label\(s\) \['nope'\]"):
        predict(["target", "nope"], 4, None, profile_)
    with pytest.raises(ValueError, match="must start with 'target'"):
        predict(["mid", "lookup"], 4, None, profile_)
    with pytest.raises(ValueError, match="'lookup' is a Drafter.*only be the bottom"):
        predict(["target", "lookup", "mid"], 4, None, profile_)
    with pytest.raises(ValueError, match="K \\(num_draft_tokens\\) must be an int >= 1"):
        predict(["target", "mid"], 0, None, profile_)
    with pytest.raises(ValueError, match="give mu"):
        predict(["target", "mid", "lookup"], None, None, profile_)
    with pytest.raises(ValueError, match="one per intermediate level"):
        predict(["target", "mid", "lookup"], None, (4, 4), profile_)


def test_profile_construction_errors():
    with pytest.raises(ValueError, match="unknown label 'ghost'"):
        _profile({"target": {1: 1.0}}, {("target", "ghost"): [[1]]})
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        _profile({"target": {1: 0.0}}, {})
    with pytest.raises(ValueError, match="a Drafter never verifies"):
        _profile({"target": {1: 1.0}, "lookup": {1: 1e-6}, "d": {1: 0.1}}, {("lookup", "d"): [[1]]},
                 drafters=("lookup",), draft_lengths={"lookup": 8})
    with pytest.raises(ValueError, match="needs proposal_lengths or draft_lengths"):
        _profile({"target": {1: 1.0}, "lookup": {1: 1e-6}}, {}, drafters=("lookup",))
    with pytest.raises(ValueError, match="only 0 and 1"):
        expected_run_length([[1, 2]], 4)
    with pytest.raises(ValueError, match="emitted_pmf must be a distribution"):
        expected_verifications([0.5, 0.5], 3)


def test_profile_argument_errors():
    target, mid = make_chain("llama", depth=2, seed=0)
    with pytest.raises(ValueError, match="prompts must not be empty"):
        profile(target, {"mid": mid}, None, [], progress=False)
    with pytest.raises(ValueError, match="non-empty strings other than 'target'"):
        profile(target, {"target": mid}, None, [prompt(5)], progress=False)
    with pytest.raises(TypeError, match=r"candidates\['x'\] must be a transformers model or"):
        profile(target, {"x": object()}, None, [prompt(5)], progress=False)
    with pytest.raises(ValueError, match="need a tokenizer"):
        profile(target, {"mid": mid}, None, ["some text"], progress=False)


def test_prompts_may_be_text_chat_or_ids():
    tokenizer = make_tokenizer()
    ids = encode_prompt(tokenizer, "abc")
    assert ids.shape == (1, 3)
    assert torch.equal(encode_prompt(tokenizer, [{"role": "user", "content": "abc"}]), ids)
    assert torch.equal(encode_prompt(None, ids[0]), ids) and torch.equal(encode_prompt(None, ids[0].tolist()), ids)


# ------------------------------------------------------------------------------- integration
@pytest.fixture(scope="module")
def tiny_pool():
    target, mid, draft = make_chain("llama", depth=3, seed=0)
    candidates = {"mid": mid, "draft": draft, "lookup": PromptLookup(max_ngram=3, num_tokens=8)}
    prompts = [prompt(8, seed=s) for s in range(2)]
    return target, candidates, prompts


def _greedy_profile(pool):
    target, candidates, prompts = pool
    return profile(
        target, candidates, None, prompts, max_new_tokens=12, block_sizes=(1, 4), repeats=1, progress=False,
        generate_kwargs={"eos_token_id": None},
    )


def test_profile_on_tiny_models_and_its_walk_matches_generate_exactly(tiny_pool):
    target, candidates, prompts = tiny_pool
    measured = _greedy_profile(tiny_pool)
    assert measured.order[0] == "target" and measured.order[-1] == "lookup"
    assert set(measured.costs["target"]) == {1, 4} and measured.costs["lookup"].keys() == {1}
    assert len(measured.agreement) == 6  # target, mid, draft over everything below; lookup below all
    assert all(len(p) == 12 for lists in measured.agreement.values() for p in lists)
    assert measured.models["mid"] is candidates["mid"]
    assert "| target <- lookup |" in str(measured)
    # greedy, no EOS, the same budget: the walk's L of the target is N / F of a real run, exactly
    for chain, K in ((("target", "draft"), 3), (("target", "lookup"), None)):
        predicted = predict(chain, K, None, measured).levels[0].acceptance_length
        tokens = forwards = 0
        for ids in prompts:
            out = target.generate(
                ids, custom_generate=hp.generate, assistant_models=measured.models_for(chain),
                polybasic_config=hp.PolybasicConfig(num_draft_tokens=K or 4, schedule="constant"),
                do_sample=False, max_new_tokens=12,
                eos_token_id=None,
            )
            tokens += out.shape[1] - ids.shape[1]
            forwards += hp.last_stats(target).levels[0].forward_passes
        assert predicted == pytest.approx(tokens / forwards)


def test_plan_plugs_into_generate_and_keeps_greedy_output(tiny_pool):
    target, _, prompts = tiny_pool
    measured = _greedy_profile(tiny_pool)
    # tiny models cost about the same; make the target expensive so that chains pay (flat in k: one
    # slowed timing of its measured curve would otherwise carry over, as it did in docs/howto/planner.md)
    measured.costs["target"] = {k: 1000 * measured.costs["target"][1] for k in measured.costs["target"]}
    result = hp.plan(measured, k_grid=(2, 4), mu_grid=(4, 8))
    assert isinstance(result, hp.Plan) and not result.is_plain
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    for ids in prompts:
        plain = target.generate(ids, **options)
        out = target.generate(
            ids, custom_generate=hp.generate, assistant_models=result.assistant_models,
            polybasic_config=result.config, **options,
        )
        assert torch.equal(out, plain)
        assert torch.equal(target.generate(ids, **result.generate_kwargs(), **options), plain)
    for row in result.ranking[:4]:  # other chains of the ranking run and stay exact too
        if not row.is_plain:
            out = target.generate(
                prompts[0], custom_generate=hp.generate, assistant_models=measured.models_for(row.chain),
                polybasic_config=row.config(), **options,
            )
            assert torch.equal(out, target.generate(prompts[0], **options))


def test_sampling_profile_records_overlaps(tiny_pool):
    target, candidates, prompts = tiny_pool
    measured = hp.profile(
        target, {"mid": candidates["mid"], "lookup": candidates["lookup"]}, None, prompts[:1], do_sample=True,
        temperature=0.7, max_new_tokens=8, block_sizes=(1, 2), repeats=1, progress=False,
        generate_kwargs={"eos_token_id": None},
    )
    assert measured.sampling and measured.decoding["temperature"] == 0.7
    overlaps = [v for lists in measured.overlaps.values() for p in lists for v in p]
    assert overlaps and all(0.0 <= v <= 1.0 + 1e-6 for v in overlaps)
    assert 0.0 <= measured.acceptance_rate("target", "mid") <= 1.0 + 1e-6
    assert Profile.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    assert hp.plan(measured).ranking


def test_plan_command_validates_tiny_models_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan"
    argv = [
        "plan", "--models", "tiny", "--max-new-tokens", "8", "--prompts", "2", "--cost-repeats", "1",
        "--early-exit-layers", "0", "--validate", "--grid", "tiny", "--repeats", "1", "--out", str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    assert "Why each candidate is in or out" in capsys.readouterr().out
    for name in ("profile.json", "plan.json", "plan.md", "validation.json", "validation.md"):
        assert (out / name).stat().st_size > 0
    assert (out / "predicted_vs_measured.png").read_bytes().startswith(PNG_MAGIC)
    record = json.loads((out / "validation.json").read_text())
    assert record["configurations"] and all(row["identical_to_plain"] for row in record["configurations"])
    columns = {"lemma_verdict", "paper_verdict", "measured_before", "measured_after"}
    assert record["table_1"] and columns <= set(record["table_1"][0])
    assert 0 < record["planner"]["ratio"] <= 1.0 + 1e-9
    assert Profile.load(out / "profile.json").order[0] == "target"
    assert "Table 1" in (out / "validation.md").read_text()


def test_a_profile_says_when_a_timing_was_slowed(tiny_pool, monkeypatch):
    """A forward measured over twice a longer forward's time of the same model was slowed by something
    else on the machine (CI's installs made a target's T(4) 10x its T(8)): the plan prices it at the
    longer forward's cost, and `profile` says so, naming the timing and how to get steadier ones."""
    from hf_polybasic.planning import measure
    from hf_polybasic.planning.measure import slowed_timings

    found = slowed_timings({"target": {1: 0.0005, 4: 0.0536, 8: 0.005}, "lookup": {1: 2e-5}})
    assert found == [("target", 4, 8, pytest.approx(10.72))]
    assert slowed_timings({"target": {1: 1.0, 4: 1.9, 8: 1.0, 16: 2.0}}) == []  # within 2x: noise the envelope takes
    assert slowed_timings({"m": {1: 3.0, 4: 1.4, 8: 1.2}}) == [("m", 1, 8, pytest.approx(2.5))]  # the least longer one
    target = tiny_pool[0]
    measured = measure.forward_cost
    monkeypatch.setattr(measure, "forward_cost", lambda model, prefix, k, repeats: measured(model, prefix, k, repeats)
                        * (50 if model is target and k == 1 else 1))
    with pytest.warns(UserWarning, match=r"hp.profile: .*\(target: T\(1\) \d+\.\dx T\(4\)\).*repeats=1.*repeats=5") as said:
        _greedy_profile(tiny_pool)
    assert next(w for w in said if "hp.profile" in str(w.message)).filename == __file__  # at the user's line
    # the control: steady timings (a forward costs what its tokens do) say nothing
    monkeypatch.setattr(measure, "forward_cost", lambda model, prefix, k, repeats: 0.001 * (1 + k / 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hp.profile")
        _greedy_profile(tiny_pool)
