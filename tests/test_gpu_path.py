"""What runs on a GPU, run on one: the static runner compiled by inductor into CUDA graphs (mode
"reduce-overhead"), not the eager backend the rest of the suite traces with (conftest). Skipped
without a CUDA GPU; `make gpu-check` runs them there first (`tools/gpu_check.py`).

They check exactness under graph replay (a graph's output buffer is overwritten by its next
replay), that a second call with another prompt length and budget makes no graph for a width it
has met, and how often the host waits for the GPU in a round, counted by torch itself
(`torch.cuda.set_sync_debug_mode`)."""

from __future__ import annotations

import warnings

import conftest
import pytest
import torch
from torch._dynamo.utils import counters

import hf_polybasic as hp
from hf_polybasic.runners import static
from hf_polybasic.testing import prompt, tiny_chain

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the host waits a call may make besides its rounds': generate's own set-up, the prefill, the
# statistics' last CUDA events, the returned sequences
SYNCS_PER_CALL = 40


@pytest.fixture
def cuda_graphs(monkeypatch):
    """Compiled forwards as a user gets them on a GPU: inductor, CUDA graphs."""
    monkeypatch.setattr(static, "compile_options", conftest.INDUCTOR_COMPILE_OPTIONS)
    assert static.compile_options(torch.device("cuda"))["mode"] == "reduce-overhead"


def _chain(depth: int, seed: int) -> list[torch.nn.Module]:
    return [model.to("cuda") for model in tiny_chain("llama", depth=depth, seed=seed)]


def _generate(target, assistants, ids, new_tokens, config=None, **options):
    return target.generate(ids, custom_generate=hp.generate, assistant_models=assistants, do_sample=False,
                           max_new_tokens=new_tokens, eos_token_id=None, return_dict_in_generate=True,
                           polybasic_config=config or hp.PolybasicConfig(), **options)


def _plain(target, ids, new_tokens):
    return target.generate(ids, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)


def test_cuda_graphs_replay_exactly_and_a_second_call_makes_no_graph_for_a_width_it_met(cuda_graphs):
    target, middle, draft = _chain(3, seed=41)
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=4, block_threshold=6)  # compile="auto"
    seen = [set(), set(), set()]
    for length, budget in [(9, 40), (23, 30), (9, 40)]:  # the third replays the first call's graphs
        ids = prompt(length, seed=length).cuda()
        before = counters["stats"]["unique_graphs"]
        out = _generate(target, [middle, draft], ids, budget, config)
        assert torch.equal(out.sequences, _plain(target, ids, budget))
        levels = out.polybasic_stats.levels
        assert [level.runner for level in levels] == ["static, compiled"] * 3
        assert all(level.drafted > 0 for level in levels[:2])
        new = sum(len(set(level.forward_widths) - known) for level, known in zip(levels, seen))
        assert counters["stats"]["unique_graphs"] - before <= new, "a graph made again for a width already met"
        for level, known in zip(levels, seen):
            known.update(level.forward_widths)


def test_a_batch_under_cuda_graphs_equals_plain_batched_generate(cuda_graphs):
    target, draft = _chain(2, seed=42)
    rows = [prompt(length, seed=length)[0] for length in (5, 9, 3, 7)]
    width = max(row.shape[0] for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, width - row.shape[0]:], mask[index, width - row.shape[0]:] = row, 1
    ids, mask = ids.cuda(), mask.cuda()
    out = _generate(target, [draft], ids, 24, hp.PolybasicConfig(schedule="constant", num_draft_tokens=3),
                    attention_mask=mask, pad_token_id=0)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=None,
                            pad_token_id=0)
    assert torch.equal(out.sequences, plain)
    assert out.polybasic_stats.levels[0].runner == "static, compiled"


def _syncs(target, assistants, ids, new_tokens, config):
    """A warm call (the first compiles and measures the cost curves) and torch's own count of
    synchronizing calls in it (``set_sync_debug_mode("warn")``)."""
    _generate(target, assistants, ids, new_tokens, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = _generate(target, assistants, ids, new_tokens, config)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("config", [hp.PolybasicConfig(), hp.PolybasicConfig(schedule="constant", num_draft_tokens=6)],
                         ids=["default", "constant-k6"])
def test_a_round_waits_for_the_gpu_once(config, cuda_graphs):
    """[drafter]: at most the target's decision (which reads the drafts with it) per round, plus the
    call's own."""
    target, draft = _chain(2, seed=43)
    out, syncs = _syncs(target, [draft], prompt(12, seed=5).cuda(), 48, config)
    rounds = out.polybasic_stats.levels[0].forward_passes
    assert out.polybasic_stats.levels[0].runner == "static, compiled"
    assert len(syncs) <= rounds + SYNCS_PER_CALL, (len(syncs), rounds, sorted(set(syncs))[:5])


@pytest.mark.parametrize("config", [hp.PolybasicConfig(),
                                    hp.PolybasicConfig(schedule="constant", num_draft_tokens=4, block_threshold=8)],
                         ids=["default", "constant-k4-mu8"])
def test_a_three_level_round_waits_for_the_gpu_at_most_twice(config, cuda_graphs):
    """[middle, drafter]: the middle level decides its rounds on the GPU, a batch of them per read
    (`hf_polybasic.decoding.device_blocks`), the target reads its decision once: at most two waits
    per target round, plus the call's own; the output is plain generate's."""
    target, middle, draft = _chain(3, seed=44)
    ids = prompt(12, seed=6).cuda()
    out, syncs = _syncs(target, [middle, draft], ids, 48, config)
    levels = out.polybasic_stats.levels
    assert torch.equal(out.sequences, _plain(target, ids, 48))
    assert [level.runner for level in levels] == ["static, compiled"] * 3
    if config.schedule == "constant":  # the default may rightly let equal-cost tiny models sit out
        assert levels[1].device_rounds > 0
    rounds = levels[0].forward_passes
    assert len(syncs) <= 2 * rounds + SYNCS_PER_CALL, (len(syncs), rounds, sorted(set(syncs))[:5])


@pytest.mark.parametrize("failure", ["capture", "first replay"])
def test_a_graph_that_fails_under_cuda_graphs_falls_back_exactly(failure, cuda_graphs, monkeypatch):
    """A compiled forward of the target that fails after its CUDA graphs ran (issue 45): the forward runs
    again uncompiled on the same cache (graph-managed memory included), every later one too; the output
    is plain generate's, one warning says so, the statistics name the runner."""
    from helpers import inject_compile_failure

    target, draft = _chain(2, seed=47)
    inject_compile_failure(monkeypatch, failure, target)
    ids = prompt(9, seed=9).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(target, [draft], ids, 40, hp.PolybasicConfig(schedule="constant", num_draft_tokens=4))
    assert torch.equal(out.sequences, _plain(target, ids, 40))
    assert len([w for w in caught if "a compiled forward of target" in str(w.message)]) == 1
    assert [level.runner for level in out.polybasic_stats.levels] == ["static, compile failed", "static, compiled"]
