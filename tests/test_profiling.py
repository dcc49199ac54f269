"""Cost and agreement measurements (values of timings are never asserted, only their sanity)."""

import torch

from hf_polybasic.drafters import Drafter, PromptLookup
from hf_polybasic.costs import forward_cost
from benchmarks.levels_table import greedy_agreement, markdown_table, profile_level, run_levels_table
from hf_polybasic.testing import make_target, noisy_copy, prompt


def _continuations(target, count=2, tokens=12):
    pairs = []
    for seed in range(count):
        ids = prompt(6, seed=seed)
        out = target.generate(ids, do_sample=False, max_new_tokens=tokens, eos_token_id=None)
        pairs.append((ids, out[0, ids.shape[1] :]))
    return pairs


def test_forward_cost_leaves_the_model_as_it_was():
    target = make_target()
    ids = prompt(5, seed=1)
    before = target(ids).logits
    state = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    forward_cost(target, prompt(5), num_tokens=4, repeats=2)
    assert torch.equal(target(ids).logits, before)
    assert all(torch.equal(tensor, state[name]) for name, tensor in target.state_dict().items())
    assert not target._forward_pre_hooks and not target._forward_hooks


class FirstTokensRight(Drafter):
    """Proposes the continuation's next `right` tokens, then one wrong token."""

    def __init__(self, continuation, prompt_length, right):
        self.continuation, self.prompt_length, self.right = continuation, prompt_length, right

    def propose(self, sequence, max_new_tokens):
        start = sequence.shape[1] - self.prompt_length
        good = self.continuation[start : start + self.right]
        wrong = (self.continuation[start + self.right : start + self.right + 1] + 1) % 96
        return torch.cat([good, wrong])[:max_new_tokens], None


def test_agreement_counts_the_leading_tokens_equal_to_the_targets():
    target = make_target(seed=3)
    continuations = _continuations(target, count=1, tokens=12)
    ids, continuation = continuations[0]
    assert greedy_agreement(target, continuations, k=4, stride=4) == 4
    for right in (0, 2, 3):
        drafter = FirstTokensRight(continuation, ids.shape[1], right)
        assert greedy_agreement(drafter, continuations, k=4, stride=4) == right
    assert greedy_agreement(noisy_copy(target, 0.6, seed=1), continuations, k=4, stride=4) < 4


def test_profile_row_and_table():
    target = make_target(seed=4)
    continuations = _continuations(target)
    row = profile_level("lookup", PromptLookup(), 0.01, 0.02, prompt(5), continuations, k=4, stride=4)
    assert row.step_seconds == 0 and row.relative_verify_cost == 0
    table = markdown_table([row], k=4)
    assert table.splitlines()[2].startswith("| lookup | 0.0 |")
    assert "greedy agreement (of 4)" in table


def test_levels_table_command_on_tiny_models(tmp_path):
    """The table and its JSON record say the same thing: every candidate measured, agreement of the
    target with itself K of K, every other agreement within 0..K, positive costs for models."""
    import json

    from benchmarks.levels_table import LevelProfile

    table = run_levels_table("tiny", k=3, new_tokens=8, stride=4, repeats=1, out=tmp_path)
    record = json.loads((tmp_path / "levels_tiny.json").read_text())
    rows = [LevelProfile(**row) for row in record["rows"]]
    assert [row.name for row in rows] == ["target", "int8-dynamic copy", "early exit (2 of 4 layers)", "noisy copy",
                                         "PromptLookup(max_ngram=3, num_tokens=8)"]
    assert rows[0].agreement == 3 and all(0 <= row.agreement <= 3 for row in rows)
    assert all(row.step_seconds > 0 and row.verify_seconds > 0 for row in rows[:-1])  # models
    assert rows[-1].step_seconds == 0  # the lookup is counted as free
    assert (tmp_path / "levels_tiny.md").read_text().strip() == table == markdown_table(rows, k=3)
