"""NF4 copies of the target on the CPU through bitsandbytes (`hf_polybasic.models.nf4`): independent
of their source, exact in a chain, and agreeing with the target. Skipped where bitsandbytes (the
``hf_polybasic[quant4]`` extra) is not installed; its absence is a clear error. int4 copies run on
torch's own kernels, with nothing to install: tests/test_int4.py."""

import sys

import pytest
import torch
from helpers import assert_every_level_took_part
from helpers import assert_independent_of_its_source

import hf_polybasic as hp
from hf_polybasic.models import nf4 as four_bit
from hf_polybasic.levels import quantized_copy
from hf_polybasic.testing import make_target, noisy_copy, prompt

needs_bitsandbytes = pytest.mark.skipif(not four_bit.available("nf4"), reason="nf4: bitsandbytes not installed")


def _target(seed=61, **extra):
    # a tiny model of width 128: whole blocks of 64 inputs and 32 outputs, as the fused CPU kernel takes them
    return make_target("qwen2", seed=seed, hidden_size=128, intermediate_size=256, **extra)


@needs_bitsandbytes
@pytest.mark.parametrize("tied", [False, True])
def test_an_nf4_copy_is_independent_of_its_source(tied):
    target = _target(tied=tied)
    ids = prompt(6, seed=1)
    before = target(ids).logits
    copy = quantized_copy(target, "nf4")
    assert torch.equal(target(ids).logits, before)  # the source is as it was
    assert {p.dtype for p in target.parameters()} == {torch.float32}
    linear = [name for name, m in target.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"]
    assert all(isinstance(copy.get_submodule(name), four_bit.nf4_linear_type()) for name in linear)
    assert type(copy.lm_head) is torch.nn.Linear and copy.lm_head.weight.dtype == torch.bfloat16
    assert_independent_of_its_source(copy, target, ids)


@needs_bitsandbytes
def test_an_nf4_copy_agrees_with_its_target_most_of_the_time():
    target = _target(seed=62)
    ids = prompt(32, seed=2)
    copy = quantized_copy(target, "nf4")
    agreement = float((copy(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean())
    noisy = noisy_copy(target, 0.4, seed=3)
    assert agreement > 0.7
    assert agreement > float((noisy(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean())


@needs_bitsandbytes
@pytest.mark.parametrize("do_sample", [False, True])
def test_chains_through_an_nf4_middle_level_are_exact(do_sample):
    """The paper's shape: target <- nf4 copy <- small drafter; greedy output equals plain
    generate, sampled tokens are ones the target can sample (top_k=3)."""
    from helpers import assert_target_could_sample

    target = _target(seed=63)
    middle, draft = quantized_copy(target, "nf4"), noisy_copy(target, 0.05, seed=4)
    ids = prompt(6, seed=3)
    options = dict(do_sample=do_sample, max_new_tokens=30, eos_token_id=None)
    if do_sample:
        options["top_k"] = 3
    torch.manual_seed(0)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[middle, draft],
                          polybasic_config=hp.PolybasicConfig(schedule="constant"), return_dict_in_generate=True,
                          **options)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
    if do_sample:
        assert_target_could_sample(target, out.sequences, ids.shape[1], top_k=3)
    else:
        assert torch.equal(out.sequences, target.generate(ids, **options))


@needs_bitsandbytes
def test_a_cpu_nf4_copy_says_it_is_slow_as_a_middle_level():
    with pytest.warns(UserWarning, match=r"quantized_copy\(method='nf4'\) on the CPU.*0.6x plain generate") as caught:
        quantized_copy(_target(), "nf4")
    assert caught[0].filename == __file__  # said at the caller's line


def test_a_missing_bitsandbytes_is_a_clear_error_and_int4_needs_no_library(monkeypatch):
    for name in ("bitsandbytes", "torchao"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: find_spec gives None, import raises
    assert not four_bit.available("nf4") and four_bit.available("int4")
    with pytest.raises(ValueError, match="unknown 4-bit method 'int3'"):
        four_bit.available("int3")
    target = _target(seed=64)
    message = r"""^quantized_copy\(method='nf4'\) needs bitsandbytes: pip install "hf_polybasic\[quant4\]"$"""
    with pytest.raises(ImportError, match=message):
        quantized_copy(target, "nf4")
    with pytest.warns(UserWarning, match=r"quantized_copy\(method='int4'\) on the CPU"):
        assert any(type(m).__name__ == "Int4Linear" for m in quantized_copy(target, "int4").modules())


@needs_bitsandbytes
def test_the_planner_can_place_a_4_bit_copy_of_the_target():
    from hf_polybasic.cli.model_sets import build_pool

    pool = build_pool("tiny", early_exit_layers=0, four_bit=("nf4",))
    copy = pool.candidates["tiny-mid-nf4"]
    assert "Linear4bit" in {type(m).__name__ for m in copy.modules()}
    measured = hp.profile(pool.target, pool.candidates, pool.tokenizer, [prompt(8, seed=3)], do_sample=False,
                          max_new_tokens=8, repeats=1, progress=False, generate_kwargs=pool.generate_options)
    assert "tiny-mid-nf4" in measured.order
    the_plan = hp.plan(measured)
    assert any("tiny-mid-nf4" in prediction.chain for prediction in the_plan.ranking)
    with pytest.raises(ValueError, match="--four-bit takes 'nf4' or 'int4'"):
        build_pool("tiny", four_bit=("int3",))
