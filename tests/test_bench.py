"""The benchmark harness (benchmarks.bench) end to end on tiny random models, plus its formulas."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest
import torch
from transformers import GenerationMixin

from hf_polybasic import compat

from hf_polybasic.models import packed as cpu
from benchmarks.bench import BenchSettings, Method, rebuild_report, run_benchmark, speedup
from benchmarks.bench import cli as bench_cli
from benchmarks.bench import methods as bench_methods
from benchmarks.bench import prompts
from benchmarks.bench.report import first_difference, question_speeds, summarise
from benchmarks.bench.calls import messages_for
from benchmarks.bench.runner import describe_run
from benchmarks.bench.records import question_seed, read_records
from benchmarks.bench.settings import DECODINGS
from hf_polybasic.cli.harness import RssSampler

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_NEW = 12


# ------------------------------------------------------------------------------------ formulas
def test_speedup_is_the_ratio_of_mean_speeds_not_the_mean_of_ratios():
    # per-question tokens/s of a method and of plain generate
    method, plain = [10.0, 30.0], [5.0, 30.0]
    assert speedup(method, plain) == pytest.approx(20.0 / 17.5)
    assert speedup(method, plain) != pytest.approx(statistics.fmean([10 / 5, 30 / 30]))
    assert speedup([20.0, 40.0], [10.0, 10.0]) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        speedup([], [1.0])


def _record(method, question, turn, repeat, tokens, seconds, group="qa"):
    return {
        "method": method, "question_id": question, "turn": turn, "repeat": repeat, "group": group,
        "new_tokens": tokens, "seconds": seconds, "target_forwards": tokens, "output_ids": [0] * tokens,
        "rss_peak_mib": 1.0, "levels": None,
    }


def test_per_question_speed_sums_turns_and_speedup_takes_the_median_over_repeats():
    questions = [prompts.Question("a", "writing", "multi-turn conversation", ("t1", "t2")),
                 prompts.Question("b", "qa", "qa", ("t1",))]
    records = []
    # question a: two turns; tokens/s = (10 + 30) / (1 + 3) = 10 for plain, 40 / 2 = 20 for fast
    for repeat, factor in enumerate([1.0, 2.0, 4.0]):  # fast is 2x, 4x, 8x plain: median 4x
        records += [_record("plain", "a", 0, repeat, 10, 1.0, "multi-turn conversation"),
                    _record("plain", "a", 1, repeat, 30, 3.0, "multi-turn conversation"),
                    _record("fast", "a", 0, repeat, 10, 0.5 / factor, "multi-turn conversation"),
                    _record("fast", "a", 1, repeat, 30, 1.5 / factor, "multi-turn conversation"),
                    _record("plain", "b", 0, repeat, 10, 1.0), _record("fast", "b", 0, repeat, 10, 0.5 / factor)]
    speeds = question_speeds(records, {"a": 2, "b": 1})
    assert speeds[("plain", 0, "a")] == pytest.approx(10.0)
    assert speeds[("fast", 0, "a")] == pytest.approx(20.0)
    # a question with a missing turn is not counted
    assert ("plain", 0, "a") not in question_speeds(records[1:], {"a": 2, "b": 1})

    names = [bench_methods.Method("plain", "plain", "", {}, None), bench_methods.Method("fast", "custom", "", {}, None)]
    summary = summarise(records, names, questions)
    overall = summary["table"]["overall"]["fast"]
    assert overall["speedup_per_repeat"] == pytest.approx([2.0, 4.0, 8.0])
    assert overall["speedup"] == pytest.approx(4.0)
    assert overall["n_questions"] == 2 and overall["n_repeats"] == 3
    assert summary["table"]["qa"]["fast"]["n_questions"] == 1
    assert summary["table"]["overall"]["plain"]["tokens_per_target_forward"] == pytest.approx(1.0)


def test_first_difference_and_seeds():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert question_seed(0, "81", 1) == question_seed(0, "81", 1) != question_seed(0, "81", 0)


# ------------------------------------------------------------------------------------ questions
def test_spec_bench_categories_map_to_the_task_groups(tmp_path: Path):
    path = tmp_path / "questions.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku about tea.", "Now one about coffee."]},
        {"question_id": 2, "category": "coding", "turns": ["Sort a list in Python.", "Now in reverse."]},
        {"question_id": 3, "category": "math_reasoning", "turns": ["What is 2 + 3?"]},
        {"question_id": 4, "category": "translation", "turns": ["Translate German to English: Guten Tag."]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    questions = prompts.load_question_file(path)
    assert [q.group for q in questions] == ["multi-turn conversation"] * 2 + ["math reasoning", "translation"]
    chosen = prompts.select(questions, groups=["math-reasoning", "multi_turn_conversation"], per_group=1)
    assert [q.question_id for q in chosen] == ["1", "3"]
    with pytest.raises(ValueError, match="no questions in group"):
        prompts.select(questions, groups=["rag"])
    # --categories: the file's own categories, each a group (code and prose apart, though Spec-Bench files
    # both under MT-bench)
    chosen = prompts.select(prompts.by_category(questions, ["coding", "writing"]), per_group=1)
    assert [(q.question_id, q.group) for q in chosen] == [("2", "coding"), ("1", "writing")]
    # --skip-questions: the next ones of each group (a group with no more is left out)
    chosen = prompts.select(questions, per_group=1, skip=1)
    assert [q.question_id for q in chosen] == ["2"]
    with pytest.raises(ValueError, match="no questions of category"):
        prompts.by_category(questions, ["roleplay"])


def test_default_set_covers_seven_groups():
    questions = prompts.default_questions()
    assert {q.group for q in questions} == set(prompts.TASK_GROUPS)
    assert all(len([q for q in questions if q.group == g]) >= 2 for g in prompts.TASK_GROUPS)
    assert all(len(q.turns) == 2 for q in questions if q.group == "multi-turn conversation")


def test_second_turn_messages_hold_the_first_answer():
    question = prompts.Question("x", "writing", "multi-turn conversation", ("first?", "second?"))
    assert messages_for(question, 1, ["answer one"]) == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "second?"},
    ]


# ----------------------------------------------------------------------------------- methods
def test_hf_assisted_restores_the_assistant_generation_config():
    from hf_polybasic.testing import make_chain, prompt

    target, draft = make_chain("llama", depth=2)
    draft.generation_config = type(draft.generation_config).from_dict(draft.generation_config.to_dict())
    draft.generation_config.num_assistant_tokens = 17
    schedule = draft.generation_config.num_assistant_tokens_schedule
    method = bench_methods.hf_assisted(draft, "draft", num_assistant_tokens=3)
    inputs = {"input_ids": prompt(6), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    out = method.run(target, inputs, {"do_sample": False, "max_new_tokens": 8})
    assert torch.equal(out, target.generate(**inputs, do_sample=False, max_new_tokens=8))
    assert draft.generation_config.num_assistant_tokens == 17
    assert draft.generation_config.num_assistant_tokens_schedule == schedule


def test_the_other_tokenizer_methods_run_on_the_tiny_set():
    """SmolLM2's methods on the tiny set's stand-in (a model with a tokenizer of its own): ours by each route
    and below the drafter, greedy output equal to plain generate's; transformers' UAD (greedy) and USD
    (sampling, on the copy with a float output layer, which it prunes)."""
    from hf_polybasic.cli.model_sets import build_model_set

    names = ["ours-smol", "ours-smol-text", "ours-draft-smol", "hf-assisted-smol"]
    model_set = build_model_set("tiny", bench_methods.needed_pool(names))
    options = bench_methods.MethodOptions()
    inputs = {"input_ids": torch.tensor([[10, 20, 30, 40, 50, 60]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    greedy = {"do_sample": False, "max_new_tokens": 6, "eos_token_id": None}
    expected = model_set.target.generate(**inputs, **greedy)
    for name in names:
        method = bench_methods.RECIPES[name].build(model_set, options)
        assert torch.equal(method.run(model_set.target, inputs, greedy), expected), name
    sampled = bench_methods.RECIPES["hf-assisted-smol"].build(model_set, options).run(
        model_set.target, inputs, {"do_sample": True, "max_new_tokens": 6, "eos_token_id": None})
    assert sampled.shape == expected.shape


@pytest.mark.parametrize("name", ["hf-assisted", "hf-assisted-smol"])
def test_transformers_rounds_are_counted_on_its_candidate_generator(name):
    """transformers' assisted generation (same tokenizer, and UAD through text) counted round by round:
    one verification per target forward after the prefill, every emitted token an accepted draft or the
    target's own, and the model left as it was (no hook behind)."""
    from hf_polybasic.cli.model_sets import build_model_set

    from benchmarks.bench.hf_rounds import counting_rounds

    model_set = build_model_set("tiny", bench_methods.needed_pool([name]))
    method = bench_methods.RECIPES[name].build(model_set, bench_methods.MethodOptions())
    target = model_set.target
    inputs = {"input_ids": torch.tensor([[10, 20, 30, 40, 50, 60]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with counting_rounds(target) as counts:
            out = method.run(target, inputs, {"do_sample": False, "max_new_tokens": 12, "eos_token_id": None})
    finally:
        hook.remove()
    new = out.shape[1] - 6
    assert counts["verifications"] == len(forwards) >= 2
    assert counts["drafted"] >= counts["verifications"] and 0 <= counts["accepted"] <= counts["drafted"]
    assert counts["accepted"] + counts["verifications"] >= new  # each round: its accepted drafts, then the target's
    assert "_get_candidate_generator" not in vars(target)


def test_rss_sampler_catches_a_peak_that_is_gone_before_the_block_ends():
    import time

    size_mib = 256
    with RssSampler(interval=0.01) as rss:
        buffer = torch.ones(size_mib * 2**20 // 4)  # touched: resident
        time.sleep(0.2)
        del buffer
    assert rss.peak >= rss.before + 0.8 * size_mib
    assert rss.after <= rss.peak - 0.5 * size_mib


# --------------------------------------------------------------------------------- end to end
def _broken_run(target, inputs, options):
    """plain generate with its last new token changed: a lossy method the check must catch."""
    out = target.generate(**inputs, **options).clone()
    out[0, -1] = (out[0, -1] + 1) % target.config.vocab_size
    return out


class Spy:
    """plain generate that keeps the prompts it was given."""

    def __init__(self):
        self.prompts: list[torch.Tensor] = []

    def __call__(self, target, inputs, options):
        self.prompts.append(inputs["input_ids"][0].clone())
        return target.generate(**inputs, **options)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    spy = Spy()
    extra = [
        Method("broken", "custom", "plain generate, last token changed", {"broken": True}, _broken_run),
        Method("spy", "custom", "plain generate, prompts recorded", {"spy": True}, spy),
    ]
    settings = BenchSettings(models="tiny", questions_per_group=1, max_new_tokens=MAX_NEW, output_dir=str(out),
                             progress=False, command="pytest tests/test_bench.py")
    result = run_benchmark(settings, extra_methods=extra)
    return settings, result, spy


def test_every_call_is_recorded(quick_run):
    settings, result, _ = quick_run
    records = read_records(result.output_dir / "results.jsonl")
    # 7 groups, one question each, the conversation question has 2 turns: 8 calls per method
    methods = len(bench_methods.DEFAULT_METHODS) + 2
    assert result.units_run == len(records) == 8 * methods
    assert all(r["new_tokens"] == MAX_NEW and r["seconds"] > 0 for r in records)
    ours = [r for r in records if r["method"].startswith("ours-")]
    assert ours and all(r["levels"] and r["levels"][0]["role"] == "target" for r in ours)
    # what each level withheld and how many rounds it sat out, as `polybasic_stats` counted them
    assert all(isinstance(level[key], int) and level[key] >= 0
               for r in ours for level in r["levels"] for key in ("withheld", "paused_rounds"))
    assert all(r["levels"] is None for r in records if not r["method"].startswith("ours-"))
    # the target's rounds: ours as its level counted them, transformers' as its candidate generator ran them
    assert all(r["rounds"] == {key: r["levels"][0][key] for key in ("verifications", "drafted", "accepted")}
               for r in ours)
    assisted = [r for r in records if r["method"].startswith("hf-assisted")]
    assert assisted and all(r["rounds"]["verifications"] == r["target_forwards"] for r in assisted)
    assert all(r["rounds"] is None for r in records if r["method"] in ("plain", "spy", "broken"))
    plain = [r for r in records if r["method"] == "plain"]
    assert all(r["target_forwards"] == MAX_NEW for r in plain)
    run = json.loads((result.output_dir / "run.json").read_text())
    assert run["machine"]["torch"] == torch.__version__ and run["command"] == "pytest tests/test_bench.py"


def test_each_turn_takes_the_median_over_repeats_and_the_lowest_turn_is_named():
    """The report's per-turn table and lowest turns (`report.turn_speeds`, `report.lowest_turns`): ours
    against plain and against the other methods, each at the turn of its lowest median ratio."""
    from benchmarks.bench.report import lowest_turns, turn_speeds

    records = []
    for repeat, slow in enumerate([1.0, 3.0, 2.0]):
        records += [_record("plain", "a", 0, repeat, 10, 1.0), _record("plain", "a", 1, repeat, 10, 2.0),
                    _record("hf", "a", 0, repeat, 10, 0.5), _record("hf", "a", 1, repeat, 10, 1.0 * slow),
                    _record("ours", "a", 0, repeat, 10, 0.25 * slow), _record("ours", "a", 1, repeat, 10, 0.8)]
    turns = turn_speeds(records)
    assert turns[("a", 1)] == pytest.approx({"plain": 5.0, "hf": 5.0, "ours": 12.5})  # hf: median of 10, 3.33, 5
    assert turns[("a", 0)]["ours"] == pytest.approx(20.0)
    names = [bench_methods.Method("plain", "plain", "", {}, None), bench_methods.Method("hf", "custom", "", {}, None),
             bench_methods.Method("ours", "polybasic", "", {}, None, polybasic=True)]
    found = {(low["method"], low["against"]): (low["ratio"], low["turn"]) for low in lowest_turns(turns, names)}
    assert found[("hf", "plain")] == (pytest.approx(1.0), 1)
    assert found[("ours", "plain")] == (pytest.approx(2.0), 0)
    assert found[("ours", "hf")] == (pytest.approx(1.0), 0)
    assert set(found) == {("hf", "plain"), ("ours", "plain"), ("ours", "hf")}


def test_each_levels_withheld_drafts_and_paused_rounds_are_recorded_and_pooled():
    """A call's record carries what `polybasic_stats` counted per level (`calls._level_rows`); the summary
    adds them up over the calls it pools (`report._levels`)."""
    from types import SimpleNamespace
    from benchmarks.bench.calls import _level_rows
    from benchmarks.bench.report import _levels
    from hf_polybasic.stats import LevelStats

    records = []
    for withheld, paused in [(3, 2), (5, 1)]:
        stats = SimpleNamespace(levels=[LevelStats("M1", "target"), LevelStats("M2", "drafter", withheld=withheld,
                                                                              paused_rounds=paused)])
        records.append({"levels": _level_rows(stats), "new_tokens": 8})
    assert [(level["withheld"], level["paused_rounds"]) for level in records[0]["levels"]] == [(0, 0), (3, 2)]
    assert [(level["withheld"], level["paused_rounds"]) for level in _levels(records)] == [(0, 0), (8, 3)]


def test_table_and_plots_are_written(quick_run):
    _, result, _ = quick_run
    table = (result.output_dir / "results.md").read_text()
    for name in [*bench_methods.DEFAULT_METHODS, "broken", "spy"]:
        assert f"| {name} |" in table
    for group in prompts.TASK_GROUPS:
        assert group in table
    assert "(n=1)" in table and "(n=7)" in table  # the sample size is next to every number
    assert "Acceptance length per level" in table
    assert "## Drafts per target round" in table and "| hf-assisted | " in table.split("## Drafts per target round")[1]
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["table"]["overall"]["plain"]["speedup"] == pytest.approx(1.0)
    levels = summary["table"]["overall"]["ours-mid-draft"]["levels"]
    assert [level["role"] for level in levels] == ["target", "intermediate", "drafter"]
    assert levels[0]["mean_acceptance_length"] >= 1.0
    mine = [r for r in read_records(result.output_dir / "results.jsonl") if r["method"] == "ours-mid-draft"]
    for key in ("withheld", "paused_rounds"):  # pooled over the method's calls
        assert [level[key] for level in levels] == [sum(r["levels"][i][key] for r in mine) for i in range(3)]
    plots = sorted(p.name for p in result.output_dir.glob("*.png"))
    assert plots == sorted(["speedup.png"] + [f"acceptance_{m}.png" for m in bench_methods.DEFAULT_METHODS
                                              if m.startswith("ours-")])
    for plot in plots:
        assert (result.output_dir / plot).read_bytes()[:8] == PNG_MAGIC


def test_greedy_equality_holds_for_ours_and_a_broken_method_is_caught(quick_run):
    _, result, _ = quick_run
    flagged = {m["method"] for m in result.mismatches}
    assert flagged == {"broken"}
    assert len(result.mismatches) == 8
    first = result.mismatches[0]
    assert first["position"] == MAX_NEW - 1 and first["question_id"]
    assert result.exit_code == 1
    table = (result.output_dir / "results.md").read_text()
    assert "MISMATCH: 8 output(s)" in table
    assert f"| broken | {first['question_id']} | 1 | 0 | {MAX_NEW - 1} |" in table


def test_second_turn_prompt_contains_the_first_answer(quick_run):
    _, result, spy = quick_run
    records = read_records(result.output_dir / "results.jsonl")
    first, second = (r for r in records if r["method"] == "spy" and r["question_id"] == "conversation-1")
    turn_two = next(p for p in spy.prompts if p.shape[0] == second["prompt_tokens"])
    from hf_polybasic.testing import make_tokenizer

    text = make_tokenizer().decode(turn_two.tolist(), skip_special_tokens=True)
    assert first["output_text"] and first["output_text"] in text


def test_rerun_skips_finished_work(quick_run, monkeypatch):
    settings, result, _ = quick_run
    calls = []
    original = GenerationMixin.generate

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counting)
    again = run_benchmark(settings, extra_methods=[
        Method("broken", "custom", "plain generate, last token changed", {"broken": True}, _broken_run)
    ])
    assert calls == [] and again.units_run == 0 and again.units_cached == 8 * (len(bench_methods.DEFAULT_METHODS) + 1)
    # one more question group run: only its calls (plus one warm-up per method) are made
    wider = BenchSettings(**{**settings.__dict__, "questions_per_group": 2, "methods": ("ours-draft",),
                             "groups": ("qa",)})
    grown = run_benchmark(wider)
    assert grown.units_run == 2 and grown.units_cached == 2
    assert len(calls) == 2 + 2  # 2 new calls + 1 warm-up for each of plain and ours-draft
    rebuilt = rebuild_report(settings.output_dir)  # the last run: qa, 2 questions
    assert rebuilt.summary["table"]["overall"]["ours-draft"]["n_questions"] == 2
    # a run stopped before writing run.json is described from its settings, loading no model
    (Path(settings.output_dir) / "run.json").unlink()
    calls.clear()
    described = rebuild_report(settings.output_dir, settings)
    assert calls == [] and described.summary["table"]["overall"]["ours-mid-draft"]["n_questions"] == 7
    assert described.mismatches == []  # the broken method is not part of the described run


def test_changed_settings_do_not_reuse_results(quick_run, tmp_path):
    settings, _, _ = quick_run
    sampled = BenchSettings(**{**settings.__dict__, "decoding": "sample-t1", "groups": ("qa",),
                               "methods": ("ours-draft",)})
    result = run_benchmark(sampled)
    assert result.units_run == 2 and result.mismatches == []  # not checked when sampling
    records = [r for r in read_records(result.output_dir / "results.jsonl") if r["seed"] is not None]
    assert len(records) == 2 and records[0]["seed"] == records[1]["seed"]  # same seed per question
    assert DECODINGS["sample-t1"]["top_k"] == 0


# ---------------------------------------------------------------------------------------- CLI
def test_cli_runs_and_registers_on_a_parser(tmp_path: Path, capsys):
    argv = ["--models", "tiny", "--groups", "code", "--methods", "ours-lookup,hf-lookup", "--max-new-tokens", "8",
            "--questions-per-group", "1", "--output", str(tmp_path / "out"), "--no-progress"]
    assert bench_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| ours-lookup |" in printed and "Speedup over plain generate" in printed
    assert (tmp_path / "out" / "speedup.png").exists()

    parser = argparse.ArgumentParser(prog="hf-polybasic")
    bench_cli.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick", "--models", "qwen", "--methods", "plain,ours-draft"])
    assert args.handler is bench_cli.run_from_args
    settings = bench_cli.settings_from_args(args)
    assert (settings.questions_per_group, settings.max_new_tokens, settings.methods) == (1, 24, ("plain", "ours-draft"))
    assert settings.output_dir == "bench-results/qwen-greedy-quick"
    assert bench_cli.settings_from_args(parser.parse_args(["bench", "--skip-questions", "3"])).skip_questions == 3
    with pytest.raises(ValueError, match="skip_questions"):
        BenchSettings(skip_questions=-1)

    assert bench_cli.main(["--list-methods"]) == 0
    assert "ours-mid-draft" in capsys.readouterr().out
    assert bench_cli.main(["--methods", "nope", "--output", str(tmp_path / "x")]) == 2


def test_a_packed_target_is_a_different_run_whose_greedy_output_stays_exact(tmp_path: Path):
    if not compat.onednn_supports(torch.float32):
        pytest.skip("this machine cannot pack float32 linear layers")
    base = dict(models="tiny", groups=("code",), methods=("plain", "ours-draft-auto"), questions_per_group=1,
                max_new_tokens=8, output_dir=str(tmp_path), progress=False)
    unpacked, _, _, run = describe_run(BenchSettings(**base), load=False)
    packed_set, _, _, packed_run = describe_run(BenchSettings(**base, pack_target=True))
    assert "packed" in packed_set.labels["target"] and run["fingerprint"] != packed_run["fingerprint"]
    assert any(isinstance(module, cpu.PackedLinear) for module in packed_set.target.modules())
    result = run_benchmark(BenchSettings(**base, pack_target=True))
    assert result.units_run == 2 and result.mismatches == []


def test_the_strict_lookup_chain_copies_only_after_three_token_matches_and_equals_plain_generate():
    """``ours-draft-lookup3-auto``: the drafter over a PromptLookup that copies only after a match of at least
    3 tokens (the spec and label say so, apart from ``ours-draft-lookup-auto``'s), greedy output equal to
    plain generate's on a prompt that repeats itself."""
    from hf_polybasic.cli.model_sets import build_model_set

    model_set = build_model_set("tiny", bench_methods.needed_pool(["ours-draft-lookup3-auto"]))
    options = bench_methods.MethodOptions()
    strict = bench_methods.RECIPES["ours-draft-lookup3-auto"].build(model_set, options)
    loose = bench_methods.RECIPES["ours-draft-lookup-auto"].build(model_set, options)
    assert strict.spec != loose.spec and "3<=n<=3" in strict.description
    lookup, label = bench_methods._lookup(options, "lookup3")
    assert (lookup.min_ngram, lookup.max_ngram) == (3, 3) and label == "PromptLookup(8 tokens, 3<=n<=3)"
    assert bench_methods._lookup(options)[1] == "PromptLookup(8 tokens, n<=3)"
    shorter = bench_methods._lookup(bench_methods.MethodOptions(lookup_max_ngram=2), "lookup3")  # 3 at least
    assert (shorter[0].max_ngram, shorter[1]) == (3, "PromptLookup(8 tokens, 3<=n<=3)")
    sequence = torch.tensor([[5, 6, 7, 8, 9, 1, 6, 7]])
    assert lookup.propose(sequence, 4)[0].numel() == 0  # a 2-token match (6 7) is not copied after
    assert bench_methods._lookup(options)[0].propose(sequence, 4)[0].tolist() == [8, 9, 1, 6]
    assert lookup.propose(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]]), 4)[0].tolist() == [8, 9, 5, 6]
    ids = torch.tensor([[10, 20, 30, 40, 50, 10, 20, 30, 40]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    greedy = {"do_sample": False, "max_new_tokens": 8, "eos_token_id": None}
    assert torch.equal(strict.run(model_set.target, inputs, greedy), model_set.target.generate(**inputs, **greedy))
    stats = bench_methods.last_stats(model_set.target)
    assert stats.levels[-1].proposed > 0 and stats.levels[1].proposed > 0  # the lookup and the drafter took part
