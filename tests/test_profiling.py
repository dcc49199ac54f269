"""Cost and agreement measurements (values of timings are never asserted, only their sanity)."""

import torch

from hf_polybasic.drafters import PromptLookup
from hf_polybasic.profiling import forward_cost, greedy_agreement, markdown_table, profile_level, run_levels_table
from hf_polybasic.testing import make_target, noisy_copy, prompt


def _continuations(target, count=2, tokens=12):
    pairs = []
    for seed in range(count):
        ids = prompt(6, seed=seed)
        out = target.generate(ids, do_sample=False, max_new_tokens=tokens, eos_token_id=None)
        pairs.append((ids, out[0, ids.shape[1] :]))
    return pairs


def test_forward_cost_is_a_positive_time_and_leaves_no_state():
    target = make_target()
    seconds = forward_cost(target, prompt(5), num_tokens=4, repeats=2)
    assert seconds > 0


def test_agreement_of_the_target_with_itself_is_k_and_of_a_worse_model_is_lower():
    target = make_target(seed=3)
    continuations = _continuations(target)
    assert greedy_agreement(target, continuations, k=4, stride=4) == 4
    noisy = greedy_agreement(noisy_copy(target, 0.6, seed=1), continuations, k=4, stride=4)
    assert 0 <= noisy < 4
    assert 0 <= greedy_agreement(PromptLookup(), continuations, k=4, stride=4) <= 4


def test_profile_row_and_table():
    target = make_target(seed=4)
    continuations = _continuations(target)
    row = profile_level("lookup", PromptLookup(), 0.01, 0.02, prompt(5), continuations, k=4, stride=4)
    assert row.step_seconds == 0 and row.relative_verify_cost == 0
    table = markdown_table([row], k=4)
    assert table.splitlines()[2].startswith("| lookup | 0.0 |")
    assert "greedy agreement (of 4)" in table


def test_levels_table_command_on_tiny_models(tmp_path):
    table = run_levels_table("tiny", k=3, new_tokens=8, stride=4, repeats=1, out=tmp_path)
    assert "| target |" in table and "early exit" in table
    assert (tmp_path / "levels_tiny.json").exists() and (tmp_path / "levels_tiny.md").read_text().strip() == table
