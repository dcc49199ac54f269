"""The machine, as speculative decoding sees it: which kernels run, and what they cost.

Cost ratios measured on one machine do not hold on another (docs: *Speed on your machine*): a CPU
with AVX-512 and bf16 units scores 8 tokens in about the time of one in bf16, a CPU with AVX2
only takes about 8 times as long. `describe_machine` says which kind of machine this is (as torch
sees it: ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` can restrict it), and
`measure_linear` measures what a linear layer of a given shape costs here per dtype and kernel,
for 1 row (a decoding step) and a few rows (a verification), so a dtype can be chosen by
measurement rather than by CPU name.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence

import torch

from .. import compat
from ..timing import DEFAULT_CLOCK, Clock, timed

# CPU flags that decide which kernels torch and oneDNN can use
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
                  "avx_vnni", "avx_ne_convert")
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty where it is not available)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def machine_class() -> str:
    """A short name for the kind of machine torch sees, e.g. "AVX-512 with bf16", "AVX-512 with bf16 and
    AMX" (oneDNN's bf16 products run on AMX tiles there: a few rows cost about what one does) or "AVX2
    (emulated: ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU)"."""
    capability = torch.backends.cpu.get_cpu_capability()
    bf16 = compat.onednn_supports(torch.bfloat16)
    restricted = {key: os.environ[key] for key in KERNEL_VARIABLES if key in os.environ}
    flags = cpu_flags()
    name = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(capability, capability)
    if name == "AVX-512":
        name += " with bf16" if bf16 else " without bf16"
        if bf16 and not restricted and "amx_bf16" in flags:
            name += " and AMX"
    elif name == "AVX2":
        name += " (no native bf16)" if not bf16 else " with bf16 conversion"
    if restricted and "avx512f" in flags and capability != "AVX512":
        settings = ", ".join(f"{key}={value}" for key, value in restricted.items())
        name += f" (emulated on an AVX-512 CPU: {settings})"
    return name


def gpu_names(devices: Sequence[torch.device | str] = ()) -> list[str] | None:
    """The names of the CUDA devices among ``devices`` (of a model, not torch's current device),
    None when there are none."""
    cuda = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str)
    if not cuda:
        return None
    return [f"{device}: {torch.cuda.get_device_name(device)}" for device in cuda]


def describe_machine(devices: Sequence[torch.device | str] = ()) -> dict:
    """What the costs depend on: CPU, its relevant flags, what torch and oneDNN use of them, threads,
    and the GPUs among ``devices`` (the ones a model lives on)."""
    flags = cpu_flags()
    return {
        "cpu": cpu_name(),
        "class": machine_class(),
        "cpu_flags": sorted(flag for flag in RELEVANT_FLAGS if flag in flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": compat.onednn_supports(torch.bfloat16),
        "kernel_variables": {key: os.environ[key] for key in KERNEL_VARIABLES if key in os.environ},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": gpu_names(devices),
    }


@torch.no_grad()
def measure_linear(
    in_features: int,
    out_features: int,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    rows: Sequence[int] = (1, 8),
    repeats: int = 7,
    clock: Clock = DEFAULT_CLOCK,
) -> dict[str, dict[int, float]]:
    """Median seconds of one ``[rows, in] @ [in, out]`` product per (dtype, kernel): ``"fp32"``,
    ``"bf16"`` (torch's default kernels) and, where oneDNN supports the dtype, ``"fp32 packed"`` /
    ``"bf16 packed"`` (`hf_polybasic.models.packed`), timed with ``clock``. A second or so for a layer of a
    1.5B model."""
    from ..models.packed import PackedLinear

    results: dict[str, dict[int, float]] = {}
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        layer = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
        torch.nn.init.normal_(layer.weight, std=0.02, generator=generator)
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        variants = {short: layer}
        if compat.onednn_supports(dtype):
            variants[f"{short} packed"] = PackedLinear(layer)
        for name, module in variants.items():
            results[name] = {}
            for count in rows:
                x = torch.randn(count, in_features, generator=generator).to(dtype)
                module(x)  # warm-up: kernels built for this shape
                times = []
                for _ in range(repeats):
                    with timed(clock) as span:
                        module(x)
                    times.append(span.seconds)
                results[name][int(count)] = statistics.median(times)
    return results
