"""4-bit copies of the target on the CPU (torchao int4, bitsandbytes NF4): independent of their
source, exact in a chain, and agreeing with the target. Skipped where the optional libraries
(``hf_polybasic[quant4]``) are not installed."""

import pytest
import torch
from distribution import assert_every_level_took_part

import hf_polybasic as hp
from hf_polybasic import four_bit
from hf_polybasic.levels import quantized_copy
from hf_polybasic.testing import make_target, noisy_copy, prompt

METHODS = [pytest.param(m, marks=pytest.mark.skipif(not four_bit.available(m), reason=f"{m}: library not installed"))
           for m in four_bit.FOUR_BIT_METHODS]


def _target(seed=61, **extra):
    # 4-bit layers quantize groups of 128 input features: a tiny model of width 128
    return make_target("qwen2", seed=seed, hidden_size=128, intermediate_size=256, **extra)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tied", [False, True])
def test_a_4_bit_copy_is_independent_of_its_source(method, tied):
    target = _target(tied=tied)
    ids = prompt(6, seed=1)
    before = target(ids).logits
    copy = quantized_copy(target, method)
    assert torch.equal(target(ids).logits, before)  # the source is as it was
    assert {p.dtype for p in target.parameters()} == {torch.float32}
    kinds = {type(m).__name__ for m in copy.modules()}
    assert ("Int4Linear" if method == "int4" else "Linear4bit") in kinds
    assert type(copy.lm_head) is torch.nn.Linear and copy.lm_head.weight.dtype == torch.bfloat16
    expected = copy(ids).logits
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.zero_()
    target.to(torch.float16)
    assert torch.equal(copy(ids).logits, expected)


@pytest.mark.parametrize("method", METHODS)
def test_a_4_bit_copy_agrees_with_its_target_most_of_the_time(method):
    target = _target(seed=62)
    ids = prompt(32, seed=2)
    copy = quantized_copy(target, method)
    agreement = float((copy(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean())
    noisy = noisy_copy(target, 0.4, seed=3)
    assert agreement > 0.7
    assert agreement > float((noisy(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("do_sample", [False, True])
def test_chains_through_a_4_bit_middle_level_are_exact(method, do_sample):
    """The paper's shape: target <- 4-bit copy <- small drafter; greedy output equals plain
    generate, sampled tokens are ones the target can sample (top_k=3)."""
    from distribution import assert_target_could_sample

    target = _target(seed=63)
    middle, draft = quantized_copy(target, method), noisy_copy(target, 0.05, seed=4)
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


@pytest.mark.parametrize("method", METHODS)
def test_a_cpu_4_bit_copy_says_it_is_slow_as_a_middle_level(method):
    with pytest.warns(UserWarning, match=rf"quantized_copy\(method='{method}'\) on the CPU.*0.6x plain generate"):
        quantized_copy(_target(), method)


def test_missing_libraries_and_bad_shapes_are_clear_errors(monkeypatch):
    target = make_target("qwen2", seed=64)  # width 32: not a multiple of 128
    with pytest.raises(ValueError, match="groups of 128"):  # int4 runs on torch's own kernels: no library needed
        quantized_copy(target, "int4")
    monkeypatch.setattr(four_bit, "available", lambda method: False)
    with pytest.raises(ImportError, match=r'hf_polybasic\[quant4\]'):
        quantized_copy(target, "nf4")


@pytest.mark.skipif(not four_bit.available("nf4"), reason="nf4: bitsandbytes not installed")
def test_the_planner_can_place_a_4_bit_copy_of_the_target():
    from hf_polybasic.tools.model_sets import build_pool

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
