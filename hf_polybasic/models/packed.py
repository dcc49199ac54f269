"""Cheaper forward passes on CPU, opt-in: linear layers whose weights are prepacked for oneDNN.

On CPUs, the few-row matrix products of decoding and verification can take slow kernels: on the
machines measured for this package, an fp32 ``nn.Linear`` over 2 to 8 rows cost about twice one
over a single row (the verification of a few drafts then costs several decoding steps), and one
row itself ran well below memory bandwidth. oneDNN's linear with weights reordered once into its
blocked layout runs the same product for 1 to 16 rows in about the time of one row, and faster
than the default kernel even there (docs: *Speed on your machine*).

`pack_linear_layers(model)` swaps every ``nn.Linear`` of ``model`` for a `PackedLinear` holding
only the packed weight (no second copy); `unpack_linear_layers(model)` restores plain
``nn.Linear`` layers with the weights bit for bit. Nothing happens unless you call it. The numbers
stay exact float32 (or bf16) products, summed in another order: outputs agree with the unpacked
model to rounding, as a 1-token and a k-token forward of the same model already do, and greedy
decoding through a chain still equals plain `generate` in the tests. Plain `generate` of a packed
model is faster too; compare speeds on the same (packed or unpacked) model.

Supported: models on the CPU in float32 (any x86 CPU with oneDNN) or bfloat16 (AVX-512 or
AVX-NE-CONVERT CPUs; `supported_dtypes` tells). A packed model cannot be saved or moved to another
device: unpack it first.
"""

from __future__ import annotations

import torch

from ..compat import onednn_linear, onednn_pack_weight, onednn_supports
from .modules import replace_modules

__all__ = ["PackedLinear", "pack_linear_layers", "supported_dtypes", "unpack_linear_layers"]

# a packed layer must reproduce the plain one to this tolerance on a random input, else packing refuses
SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def supported_dtypes() -> list[torch.dtype]:
    """The weight dtypes `pack_linear_layers` can pack on this machine."""
    return [dtype for dtype in (torch.float32, torch.bfloat16) if onednn_supports(dtype)]


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s product with the weight kept only in oneDNN's packed layout."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = onednn_pack_weight(linear.weight)  # a plain attribute: not in the state dict
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, self.in_features)
        return onednn_linear(rows, self.packed, self.bias).reshape(*inputs.shape[:-1], self.out_features)

    def unpacked(self) -> torch.nn.Linear:
        """The plain layer again, with the original weight (packing round-trips exactly)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.packed.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, oneDNN packed"


def _check_packable(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        if weight.device.type != "cpu":
            raise ValueError(f"pack_linear_layers: {name} is on {weight.device}; packing is for models on the CPU")
        if not onednn_supports(weight.dtype):
            raise ValueError(
                f"pack_linear_layers: {name} has {weight.dtype} weights, which this machine cannot pack "
                f"(supported here: {supported_dtypes() or 'none: torch has no oneDNN'}); cast the model to one "
                "of them or leave it unpacked"
            )


def _self_check(linear: torch.nn.Linear, packed: PackedLinear) -> None:
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(3, linear.in_features, generator=generator).to(linear.weight.dtype)
    expected, got = linear(probe).float(), packed(probe).float()
    error = float((expected - got).abs().max() / expected.abs().max().clamp_min(1e-6))
    if error > SELF_CHECK_TOLERANCE[linear.weight.dtype]:
        raise RuntimeError(
            f"pack_linear_layers: oneDNN's packed linear differs from nn.Linear by {error:.2g} (relative) on this "
            f"machine and torch {torch.__version__}; not packing. Please report it."
        )


@torch.no_grad()
def pack_linear_layers(model: torch.nn.Module, after_each=None) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a `PackedLinear`; returns ``model``.

    Raises a `ValueError` naming the layer if one is not on the CPU or in a dtype this machine can
    pack, and a `RuntimeError` if the packed product does not reproduce the plain one. Quantized
    layers and layers already packed are left alone. ``after_each(old_layer)`` runs after each swap
    (e.g. to release the old weight's memory at once).
    """
    _check_packable(model)
    checked: set[tuple] = set()

    def convert(linear: torch.nn.Linear) -> PackedLinear:
        packed = PackedLinear(linear)
        shape = (linear.in_features, linear.out_features, linear.weight.dtype)
        if shape not in checked:
            _self_check(linear, packed)
            checked.add(shape)
        if after_each is not None:
            after_each(linear)
        return packed

    replace_modules(model, torch.nn.Linear, convert)
    return model


@torch.no_grad()
def unpack_linear_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `pack_linear_layers` (in place): plain ``nn.Linear`` layers with the original weights."""
    replace_modules(model, PackedLinear, lambda packed: packed.unpacked())
    return model
