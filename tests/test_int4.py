"""Int4 weight-only copies through torch's own int4 kernels (`hf_polybasic.models.int4`): the group
quantization against a reference, the layer against its dequantized weight, a chain through the
copy (exact, agreeing with the target), independence from the target and from torchao and
bitsandbytes (the cost and levels tables measure it without them), compile, clear errors. CUDA
tests are marked and skip without a GPU."""

import sys
import warnings

import pytest
import torch
from helpers import assert_every_level_took_part
from helpers import assert_independent_of_its_source

import hf_polybasic as hp
from hf_polybasic.models import int4
from hf_polybasic.levels import quantized_copy
from hf_polybasic.models.copies import CPU_FOUR_BIT_WARNING
from hf_polybasic.testing import make_target, noisy_copy, prompt

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weight(rows=48, columns=512, seed=0):
    """Rows of different magnitudes and offsets, one with an outlier, one constant group, one all zero."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * torch.logspace(-3, 0, rows).unsqueeze(1)
    weight += torch.linspace(-0.5, 0.5, rows).unsqueeze(1)
    weight[1, 7] = 25.0
    weight[2, :32] = 0.3
    weight[3] = 0.0
    return weight


def _target(seed=71, **extra):
    # every linear layer of the copy takes groups of 128 input features and 16 output features
    return make_target("llama", seed=seed, hidden_size=128, intermediate_size=256, **extra)


def _int4_copy(target, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the CPU copy's warning (tested on its own)
        return quantized_copy(target, "int4", **options)


# ------------------------------------------------------------------------------------ the arithmetic
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_group_quantization_rounds_each_weight_to_the_nearest_code(group_size):
    weight = _weight()
    q = int4.group_quantize(weight, group_size)
    groups = weight.shape[1] // group_size
    assert q.values.dtype == torch.uint8 and q.values.shape == weight.shape and int(q.values.max()) <= 15
    assert q.scales.dtype == q.zeros.dtype == torch.bfloat16 and q.scales.shape == q.zeros.shape == (48, groups)

    # the reference, in float64: each group's range in 15 steps, code 8 at min + 8 steps
    grouped = weight.double().reshape(48, groups, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    expected_scales = ((high - low).clamp(min=1e-6) / 15).to(torch.bfloat16)
    assert torch.equal(q.scales, expected_scales)
    assert torch.equal(q.zeros, (low + 8 * expected_scales.double()).to(torch.bfloat16))

    # every code is the nearest of the 16 values of its group's grid (ties within float error)
    scale, zero = q.scales.double().unsqueeze(-1), q.zeros.double().unsqueeze(-1)
    grid = (torch.arange(16, dtype=torch.float64) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)  # [48, g, 1, 16]
    distances = (grouped.unsqueeze(-1) - grid).abs()
    chosen = distances.gather(-1, q.values.reshape(48, groups, group_size, 1).long()).squeeze(-1)
    assert (chosen <= distances.amin(-1) + 1e-7).all()

    # so the dequantized weight is off by at most half a step (plus bf16's rounding of the zero and scale
    # at the ends of the range), and its values are exactly the grid's
    dequantized = q.dequantize(torch.float64).reshape(48, groups, group_size)
    error = (dequantized - grouped).abs()
    assert torch.allclose(dequantized, grid.squeeze(-2).gather(-1, q.values.reshape(48, groups, group_size).long()))
    assert (error <= scale / 2 + 2**-8 * (zero.abs() + 8 * scale) + 1e-9).all()
    inside = (grouped >= zero - 8 * scale) & (grouped <= zero + 7 * scale)
    assert inside.float().mean() > 0.9 and (error[inside] <= (scale / 2).expand_as(error)[inside] + 1e-9).all()
    # groups that are not constant and whose zero bf16 rounds by less than a quarter step (elsewhere the
    # grid's ends move): their typical error is a quarter of a step (int4's, far above bf16's rounding),
    # and they use the whole range of codes
    regular = (high - low > 1e-5) & (zero.squeeze(-1).abs() * 2**-8 < scale.squeeze(-1) / 4)
    assert regular.float().mean() > 0.5
    assert 0.2 < float((error / scale)[regular].mean()) < 0.3
    codes = q.values.reshape(48, groups, group_size)
    assert (codes.amin(-1)[regular] == 0).all() and (codes.amax(-1)[regular] == 15).all()


def test_group_quantization_leaves_the_weight_alone_and_refuses_what_it_cannot_cut():
    weight = _weight()
    before = weight.clone()
    int4.group_quantize(weight.to(torch.bfloat16), 128)
    int4.group_quantize(weight, 128)
    assert torch.equal(weight, before)
    with pytest.raises(ValueError, match="480 input features cannot be cut in groups of 256"):
        int4.group_quantize(weight[:, :480], 256)
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128, 256\)"):
        int4.group_quantize(weight, 16)
    with pytest.raises(ValueError, match="2-D weight"):
        int4.group_quantize(weight[0], 128)


def test_cuda_layout_helpers():
    """The CUDA kernel's packing takes two codes a byte, the even column in the high nibble
    (int4mm.cu: matrix_to_m16n8k16_Bint4_layout), and 2, 4 or 8 k-tiles of 16 packed together."""
    values = int4.group_quantize(_weight(16, 256), 32).values
    nibbles = int4.cuda_nibbles(values)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (16, 128)
    assert torch.equal(nibbles >> 4, values[:, ::2]) and torch.equal(nibbles & 15, values[:, 1::2])
    assert [int4.inner_k_tiles(k) for k in (1024, 128, 64, 96, 32)] == [8, 8, 4, 2, 2]


# ----------------------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_multiplies_by_its_dequantized_weight(group_size, bias):
    torch.manual_seed(1)
    linear = torch.nn.Linear(512, 96, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_weight(96, 512) * 0.05)
        if bias:
            linear.bias.normal_()
    layer = int4.Int4Linear.from_linear(linear, group_size)
    dequantized = int4.group_quantize(linear.weight, group_size).dequantize()
    for inputs in (torch.randn(2, 5, 512), torch.randn(1, 512, dtype=torch.bfloat16), torch.randn(512)):
        out = layer(inputs)
        assert out.dtype == torch.bfloat16 and out.shape == (*inputs.shape[:-1], 96)
        reference = inputs.to(torch.bfloat16).float() @ dequantized.T
        if bias:
            reference += linear.bias.to(torch.bfloat16).float()
        # bf16 output: within a few of its roundings of the largest value
        assert (out.float() - reference).abs().max() <= 2**-6 * reference.abs().max()
        # and far from the float layer's own output (the quantization shows: this is not a float copy)
        assert (out.float() - linear(inputs.float())).abs().max() > 4 * (out.float() - reference).abs().max()
    assert "groups of" in repr(layer) and layer.kernel == "cpu"


def test_the_layer_holds_none_of_its_source_tensors_and_keeps_its_bias_in_bf16():
    linear = torch.nn.Linear(256, 32, dtype=torch.bfloat16)  # a bias already in bf16 is copied all the same
    layer = int4.Int4Linear.from_linear(linear)
    mine = {t.data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    assert not mine & {linear.weight.data_ptr(), linear.bias.data_ptr()}
    assert layer.bias.dtype == torch.bfloat16 and not layer.bias.requires_grad
    assert set(dict(layer.named_buffers())) == {"packed", "scales_and_zeros"}
    assert layer.scales_and_zeros.shape == (256 // 128, 32, 2)
    before = layer(torch.ones(3, 256))
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
    assert torch.equal(layer(torch.ones(3, 256)), before)


def test_the_layer_compiles():
    linear = torch.nn.Linear(256, 64)
    layer = int4.Int4Linear.from_linear(linear, 64)
    inputs = torch.randn(2, 3, 256)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    assert torch.equal(compiled(inputs), layer(inputs))
    # the graph holds the kernel op (traced through its meta implementation, no graph break)
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    torch.compile(layer, backend=counter, fullgraph=True)(inputs)
    assert counter.frame_count == 1
    assert any(node.target is torch.ops.aten._weight_int4pack_mm_for_cpu.default
               or "int4pack_mm" in str(node.target) for graph in counter.graphs for node in graph.graph.nodes)


# --------------------------------------------------------------------------------------------- errors
def test_shapes_devices_and_options_the_kernels_cannot_take_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"100 -> 64 features: its in_features=100 cannot be cut in groups of 128"):
        int4.Int4Linear.from_linear(torch.nn.Linear(100, 64))
    with pytest.raises(ValueError, match=r"its out_features=40 is not a multiple of 16\. Use method="):
        int4.Int4Linear.from_linear(torch.nn.Linear(128, 40))
    with pytest.raises(ValueError, match=r"Use group_size=32 or method='bf16'"):
        int4.Int4Linear.from_linear(torch.nn.Linear(96, 64))
    for size in (16, 48, 512, True):
        with pytest.raises(ValueError, match="group_size must be one of"):
            int4.Int4Linear.from_linear(torch.nn.Linear(512, 64), size)
    with pytest.raises(ValueError, match="run on the CPU and on CUDA GPUs, not on meta"):
        int4.Int4Linear.from_linear(torch.nn.Linear(128, 64), device="meta")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"compute capability 8.0 or newer.*Tesla T4 has 7.5"):
        int4.check_device("cuda")

    # the copy names the layer it cannot take, before copying anything
    narrow = make_target("llama", seed=72)  # width 32
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn.q_proj'.*cannot be cut in groups of 128"):
        quantized_copy(narrow, "int4")
    with pytest.raises(ValueError, match="group_size is an option of method='int4'"):
        quantized_copy(narrow, "bf16", group_size=64)

    # a layer moved to another kind of device refuses to run there (its packing is the CPU's)
    layer = int4.Int4Linear.from_linear(torch.nn.Linear(128, 64)).to("meta")
    with pytest.raises(RuntimeError, match="packed for the cpu kernel and cannot run on meta"):
        layer(torch.ones(1, 128, device="meta"))


# --------------------------------------------------------------------------------------- the copy
@pytest.mark.parametrize("tied", [False, True])
def test_an_int4_copy_shares_no_tensor_with_its_target(tied):
    target = _target(tied=tied)
    ids = prompt(6, seed=1)
    before = target(ids).logits
    copy = _int4_copy(target)
    assert torch.equal(target(ids).logits, before)  # the target is as it was
    assert {p.dtype for p in target.parameters()} == {torch.float32}
    theirs = {t.data_ptr() for t in [*target.parameters(), *target.buffers()]}
    mine = {t.data_ptr() for t in [*copy.parameters(), *copy.buffers()]}
    assert not theirs & mine
    linear = [m for m in target.modules() if type(m) is torch.nn.Linear]
    assert sum(isinstance(m, int4.Int4Linear) for m in copy.modules()) == len(linear) - 1
    assert type(copy.lm_head) is torch.nn.Linear and copy.lm_head.weight.dtype == torch.bfloat16
    assert {t.dtype for t in copy.parameters() if t.is_floating_point()} == {torch.bfloat16}
    assert_independent_of_its_source(copy, target, ids)


def test_an_int4_copy_needs_neither_torchao_nor_bitsandbytes(monkeypatch):
    for name in [name for name in sys.modules if name.split(".")[0] in ("torchao", "bitsandbytes")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("torchao", "bitsandbytes"):
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao` now raises ImportError
    copy = _int4_copy(_target(seed=73), group_size=64)
    layers = [m for m in copy.modules() if isinstance(m, int4.Int4Linear)]
    assert layers and {m.group_size for m in layers} == {64}
    assert copy(prompt(4)).logits.isfinite().all()


def test_the_cost_and_levels_tables_measure_the_int4_copy_without_torchao(monkeypatch):
    """`hf-polybasic costs` and `levels` list the target's int4 copy with neither torchao nor
    bitsandbytes installed (nf4 needs bitsandbytes: left out), labelled by torch's kernels, and
    their factories build it."""
    from benchmarks import levels_table
    from hf_polybasic.cli import costs_table

    for name in ("torchao", "bitsandbytes"):
        monkeypatch.setitem(sys.modules, name, None)
    target = _target(seed=77)
    monkeypatch.setattr(costs_table.loading, "load", lambda name, dtype=torch.float32, **_: (target, None))
    variants = costs_table.qwen_variants()
    candidates = dict(levels_table.qwen_candidates(target, small=None))
    assert "1.5B int4" in variants and "1.5B nf4" not in variants
    assert [name for name in candidates if "int4" in name or "nf4" in name] == ["1.5B int4 copy (torch int4 kernels)"]
    assert not [name for name in [*variants, *candidates] if "torchao" in name]
    for build in (variants["1.5B int4"], candidates["1.5B int4 copy (torch int4 kernels)"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the CPU copy's warning
            copy = build()
        assert sum(isinstance(m, int4.Int4Linear) for m in copy.modules()) == 7 * target.config.num_hidden_layers


def test_a_cpu_int4_copy_says_it_is_slow_as_a_middle_level():
    with pytest.warns(UserWarning, match=r"quantized_copy\(method='int4'\) on the CPU") as caught:
        quantized_copy(_target(seed=74), "int4")
    assert caught[0].filename == __file__  # said at the caller's line
    assert CPU_FOUR_BIT_WARNING.format(method="int4") in str(caught[0].message)


@pytest.mark.parametrize("compile_", [False, True])
def test_a_chain_through_the_int4_copy_is_greedy_exact_and_the_copy_agrees_with_the_target(compile_):
    """The paper's shape: target <- int4 copy <- small drafter. Greedy output equals plain generate
    (dynamic runner, and compiled static runner: conftest's eager backend), every level took part,
    and the copy predicts the target's tokens far more often than a noisy copy does."""
    target = _target(seed=71)
    middle, draft = _int4_copy(target), noisy_copy(target, 0.05, seed=4)
    ids = prompt(6, seed=3)
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    reference = target.generate(ids, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback from the static runner, no other complaint
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[middle, draft],
                              polybasic_config=hp.PolybasicConfig(schedule="constant", compile=compile_),
                              return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, reference)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)

    # agreement on the target's greedy continuations of 4 prompts (128 positions): a tiny random
    # model has many near-ties, so int4's rounding flips some (0.89 here; a copy with 5 % noise on
    # every weight: 0.90, 20 %: 0.62)
    hits = {"int4": 0, "noisy": 0}
    noisy = noisy_copy(target, 0.2, seed=3)
    with torch.no_grad():
        for seed in range(4):
            sequence = target.generate(prompt(6, seed=seed), **options)
            chosen = target(sequence).logits.argmax(-1)
            hits["int4"] += int((middle(sequence).logits.argmax(-1) == chosen).sum())
            hits["noisy"] += int((noisy(sequence).logits.argmax(-1) == chosen).sum())
    assert hits["int4"] > 0.8 * 4 * 36 and hits["int4"] > hits["noisy"] + 0.1 * 4 * 36


def test_a_sampled_chain_through_the_int4_copy_samples_what_the_target_can():
    """target <- int4 copy <- small drafter, sampling (top_k=3): every level took part and every
    token is one the target itself could sample."""
    from helpers import assert_target_could_sample

    target = _target(seed=78)
    middle, draft = _int4_copy(target), noisy_copy(target, 0.05, seed=4)
    ids = prompt(6, seed=3)
    torch.manual_seed(0)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[middle, draft],
                          polybasic_config=hp.PolybasicConfig(schedule="constant"), return_dict_in_generate=True,
                          do_sample=True, top_k=3, max_new_tokens=30, eos_token_id=None)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
    assert_target_could_sample(target, out.sequences, ids.shape[1], top_k=3)


# -------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("group_size", [32, 128])
def test_cuda_layer_multiplies_by_its_dequantized_weight(group_size):
    torch.manual_seed(2)
    linear = torch.nn.Linear(1024, 384, bias=True, device="cuda")
    layer = int4.Int4Linear.from_linear(linear, group_size)
    assert layer.kernel == "cuda" and layer.packed.dtype == torch.int32 and layer.packed.dim() == 4
    dequantized = int4.group_quantize(linear.weight, group_size).dequantize()
    for rows in (1, 7, 64):
        inputs = torch.randn(rows, 1024, device="cuda")
        reference = inputs.to(torch.bfloat16).float() @ dequantized.T + linear.bias.to(torch.bfloat16).float()
        out = layer(inputs)
        assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert (out.float() - reference).abs().max() <= 2**-6 * reference.abs().max()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    assert torch.equal(compiled(inputs), layer(inputs))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("compile_", ["auto", False])
def test_cuda_chain_through_the_int4_copy_is_greedy_exact(compile_):
    target = _target(seed=76).to("cuda", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on a GPU the copy says nothing about the CPU's kernels
        middle = quantized_copy(target, "int4")
    draft = noisy_copy(_target(seed=76), 0.05, seed=4).to("cuda", torch.bfloat16)
    assert {t.device.type for t in [*middle.parameters(), *middle.buffers()]} == {"cuda"}
    assert all(m.kernel == "cuda" for m in middle.modules() if isinstance(m, int4.Int4Linear))
    ids = prompt(6, seed=3).to("cuda")
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[middle, draft],
                          polybasic_config=hp.PolybasicConfig(schedule="constant", compile=compile_),
                          return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
