"""Few-row products (`hf_polybasic.models.few_rows`): the layer's products, the view (the user's model
untouched, nothing copied), when a chain takes it, and chains through it against plain `generate`."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import hf_polybasic as hp
from hf_polybasic.costs.measure import cost_key
from hf_polybasic.models import few_rows
from hf_polybasic.models.fingerprint import PerModel
from hf_polybasic.models.few_rows import MAX_ROWS, FewRowLinear, few_row_view, transposed_pays
from hf_polybasic.models.modules import view_replacing
from hf_polybasic.testing import make_chain, prompt, tiny_chain

from helpers import ALPHA, PAD, assert_every_level_took_part, assert_rows_as_alone, chi_square_p_value, left_padded, \
    sample_counts


@pytest.fixture
def forced(monkeypatch):
    """Every CPU model takes the view (the probe says it pays, however small its layers), and the
    calls of `FewRowLinear` over several rows are counted."""
    monkeypatch.setattr(few_rows, "MIN_WEIGHT", 0)
    monkeypatch.setattr(few_rows, "_views", PerModel())  # views made here stay here (shared models too)
    monkeypatch.setattr(few_rows, "transposed_pays", lambda *shape: True)
    calls = {"few": 0}
    forward = FewRowLinear.forward

    def counted(self, inputs):
        calls["few"] += int(inputs.reshape(-1, self.in_features).shape[0] >= 2)
        return forward(self, inputs)

    monkeypatch.setattr(FewRowLinear, "forward", counted)
    return calls


@settings(max_examples=25, deadline=None)
@example(rows=MAX_ROWS, bias=True, batch=None, dtype=torch.float32)  # the bounds, each side
@example(rows=MAX_ROWS + 1, bias=False, batch=None, dtype=torch.float32)
@example(rows=2, bias=False, batch=None, dtype=torch.float32)
@example(rows=1, bias=True, batch=None, dtype=torch.float32)
@given(rows=st.integers(1, MAX_ROWS + 3), bias=st.booleans(), batch=st.sampled_from([None, 1, 2]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_products_equal_linear_to_rounding_and_exactly_outside_the_few_rows(rows, bias, batch, dtype):
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(48, 80, bias=bias, dtype=dtype)
    torch.nn.init.normal_(linear.weight, generator=generator)
    shape = (rows, 48) if batch is None else (batch, rows, 48)
    inputs = torch.randn(shape, generator=generator).to(dtype)
    layer = FewRowLinear(linear)
    got, expected = layer(inputs), linear(inputs)
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    total = rows * (batch or 1)
    if 2 <= total <= MAX_ROWS:
        torch.testing.assert_close(got, expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        # the other kernel ran: (W @ x.T).T itself, bit for bit
        assert torch.equal(got.reshape(-1, 80), torch.mm(linear.weight, inputs.reshape(-1, 48).T).T
                           + (linear.bias if bias else 0))
    else:
        assert torch.equal(got, expected)  # one row and a prompt's many: nn.Linear's own kernel


@pytest.mark.parametrize("rows, transposed", [(1, False), (2, True), (MAX_ROWS, True), (MAX_ROWS + 1, False)])
def test_the_transposed_kernel_runs_for_the_few_rows_only(monkeypatch, rows, transposed):
    """The bounds by the kernel called, not by the numbers (which may agree bit for bit at either side)."""
    called = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args: called.append(1) or mm(*args))
    FewRowLinear(torch.nn.Linear(8, 4))(torch.randn(rows, 8))
    assert bool(called) is transposed


def test_the_layer_shares_the_weights():
    linear = torch.nn.Linear(8, 4)
    layer = FewRowLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert "few rows" in repr(layer)


def test_a_view_replaces_only_chosen_layers_and_leaves_the_model_as_it_was():
    target = make_chain("llama", depth=1)[0]
    before = [(name, module, type(module)) for name, module in target.named_modules()]
    weights = {name: p.data_ptr() for name, p in target.named_parameters()}
    view = view_replacing(target, torch.nn.Linear, FewRowLinear, lambda linear: linear.out_features != 16)
    assert [(name, module, type(module)) for name, module in target.named_modules()] == before
    replaced = {name: type(m) for name, m in view.named_modules() if isinstance(m, (FewRowLinear, torch.nn.Linear))}
    assert FewRowLinear in replaced.values()
    for name, module in target.named_modules():
        if type(module) is torch.nn.Linear:
            assert replaced[name] is (torch.nn.Linear if module.out_features == 16 else FewRowLinear), name
    assert {name: p.data_ptr() for name, p in view.named_parameters()} == weights  # nothing copied
    assert view_replacing(target, torch.nn.Linear, FewRowLinear, lambda _: False) is target  # nothing to replace
    ids = prompt(6)
    torch.testing.assert_close(view(ids).logits, target(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_view_is_taken_only_where_it_pays(monkeypatch, forced):
    target = make_chain("llama", depth=1)[0]
    view = few_row_view(target)
    assert view is not target and few_row_view(target) is view  # made once per model
    assert cost_key(view) != cost_key(target)  # its own cost curve: its forwards cost otherwise
    target.to(torch.bfloat16)  # the model changed: a new view, over the new weights
    again = few_row_view(target)
    assert again is not view and again.lm_head.weight is target.lm_head.weight
    hooked = make_chain("llama", depth=1)[0]
    hooked.model.layers[0].register_forward_hook(lambda *args: None)  # a view would not run it
    assert few_row_view(hooked) is hooked
    pre_hooked = make_chain("llama", depth=1)[0]
    pre_hooked.model.layers[0].register_forward_pre_hook(lambda *args: None)  # nor this one
    assert few_row_view(pre_hooked) is pre_hooked
    mixed = make_chain("llama", depth=1)[0]
    mixed.lm_head.to(torch.bfloat16)  # a layer in another dtype than the probed one keeps nn.Linear
    view = few_row_view(mixed)
    assert type(view.lm_head) is torch.nn.Linear
    assert any(type(m) is FewRowLinear for m in view.modules())
    monkeypatch.setattr(few_rows, "transposed_pays", lambda *shape: False)
    fresh = make_chain("llama", depth=1)[0]
    assert few_row_view(fresh) is fresh
    monkeypatch.setattr(few_rows, "transposed_pays", lambda *shape: True)
    monkeypatch.setattr(few_rows, "MIN_WEIGHT", 1 << 20)  # the tests' tiny models: launch-bound, left alone
    tiny = make_chain("llama", depth=1)[0]
    assert few_row_view(tiny) is tiny


def test_the_probe_measures_once_per_shape():
    transposed_pays.cache_clear()
    verdict = transposed_pays(64, 96, torch.float32, 1)
    assert isinstance(verdict, bool)
    assert transposed_pays(64, 96, torch.float32, 1) is verdict
    assert transposed_pays.cache_info().hits == 1


def _slowed(function):
    def slower(*args, **kwargs):
        for _ in range(20):
            function(*args, **kwargs)
        return function(*args, **kwargs)

    return slower


@pytest.mark.parametrize("slowed, pays", [("mm", False), ("linear", True)])
def test_the_probe_follows_the_measured_times(monkeypatch, slowed, pays):
    """Whichever kernel is made 21 times slower (the transposed one calls torch.mm, nn.Linear's
    F.linear), the probe picks the other."""
    transposed_pays.cache_clear()
    if slowed == "mm":
        monkeypatch.setattr(torch, "mm", _slowed(torch.mm))
    else:
        monkeypatch.setattr(torch.nn.functional, "linear", _slowed(torch.nn.functional.linear))
    assert transposed_pays(256, 512, torch.float32, 1) is pays
    transposed_pays.cache_clear()


def test_static_caches_keep_the_models_as_given(forced):
    target, draft = make_chain("llama", depth=2)
    ids = prompt(6)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], do_sample=False,
                          max_new_tokens=10, cache_implementation="static",
                          polybasic_config=hp.PolybasicConfig(few_row_products=True))
    assert forced["few"] == 0
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["llama", "qwen2"]), depth=st.integers(2, 3), seed=st.integers(0, 50),
       lengths=st.lists(st.integers(3, 9), min_size=1, max_size=3))
def test_greedy_chains_through_the_view_equal_plain_generate(forced, arch, depth, seed, lengths):
    forced["few"] = 0  # the fixture is set once for all examples: its counter starts again here
    target, *assistants = make_chain(arch, depth=depth, seed=seed)
    prompts = [prompt(n, seed=seed + row)[0] for row, n in enumerate(lengths)]
    _assert_greedy_rows_through_the_view(forced, target, assistants, prompts, max_new_tokens=12)


def _assert_greedy_rows_through_the_view(forced, target, assistants, prompts, max_new_tokens):
    """A left-padded batch of ``prompts`` through the chain's views: verifications ran through them, every
    level took part, and each row equals plain `generate`'s for it alone."""
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                          polybasic_config=hp.PolybasicConfig(schedule="constant", few_row_products=True),
                          return_dict_in_generate=True, **options)
    assert forced["few"] > 0  # verifications ran through the view
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    assert_rows_as_alone(target, out.sequences, prompts, ids, options)


@pytest.mark.parametrize("arch, attention", [("mistral", "sdpa"), ("gemma2", "eager"), ("mixtral", "sdpa"),
                                             ("llama", "eager"), ("qwen2", "flex_attention")])
def test_greedy_chains_through_the_view_equal_plain_generate_over_attention_kinds(forced, arch, attention):
    """Windowed and alternating attention, experts, eager and flex attention: through the views of
    every model, a batch's greedy rows equal plain `generate`'s for each row alone."""
    forced["few"] = 0
    target, *assistants = tiny_chain(arch, depth=3, seed=5)
    for model in (target, *assistants):
        model.set_attn_implementation(attention)
    prompts = [prompt(n, seed=11 + row)[0] for row, n in enumerate([4, 9])]
    _assert_greedy_rows_through_the_view(forced, target, assistants, prompts, max_new_tokens=14)


@pytest.mark.parametrize("config", [hp.PolybasicConfig(), hp.PolybasicConfig(few_row_products=False)])
def test_without_the_option_no_model_takes_the_view(forced, config):
    """Off by default (and when asked): the models run as given."""
    target, draft = make_chain("llama", depth=2)
    ids = prompt(6)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], do_sample=False,
                          max_new_tokens=10, polybasic_config=config)
    assert forced["few"] == 0
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))
    with pytest.raises(ValueError, match="few_row_products"):
        hp.PolybasicConfig(few_row_products="yes")


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_sampling_through_the_view_follows_the_target(forced, monkeypatch, scale, distribution_models,
                                                      exact_distribution):
    """Sampled through views of the target and both assistants, the outputs follow the target's
    distribution; a view whose products are off (scaled by 1.5: the negative control) is caught."""
    forced["few"] = 0
    counted = FewRowLinear.forward
    monkeypatch.setattr(FewRowLinear, "forward", lambda self, inputs: counted(self, inputs) * scale)
    setting = "temperature+top_k+top_p"
    target, *assistants = distribution_models[:3]
    counts, stats = sample_counts(target, setting, assistants, seed=3, schedule="constant", block_threshold=2,
                                  few_row_products=True)
    assert forced["few"] > 0
    assert_every_level_took_part(stats)
    p_value = chi_square_p_value(counts, exact_distribution(setting))
    assert (p_value > ALPHA) if scale == 1.0 else (p_value < ALPHA)


def test_the_costs_table_lists_the_view_of_the_target(monkeypatch):
    """`hf-polybasic costs` measures the target through the view too, whatever the probe says."""
    from hf_polybasic.cli import costs_table

    target = make_chain("llama", depth=1)[0]
    monkeypatch.setattr(costs_table.loading, "load", lambda name, dtype=torch.float32, **_: (target, None))
    monkeypatch.setattr(few_rows, "transposed_pays", lambda *shape: False)
    view = costs_table.qwen_variants()["1.5B fp32 few-row products"]()
    linears = [type(m) for m in view.modules() if isinstance(m, (torch.nn.Linear, FewRowLinear))]
    assert linears and set(linears) == {FewRowLinear}
    assert all(type(m) is not FewRowLinear for m in target.modules())


def test_the_probe_measures_the_largest_layer_but_the_output_layer(monkeypatch, forced):
    asked = []
    monkeypatch.setattr(few_rows, "transposed_pays", lambda *shape: asked.append(shape) or True)
    target = make_chain("llama", depth=1)[0]
    output = target.get_output_embeddings()
    with torch.no_grad():  # the output layer the largest: a vocabulary's rows
        target.set_output_embeddings(torch.nn.Linear(output.in_features, 4096, bias=False))
    others = [m for m in target.modules() if type(m) is torch.nn.Linear and m is not target.lm_head]
    largest = max(others, key=lambda m: m.weight.numel())
    few_row_view(target)
    assert asked == [(largest.in_features, largest.out_features, torch.float32, torch.get_num_threads())]
    asked.clear()
    other = make_chain("llama", depth=1, seed=1)[0]
    in_float64 = max((m for m in other.modules() if type(m) is torch.nn.Linear and m is not other.lm_head),
                     key=lambda m: m.weight.numel())
    in_float64.to(torch.float64)  # a dtype the kernel is not taken for: not probed
    few_row_view(other)
    assert asked and all(shape[2] == torch.float32 for shape in asked)
