"""4-bit linear layers on the CPU, through the two maintained libraries that have CPU kernels.

The paper's middle level is a 4-bit copy of the target: it agrees with the target almost always and
reads a quarter of its bytes, which is what a decoding step on a CPU mostly pays for. Two
libraries run 4-bit weights on a CPU (both optional: ``pip install "hf_polybasic[quant4]"``):

* **torchao** (>= 0.18): int4 weight-only, asymmetric per group of 128 input features, bf16
  activations, through ``aten._weight_int4pack_mm_for_cpu`` (AVX-512 and AVX2 kernels; in 0.18
  the CPU layout lives in ``torchao.prototype.quantization.int4``: `Int4OpaqueTensor`). `"int4"`.
* **bitsandbytes** (>= 0.50): NF4 (or FP4) in blocks of 64, bf16 activations; on a CPU with
  AVX512-BF16 its first forward repacks the weight for a fused kernel that takes any number of rows
  (elsewhere it dequantizes each weight per forward, which is slow). `"nf4"`.

Each layer is converted on its own from the source's weight (upcast to bf16 one layer at a time),
so a full-size second copy never exists, and the 4-bit layer holds only tensors of its own. The
output layer (``lm_head``) stays in bf16 by default, as transformers' own 4-bit loading leaves it:
rounding the logits costs agreement where it matters most.
"""

from __future__ import annotations

import importlib.util

import torch

FOUR_BIT_METHODS = ("int4", "nf4")
INT4_GROUP_SIZE = 128
NF4_BLOCK_SIZE = 64
EXTRA = 'pip install "hf_polybasic[quant4]"'


def available(method: str) -> bool:
    """Whether the library behind ``method`` ("int4": torchao, "nf4": bitsandbytes) is installed."""
    return importlib.util.find_spec({"int4": "torchao", "nf4": "bitsandbytes"}[method]) is not None


def require(method: str) -> None:
    """Raise an ImportError naming the extra unless the library behind ``method`` is installed."""
    if not available(method):
        library = {"int4": "torchao", "nf4": "bitsandbytes"}[method]
        raise ImportError(f"quantized_copy(method={method!r}) needs {library}: {EXTRA}")


class Int4Linear(torch.nn.Module):
    """``nn.Linear`` with int4 weights (torchao's CPU layout) and bf16 inputs and outputs."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor

        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.weight = torch.nn.Parameter(Int4OpaqueTensor.from_hp(weight, [1, INT4_GROUP_SIZE]), requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            self.bias = torch.nn.Parameter(linear.bias.detach().to(torch.bfloat16).clone(), requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(inputs.to(torch.bfloat16), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 (torchao, group {INT4_GROUP_SIZE})"


def nf4_linear(linear: torch.nn.Linear, quant_type: str = "nf4") -> torch.nn.Module:
    """bitsandbytes' ``Linear4bit`` with ``linear``'s weights quantized on the CPU (bf16 compute)."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type=quant_type, device="cpu")
    weight = bnb.nn.Params4bit(linear.weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False,
                               quant_type=quant_type, blocksize=NF4_BLOCK_SIZE)
    layer.weight = weight._quantize("cpu")
    if linear.out_features % 32 or linear.in_features % NF4_BLOCK_SIZE:
        # its fused CPU kernel takes blocks of 32 outputs and whole blocks of inputs; dequantize instead
        layer.support_avx512bf16_for_cpu = False
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(torch.bfloat16).clone(), requires_grad=False)
    return layer.eval()


def nf4_linear_type() -> type:
    """bitsandbytes' 4-bit layer class (to tell its layers apart)."""
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


def convert_linear(linear: torch.nn.Linear, method: str) -> torch.nn.Module:
    """One 4-bit layer from ``linear`` (which is left as it was)."""
    require(method)
    if method == "int4":
        if linear.in_features % INT4_GROUP_SIZE:
            raise ValueError(
                f"int4: a layer with {linear.in_features} input features cannot be split in groups of "
                f"{INT4_GROUP_SIZE}; use method='nf4' or 'int8-dynamic' for this model"
            )
        return Int4Linear(linear)
    if method == "nf4":
        return nf4_linear(linear)
    raise ValueError(f"unknown 4-bit method {method!r}; choose one of {FOUR_BIT_METHODS}")
