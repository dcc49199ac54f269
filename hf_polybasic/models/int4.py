"""Int4 weight-only linear layers through torch's own int4 kernels: no torchao, no bitsandbytes.

The paper's middle level is a 4-bit copy of the target. On a GPU a decoding step mostly reads
weights, so a copy holding a quarter of the bytes runs about twice as fast as the bf16 target
and agrees with it on nearly every token. torch ships the kernels for it (the "tinygemm" int4
kernels gpt-fast and torchao use), so this module needs nothing beyond torch:

* CUDA (compute capability 8.0 or newer): ``aten._convert_weight_to_int4pack`` packs the weight
  for the tensor cores, ``aten._weight_int4pack_mm`` multiplies bf16 activations by it.
* CPU: ``aten._convert_weight_to_int4pack_for_cpu`` and ``aten._weight_int4pack_mm_for_cpu``
  (AVX-512 and AVX2 code).

The weights are quantized per group of ``group_size`` input features (128 by default; 32, 64 and
256 too), asymmetrically: each group keeps a bf16 scale and a bf16 zero, and a 4-bit value ``q`` in
0..15 stands for ``(q - 8) * scale + zero`` (the kernels' convention: the zero is the value of the
middle code, a float, not an integer offset). `group_quantize` does the arithmetic (a pure
function, on any device), `Int4Linear` holds the packed weight and runs the kernel of the device it
was packed on. Both kernels have meta implementations, so the layer traces under ``torch.compile``.

The kernels take a layer whose ``out_features`` is a multiple of 16 (the CPU packs blocks of 16
outputs, the GPU of 8) and whose ``in_features`` is a multiple of the group size; anything else is
refused by `check_shape` with the numbers, before any packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_GROUP_SIZE", "GROUP_SIZES", "GroupQuantized", "Int4Linear", "check_device", "check_shape",
           "group_quantize"]

GROUP_SIZES = (32, 64, 128, 256)  # what both kernels take
DEFAULT_GROUP_SIZE = 128
OUT_FEATURES_MULTIPLE = 16  # the CPU packs 16 outputs at a time (CUDA 8): one rule for every device
LEVELS = 16  # 4-bit codes 0..15
MIDDLE = 8  # the code whose value is a group's zero
SCALE_FLOOR = 1e-6  # a constant group still gets a usable scale
KERNEL_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class GroupQuantized:
    """A weight ``[out, in]`` quantized per group of ``group_size`` input features.

    Attributes:
        values: uint8 ``[out, in]``, codes 0..15.
        scales: bf16 ``[out, in // group_size]``.
        zeros: bf16 ``[out, in // group_size]``: the value of code 8.
        group_size: input features per group.
    """

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, ``(q - 8) * scale + zero``, in ``dtype``."""
        rows, columns = self.values.shape
        codes = self.values.float().reshape(rows, columns // self.group_size, self.group_size)
        weight = (codes - MIDDLE) * self.scales.float().unsqueeze(-1) + self.zeros.float().unsqueeze(-1)
        return weight.reshape(rows, columns).to(dtype)


def check_shape(out_features: int, in_features: int, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """A ValueError, with the numbers, for a layer the int4 kernels cannot take."""
    _check_group_size(group_size)
    problems = []
    if in_features % group_size:
        problems.append(f"its in_features={in_features} cannot be cut in groups of {group_size}")
    if out_features % OUT_FEATURES_MULTIPLE:
        problems.append(f"its out_features={out_features} is not a multiple of {OUT_FEATURES_MULTIPLE}")
    if problems:
        fits = [size for size in GROUP_SIZES if in_features % size == 0]
        hint = f"group_size={fits[-1]} or " if fits and not out_features % OUT_FEATURES_MULTIPLE else ""
        raise ValueError(f"int4: torch's int4 kernels cannot take a linear layer of {in_features} -> {out_features} "
                         f"features: {'; '.join(problems)}. Use {hint}method='bf16' or 'int8-dynamic' for this model")


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"int4: group_size must be one of {GROUP_SIZES} (what torch's int4 kernels take), "
                         f"got {group_size!r}")


def check_device(device: torch.device | str) -> None:
    """A ValueError for a device without torch's int4 kernels (CUDA needs compute capability 8.0)."""
    device = torch.device(device)
    if device.type not in KERNEL_DEVICES:
        raise ValueError(f"int4: torch's int4 kernels run on the CPU and on CUDA GPUs, not on {device.type}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"int4: torch's CUDA int4 kernel needs compute capability 8.0 or newer (Ampere); "
                         f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Use method='bf16' or 'nf4'")


@torch.no_grad()
def group_quantize(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> GroupQuantized:
    """Quantize ``weight`` ``[out, in]`` to 4-bit codes per group of ``group_size`` input features:
    each group's range [min, max] is cut in 15 steps (scale = (max - min) / 15, at least 1e-6), its
    zero is min + 8 * scale; scale and zero are rounded to bf16 first and the codes rounded to the
    nearest value of that grid, so every weight inside the range is off by at most half a scale.
    Computed in float32 on ``weight``'s device; ``weight`` is left as it was."""
    if weight.dim() != 2:
        raise ValueError(f"int4: group_quantize takes a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    rows, columns = weight.shape
    _check_group_size(group_size)
    if columns % group_size:
        raise ValueError(f"int4: a weight of {columns} input features cannot be cut in groups of {group_size}")
    groups = weight.detach().float().reshape(rows, columns // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low).clamp(min=SCALE_FLOOR) / (LEVELS - 1)).to(torch.bfloat16)
    zeros = (low + MIDDLE * scales.float()).to(torch.bfloat16)
    scale, zero = scales.float().unsqueeze(-1), zeros.float().unsqueeze(-1)
    codes = ((groups - (zero - MIDDLE * scale)) / scale).round_().clamp_(0, LEVELS - 1)
    return GroupQuantized(codes.to(torch.uint8).reshape(rows, columns), scales, zeros, group_size)


def inner_k_tiles(in_features: int) -> int:
    """How many 16-wide k-tiles the CUDA layout packs together: 8 (the fastest) where
    ``in_features`` allows, else 4 or 2 (a group size divides it, so 2 always does)."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0)


def cuda_nibbles(values: torch.Tensor) -> torch.Tensor:
    """What the CUDA packing takes: two codes a byte, the even column in the high nibble,
    uint8 ``[out, in / 2]``."""
    return (values[:, ::2] << 4 | values[:, 1::2]).contiguous()


def pack(quantized: GroupQuantized, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales and zeros ``[in / group, out, 2]`` bf16) for ``device``'s kernel."""
    device = torch.device(device)
    values = quantized.values.to(device)
    scales_and_zeros = torch.stack([quantized.scales, quantized.zeros], dim=-1).transpose(0, 1).contiguous()
    tiles = inner_k_tiles(values.shape[1])
    if device.type == "cuda":
        packed = torch.ops.aten._convert_weight_to_int4pack(cuda_nibbles(values), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), tiles)
    return packed, scales_and_zeros.to(device)


class Int4Linear(torch.nn.Module):
    """``nn.Linear`` with int4 weights (groups of ``group_size`` input features, bf16 scales and
    zeros) packed for torch's int4 kernel of its device; bf16 inputs and outputs.

    Build it with `Int4Linear.from_linear`. The packed layout belongs to the device it was made on:
    make the layer on the device it will run on (moving it to another kind of device is refused at
    its next forward).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, packed: torch.Tensor,
                 scales_and_zeros: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        check_shape(out_features, in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.kernel = packed.device.type  # the layout's device kind: "cpu" or "cuda"
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = DEFAULT_GROUP_SIZE,
                    device: torch.device | str | None = None) -> Int4Linear:
        """The int4 layer of ``linear`` (left as it was), packed for ``device`` (default: where
        ``linear``'s weight is), holding no tensor of ``linear``'s."""
        device = torch.device(device) if device is not None else linear.weight.device
        check_shape(linear.out_features, linear.in_features, group_size)
        check_device(device)
        packed, scales_and_zeros = pack(group_quantize(linear.weight.to(device), group_size), device)
        bias = None
        if linear.bias is not None:
            bias = linear.bias.detach().to(device=device, dtype=torch.bfloat16, copy=True)
        return cls(linear.in_features, linear.out_features, group_size, packed, scales_and_zeros, bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type != self.kernel:
            raise RuntimeError(
                f"int4: this layer was packed for the {self.kernel} kernel and cannot run on "
                f"{self.packed.device.type}; quantize the model where it will run (quantized_copy of the target "
                f"on that device)")
        leading = inputs.shape[:-1]
        rows = inputs.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.kernel == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size,
                                                              self.scales_and_zeros)
        out = out.reshape(*leading, self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 groups of {self.group_size} ({self.kernel} kernel)")
