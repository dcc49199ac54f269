"""Packed linear layers (hf_polybasic.models.packed): opt-in, exact to rounding, fully reversible."""

import pytest
import torch

import hf_polybasic as hp
from hf_polybasic import compat
from hf_polybasic.models import packed as cpu
from hf_polybasic.costs import cost_key
from hf_polybasic.testing import make_chain, make_target, prompt

needs_onednn = pytest.mark.skipif(not compat.onednn_supports(torch.float32), reason="torch without oneDNN")


@needs_onednn
def test_packing_round_trips_bit_for_bit_and_is_opt_in():
    model = make_target("llama", seed=3)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert not any(isinstance(m, cpu.PackedLinear) for m in model.modules())  # nothing until asked
    cpu.pack_linear_layers(model)
    packed = [m for m in model.modules() if isinstance(m, cpu.PackedLinear)]
    assert len(packed) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    cpu.unpack_linear_layers(model)
    assert not any(isinstance(m, cpu.PackedLinear) for m in model.modules())
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


@needs_onednn
def test_packed_outputs_agree_with_the_plain_model_to_rounding():
    model = make_target("qwen2", seed=4)  # qwen2 has biases on q, k, v
    ids = prompt(9, seed=1)
    plain = model(ids).logits
    cpu.pack_linear_layers(model)
    torch.testing.assert_close(model(ids).logits, plain, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_packed_target_in_a_chain_gives_plain_generates_greedy_output(arch):
    target, mid, draft = make_chain(arch, 3, seed=6)
    ids = prompt(6, seed=2)
    options = dict(do_sample=False, max_new_tokens=40, eos_token_id=None)
    reference = target.generate(ids, **options)  # the unpacked model
    cpu.pack_linear_layers(target)
    cpu.pack_linear_layers(draft)
    for config in (hp.PolybasicConfig(schedule="constant"), hp.PolybasicConfig()):
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[mid, draft], polybasic_config=config,
                              **options)
        assert torch.equal(out, reference)
    assert torch.equal(target.generate(ids, **options), reference)


@needs_onednn
def test_packing_twice_changes_nothing_and_the_cost_key_follows_the_kind_of_layers():
    model = make_target("llama", seed=7)
    plain_key = cost_key(model)
    cpu.pack_linear_layers(model)
    packed_key = cost_key(model)
    first = [id(m) for m in model.modules() if isinstance(m, cpu.PackedLinear)]
    cpu.pack_linear_layers(model)
    assert [id(m) for m in model.modules() if isinstance(m, cpu.PackedLinear)] == first
    assert packed_key != plain_key  # a packed model has a cost curve of its own


def test_unsupported_dtypes_are_refused_by_layer_name():
    model = make_target("llama", seed=8).to(torch.float16)
    with pytest.raises(ValueError, match=r"pack_linear_layers: model.layers.0.self_attn.q_proj has torch.float16"):
        cpu.pack_linear_layers(model)
    assert not any(isinstance(m, cpu.PackedLinear) for m in model.modules())  # checked before anything changed


@pytest.mark.skipif(not compat.onednn_supports(torch.bfloat16), reason="no bf16 oneDNN kernels on this CPU")
def test_bf16_models_pack_where_the_cpu_supports_it():
    model = make_target("llama", seed=9).to(torch.bfloat16)
    ids = prompt(5)
    plain = model(ids).logits.float()
    cpu.pack_linear_layers(model)
    torch.testing.assert_close(model(ids).logits.float(), plain, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_dtype_said_to_be_supported_packs_and_round_trips_and_the_others_are_refused(dtype):
    model = make_target("llama", seed=10).to(dtype)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if dtype not in cpu.supported_dtypes():
        with pytest.raises(ValueError, match="cannot pack"):
            cpu.pack_linear_layers(model)
        return
    cpu.pack_linear_layers(model)
    assert any(isinstance(m, cpu.PackedLinear) for m in model.modules())
    cpu.unpack_linear_layers(model)
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
