"""The machine-aware pieces: what the machine is, the demo's choice of target kernel, and loading
with little memory (quantizing and packing layer by layer, handing file pages back)."""

import mmap
import warnings

import numpy as np
import pytest
import torch

from hf_polybasic import compat

from hf_polybasic.models import packed as cpu

from hf_polybasic.costs import hardware
from hf_polybasic.levels import quantized_copy
from hf_polybasic.models.copies import quantize_linear_layers
from hf_polybasic.costs import cost_key
from hf_polybasic.testing import SimulatedClock, make_target
from hf_polybasic.cli import pages
from hf_polybasic.cli.real_demo import BF16_TOLERANCE, VERIFY_ROWS, choose_target


def test_curves_measured_under_other_kernels_or_threads_are_never_reused(monkeypatch):
    """The cost key follows what a forward's cost depends on: the same model in the same
    conditions keeps its key; restricting the kernels (an emulated AVX2 run) or another thread
    count gives another key, so a curve measured there is not used here."""
    model = make_target("llama", seed=2)
    key = cost_key(model)
    assert cost_key(make_target("llama", seed=3)) == key  # weights' values do not matter
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware.describe_machine()["kernel_variables"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cost_key(model) != key
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cost_key(model) != key
    finally:
        torch.set_num_threads(threads)
    assert cost_key(model) == key


def test_measure_linear_reports_the_median_cost_of_each_kernel_and_row_count():
    """On a simulated clock that charges each kind of layer its own cost per row, the medians are
    exactly those costs, for every (dtype, kernel) this machine has."""
    clock = SimulatedClock()
    charged = {torch.nn.Linear: 0.001, cpu.PackedLinear: 0.0002}

    def charge(module, args):
        if type(module) in charged:
            dtype_factor = 2 if args[0].dtype == torch.bfloat16 else 1
            clock.advance(charged[type(module)] * dtype_factor * args[0].shape[0])

    handle = torch.nn.modules.module.register_module_forward_pre_hook(charge)
    try:
        costs = hardware.measure_linear(32, 48, rows=(1, 4), repeats=3, clock=clock)
    finally:
        handle.remove()
    expected = {"fp32": 0.001, "bf16": 0.002}
    if compat.onednn_supports(torch.float32):
        expected["fp32 packed"] = 0.0002
    if compat.onednn_supports(torch.bfloat16):
        expected["bf16 packed"] = 0.0004
    assert costs.keys() == expected.keys()
    for name, per_row in expected.items():
        assert costs[name] == {1: pytest.approx(per_row), 4: pytest.approx(4 * per_row)}


def _costs(fp32, bf16, fp32_packed=None, bf16_packed=None):
    """Costs as measure_linear reports them, from (1-row, 8-row) milliseconds."""
    table = {"fp32": fp32, "bf16": bf16, "fp32 packed": fp32_packed, "bf16 packed": bf16_packed}
    return {name: {1: pair[0] / 1000, VERIFY_ROWS: pair[1] / 1000} for name, pair in table.items() if pair}


def test_choose_target_prefers_bf16_only_where_it_is_about_as_fast():
    # AVX-512 with bf16 units: bf16 about as fast, half the memory
    choice = choose_target(_costs(fp32=(2.6, 5.4), bf16=(2.7, 5.5)))
    assert (choice.dtype, choice.pack) == (torch.bfloat16, False)
    # AVX2: a bf16 verification of 8 rows costs ~8 steps; fp32 wins and the reason says why
    choice = choose_target(_costs(fp32=(4.2, 7.9), bf16=(2.0, 16.0)))
    assert (choice.dtype, choice.pack) == (torch.float32, False)
    assert "8.0x a bf16 step" in choice.reason
    # a bf16 step faster than any fp32 one, and a verification near the packed fp32 one, but 8.6 steps of
    # its own (emulated AVX2): no chain pays on it, so fp32
    choice = choose_target(_costs(fp32=(3.76, 7.16), bf16=(0.66, 5.66), fp32_packed=(2.71, 3.35)))
    assert choice.name == "fp32 packed" and "8.6x a bf16 step" in choice.reason
    # just over the tolerance: fp32
    fp32_total = 10.0
    over = fp32_total * BF16_TOLERANCE * 1.01
    assert choose_target(_costs(fp32=(5.0, 5.0), bf16=(over / 2, over / 2))).dtype == torch.float32


def test_choose_target_packs_only_when_packing_is_faster_and_allowed():
    costs = _costs(fp32=(2.6, 5.4), bf16=(2.0, 16.0), fp32_packed=(1.0, 1.0), bf16_packed=(3.0, 3.0))
    choice = choose_target(costs)
    assert (choice.dtype, choice.pack, choice.name) == (torch.float32, True, "fp32 packed")
    assert "packed (oneDNN)" in choice.reason
    unpacked = choose_target(costs, allow_pack=False)
    assert (unpacked.dtype, unpacked.pack) == (torch.float32, False)


def test_int8_copy_built_layer_by_layer_equals_pytorchs_quantize_dynamic(shared_models):
    import copy

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    target = shared_models.target("llama", seed=41, layers=4)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    ours = quantized_copy(target, "int8-dynamic")
    reference = quantize_dynamic(copy.deepcopy(target).float(), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                 dtype=torch.qint8)
    ids = torch.randint(0, target.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    # the source is untouched, and the copy shares none of its tensors
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())
    source_pointers = {p.data_ptr() for p in target.parameters()}
    assert not source_pointers & {p.data_ptr() for p in ours.parameters()}


def test_layer_by_layer_conversions_call_back_once_per_replaced_layer():
    model = make_target(layers=1)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    seen = []
    quantize_linear_layers(model, after_each=seen.append)
    assert sorted(map(id, seen)) == sorted(map(id, linears)) and not any(type(m) is torch.nn.Linear for m in model.modules())
    if compat.onednn_supports(torch.float32):
        packable = make_target(layers=1)
        linears = [m for m in packable.modules() if type(m) is torch.nn.Linear]
        seen = []
        cpu.pack_linear_layers(packable, after_each=seen.append)
        assert sorted(map(id, seen)) == sorted(map(id, linears))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise on Linux only")
def test_release_file_pages_never_touches_anonymous_memory_and_keeps_file_data(tmp_path):
    anonymous = torch.arange(4 * mmap.PAGESIZE, dtype=torch.float32)
    assert not pages.release_file_pages(anonymous)
    assert torch.equal(anonymous, torch.arange(4 * mmap.PAGESIZE, dtype=torch.float32))  # untouched
    path = tmp_path / "weights.bin"
    values = np.arange(8 * mmap.PAGESIZE, dtype=np.float32)
    values.tofile(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory: we only read it
        mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r")[:])
    assert float(mapped.sum()) == float(values.sum())  # pages resident
    assert pages.release_file_pages(mapped)
    assert torch.equal(mapped, torch.from_numpy(values))  # read again from the file, unchanged
    array = np.memmap(path, dtype=np.float32, mode="r")  # a numpy view of a file (a GGUF tensor's data)
    assert float(array.sum()) == float(values.sum())
    assert pages.release_file_pages(array) and np.array_equal(array, values)
    assert not pages.release_file_pages(values)  # anonymous numpy memory is never touched
    assert pages.release_freed_heap() in (True, False)  # glibc's malloc_trim, or nothing


def test_the_costs_command_measures_every_variant_and_writes_its_table(tmp_path):
    from hf_polybasic.cli.main import main
    from hf_polybasic.cli.costs_table import run_costs_table

    text = run_costs_table("tiny", repeats=1, out=str(tmp_path), progress=False)
    rows = [line for line in text.splitlines() if line.startswith("| tiny")]
    from hf_polybasic.models import nf4 as four_bit
    expected = ["| tiny fp32", "| tiny bf16", "| tiny int8-dynamic"] + ["| tiny nf4"] * four_bit.available("nf4")
    assert [row.split(" | ")[0] for row in rows] == expected
    assert "T(16)/T(1)" in text and "Machine:" in text
    written = sorted(path.suffix for path in tmp_path.iterdir())
    assert written == [".json", ".md"]
    assert main(["costs", "--models", "tiny", "--repeats", "1", "--no-progress"]) == 0
    every = run_costs_table("tiny", repeats=1, out=str(tmp_path), progress=False, only=["fp32"], every_width=True)
    assert "| k=3 | k=4 |" in every and "T(17)/T(1)" in every
    assert (tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.endswith("-fp32-every-width.md"))).exists()


@pytest.mark.parametrize("capability, bf16, flags, variables, expected", [
    ("AVX512", True, {"avx512f", "avx512_bf16", "amx_bf16"}, {}, "AVX-512 with bf16 and AMX"),
    ("AVX512", True, {"avx512f", "avx512_bf16"}, {}, "AVX-512 with bf16"),  # an AMD EPYC
    # oneDNN kept off AMX (or anything else restricted): AMX is not claimed
    ("AVX512", True, {"avx512f", "avx512_bf16", "amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
     "AVX-512 with bf16"),
    ("AVX512", False, {"avx512f", "amx_bf16"}, {}, "AVX-512 without bf16"),
    ("AVX2", False, {"avx2"}, {}, "AVX2 (no native bf16)"),
])
def test_the_machine_class_names_amx_where_onednn_may_use_it(monkeypatch, capability, bf16, flags, variables,
                                                             expected):
    for key in hardware.KERNEL_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(hardware.compat, "onednn_supports", lambda dtype: bf16)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    assert hardware.machine_class() == expected
