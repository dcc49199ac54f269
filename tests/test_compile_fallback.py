"""A compiled forward that fails never fails the call (issue 45, `hf_polybasic.runners.fallback`).

Each failure a GPU may meet is injected into the compiled path on the CPU
(`helpers.inject_compile_failure`: an error while the backend compiles, at a CUDA graph's capture, at
its first replay, dynamo's recompile limit): the call's output is plain `generate`'s, exactly one
warning names each model that failed and the cause, and `polybasic_stats` says which runner each
model ended on. With the fallback switched off the same failure reaches the user, so the tests do
reach it. Compiled forwards trace with dynamo's eager backend (conftest.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import COMPILE_FAILURES, assert_every_level_took_part, inject_compile_failure, left_padded
from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit

import hf_polybasic as hp
from hf_polybasic.runners import fallback, static
from hf_polybasic.runners.static import StaticRunner, capacity_for
from hf_polybasic.testing import PAD, make_target, prompt, tiny_chain

NEW_TOKENS = 24
# (rows, levels) of a call, and the level whose compiled forwards fail: the target of two, the middle of three
SHAPES = {"one row, 2 levels": (1, 2, 0), "ragged batch, 3 levels": (3, 3, 1), "one row, 3 levels": (1, 3, 1),
          "ragged batch, 2 levels": (3, 2, 0)}
# the default run: each failure once, each shape once (the other pairs are slow)
PAIRS = [("compile", "one row, 2 levels"), ("capture", "ragged batch, 3 levels"), ("first replay", "ragged batch, 2 levels"),
         ("recompile limit", "one row, 3 levels")]
OTHER_PAIRS = [(failure, shape) for failure in COMPILE_FAILURES for shape in SHAPES if (failure, shape) not in PAIRS]
# what reaches the user of each failure without the fallback
RAISED = {"compile": BackendCompilerFailed, "capture": RuntimeError, "first replay": RuntimeError,
          "recompile limit": FailOnRecompileLimitHit}


def _inputs(rows: int, seed: int) -> dict:
    if rows == 1:
        return {"inputs": prompt(7, seed=seed)}
    ids, mask = left_padded([prompt(4 + 3 * row, seed=seed + row)[0] for row in range(rows)])
    return {"inputs": ids, "attention_mask": mask, "pad_token_id": PAD}


def _decode(models, inputs: dict):
    target, *assistants = models
    config = hp.PolybasicConfig(compile=True, schedule="constant", num_draft_tokens=3, block_threshold=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=assistants, do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, return_dict_in_generate=True,
                              polybasic_config=config)
    said = [str(w.message) for w in caught if "a compiled forward of" in str(w.message)]
    return out, said


def _plain(target, inputs: dict) -> torch.Tensor:
    return target.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)


def _check(failure: str, shape: tuple, monkeypatch) -> None:
    rows, depth, victim = shape
    models = tiny_chain("llama", depth=depth, seed=7)  # fresh models: a failure is remembered per model
    inject_compile_failure(monkeypatch, failure, models[victim])
    inputs = _inputs(rows, seed=60)
    out, said = _decode(models, inputs)
    assert torch.equal(out.sequences, _plain(models[0], inputs))
    stats = out.polybasic_stats
    assert_every_level_took_part(stats, rejections=False)
    if failure == "recompile limit":  # dynamo's limit, one graph per forward: met by every model's second width
        failed = [index for index, level in enumerate(stats.levels) if len(level.forward_widths) > 1]
    else:
        failed = [victim]
    assert failed, "no model met the injected failure"
    assert [level.runner for level in stats.levels] == [
        "static, compile failed" if index in failed else "static, compiled" for index in range(depth)]
    # one warning per model that failed, naming it (its role and level) and the cause
    cause = "FailOnRecompileLimitHit" if failure == "recompile limit" else "injected"
    assert len(said) == len(failed), said
    for index in failed:
        role = "target M1" if index == 0 else f"assistant_models[{index - 1}] (M{index + 1}"
        assert len([message for message in said if f"a compiled forward of {role}" in message and cause in message]) == 1


@pytest.mark.parametrize("failure, shape", PAIRS)
def test_a_failed_compile_falls_back_exactly_with_one_warning(failure, shape, monkeypatch):
    _check(failure, SHAPES[shape], monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("failure, shape", OTHER_PAIRS)
def test_a_failed_compile_falls_back_exactly_in_every_other_shape(failure, shape, monkeypatch):
    _check(failure, SHAPES[shape], monkeypatch)


@pytest.mark.parametrize("failure", COMPILE_FAILURES)
def test_negative_control_without_the_fallback_the_failure_reaches_the_user(failure, monkeypatch):
    """The same injection with the fallback switched off: the user gets the error (so the tests above
    reach the failure, and the fallback is what keeps it from the user)."""

    def no_fallback(self, error, *inputs):
        raise error

    monkeypatch.setattr(StaticRunner, "_fall_back", no_fallback)
    models = tiny_chain("llama", depth=2, seed=7)
    inject_compile_failure(monkeypatch, failure, models[0])
    with pytest.raises(RAISED[failure]) as raised:
        _decode(models, _inputs(1, seed=60))
    assert ("injected" in str(raised.value)) != (failure == "recompile limit")


def test_a_later_call_runs_the_model_uncompiled_and_says_nothing_again(monkeypatch):
    """Once failed, a model's forwards run uncompiled for the rest of the process: a later call (another
    prompt length) makes no graph of it, warns no more, and says its runner; other models stay compiled."""
    from torch._dynamo.utils import counters

    models = tiny_chain("llama", depth=2, seed=8)
    inject_compile_failure(monkeypatch, "compile", models[0])
    first, said = _decode(models, _inputs(1, seed=61))
    assert len(said) == 1 and first.polybasic_stats.levels[0].runner == "static, compile failed"
    assert fallback.compile_failure(models[0]).startswith("BackendCompilerFailed: backend='failing_backend' raised")
    monkeypatch.setattr(static, "compile_options", lambda device: {"backend": "eager", "dynamic": False})
    inputs = _inputs(1, seed=62) | {"inputs": prompt(11, seed=62)}
    before = counters["stats"]["unique_graphs"]
    out, said = _decode(models, inputs)
    assert said == [] and torch.equal(out.sequences, _plain(models[0], inputs))
    assert [level.runner for level in out.polybasic_stats.levels] == ["static, compile failed", "static, compiled"]
    drafter_widths = set(out.polybasic_stats.levels[1].forward_widths) - set(first.polybasic_stats.levels[1].forward_widths)
    assert counters["stats"]["unique_graphs"] - before <= len(drafter_widths)  # none of the target's


def test_a_failed_forward_leaves_nothing_a_rerun_would_see(monkeypatch):
    """The runner itself, two rows of different lengths: a compiled run that writes NaN at every slot
    it writes and then raises (the second run of width 8, the second forward of a catch-up wider than
    the widest width, whose first forward ran compiled and moved the rows on) is run again uncompiled,
    and every logit of that call and of every later one (a rollback, more catch-ups) equals a full
    forward's: nothing the failed run wrote is ever seen, no row's length moved for it."""
    from hf_polybasic.runners.dynamic import CachedModel

    target = make_target("llama", seed=9)
    inject_compile_failure(monkeypatch, "capture", target)  # the second run of a width fails
    runner = StaticRunner(target, "target", capacity_for(200), rows=2, compiled=True)
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(3, 90, (200,), generator=generator) for _ in range(2)]
    # each row's length after the step: the prefill; width 8 (its first run); a catch-up of 64 then 8 (fails)
    steps = [(5, 3), (10, 4), (80, 6), (45, 9), (150, 10), (152, 80)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for number, lengths in enumerate(steps):
                if number == 3:
                    runner.rollback_rows({0: 40, 1: 2})
                asked = [min(8, length - 1) if row == 0 else 2 for row, length in enumerate(lengths)]  # across a catch-up
                logits = runner.logits_rows({row: (sequences[row][:length], asked[row]) for row, length in enumerate(lengths)})
                for row, length in enumerate(lengths):
                    full = CachedModel(target, None, role="reference").logits(sequences[row][:length], asked[row])
                    torch.testing.assert_close(logits[row], full, rtol=1e-4, atol=1e-4)
                if number == 1:
                    assert runner.compiled and runner.cache.compiled_widths == {8}
                if number == 2:  # the failure came at the catch-up's second forward
                    assert runner.fallback is not None and runner.cache.compiled_widths == {8, 64}
        assert not runner.compiled and runner.forward_widths[:3] == [8, 64, 8]
        assert len([w for w in caught if "a compiled forward of target" in str(w.message)]) == 1
    finally:
        runner.close()


def test_the_errors_page_quotes_the_warning():
    from pathlib import Path

    model = torch.nn.Linear(1, 1)
    with pytest.warns(UserWarning) as caught:
        cause = fallback.record_failure(model, "ROLE", RuntimeError("CAUSE"))
        assert fallback.record_failure(model, "ROLE", RuntimeError("another")) == cause == "RuntimeError: CAUSE"
    assert len(caught) == 1  # once per model
    quoted = str(caught[0].message).replace("ROLE", "<role>").replace(cause, "<error type>: <message>")
    page = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "errors.md").read_text()
    assert f"UserWarning: {quoted}\n" in page
