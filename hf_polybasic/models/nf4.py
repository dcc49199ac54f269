"""NF4 linear layers on the CPU through bitsandbytes, for ``quantized_copy(target, "nf4")``.

The paper's middle level is a 4-bit copy of the target: it agrees with the target almost always and
reads a quarter of its bytes, which is what a decoding step mostly pays for. `quantized_copy` makes
it two ways:

* ``"int4"``: int4 weight-only through torch's own int4 kernels (`hf_polybasic.models.int4`: tinygemm on a
  CUDA GPU, its AVX-512/AVX2 twin on the CPU). Nothing to install; it used torchao before, which runs
  the same CPU kernel and is no longer needed.
* ``"nf4"``: **bitsandbytes** (>= 0.50, optional: ``pip install "hf_polybasic[quant4]"``), NF4 (or
  FP4) in blocks of 64 with bf16 activations. This module makes its layers on the CPU: on a CPU
  with AVX512-BF16 a layer's first forward repacks the weight for a fused kernel that takes any
  number of rows (elsewhere it dequantizes each weight per forward, which is slow). On a CUDA GPU
  `quantized_copy` goes through transformers' ``BitsAndBytesConfig`` instead.

Each layer is converted on its own from the source's weight (upcast to bf16 one layer at a time),
so a full-size second copy never exists, and the 4-bit layer holds only tensors of its own. The
output layer (``lm_head``) stays in bf16, as transformers' own 4-bit loading leaves it: rounding
the logits costs agreement where it matters most.
"""

from __future__ import annotations

import importlib.util

import torch

NF4_BLOCK_SIZE = 64
LIBRARIES = {"int4": None, "nf4": "bitsandbytes"}  # what each 4-bit method of quantized_copy needs beyond torch
EXTRA = 'pip install "hf_polybasic[quant4]"'


def available(method: str = "nf4") -> bool:
    """Whether ``quantized_copy(target, method)`` has its library: ``"nf4"`` where bitsandbytes is
    installed; ``"int4"`` always (torch's own kernels)."""
    if method not in LIBRARIES:
        raise ValueError(f"unknown 4-bit method {method!r}; choose one of {tuple(LIBRARIES)}")
    library = LIBRARIES[method]
    return library is None or importlib.util.find_spec(library) is not None


def require(method: str = "nf4") -> None:
    """Raise an ImportError naming the extra unless the library behind ``method`` is installed."""
    if not available(method):
        raise ImportError(f"quantized_copy(method={method!r}) needs {LIBRARIES[method]}: {EXTRA}")


def nf4_linear(linear: torch.nn.Linear, quant_type: str = "nf4") -> torch.nn.Module:
    """bitsandbytes' ``Linear4bit`` with ``linear``'s weights quantized on the CPU (bf16 compute);
    ``linear`` is left as it was."""
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
