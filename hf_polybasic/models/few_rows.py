"""Few-row products on the CPU through the kernel that is faster for them, in a view of the model.

A verification feeds a model 2 to 17 tokens, so each of its linear layers multiplies a few rows by
its weight. torch's ``nn.Linear`` computes ``x @ W.T`` with the rows as the short side of the product,
and on the 2-core AVX2 AMD EPYC of issue 47 (flags avx2 fma) the fp32 1.5B target's forward over 2 to
5 tokens then cost 2 - 3 one-token forwards; computing the very same products as ``(W @ x.T).T``, the
weight's rows as the long side and nothing copied, it cost 1.1 - 1.5 (`hf-polybasic costs --models qwen
--every-width --only "1.5B fp32"`, docs: *Speed on your machine*). The numbers stay exact products,
summed in another order, as packing's are (`hf_polybasic.models.packed`): a k-token forward already
differs from k one-token forwards by rounding, and greedy output through a chain still equals plain
`generate`'s in the benchmarks. Opt-in (`PolybasicConfig.few_row_products`): the default chain through
it was not faster on held-out prompts there.

`few_row_view(model)` gives a `module_view` of ``model`` whose plain ``nn.Linear`` layers are
`FewRowLinear` layers over the same weight tensors, where `transposed_pays` measures that kernel
faster on this machine; else the model itself. The user's model is not changed, and a view holds no
weights of its own. One row (plain decoding, a drafter's step) and more than `MAX_ROWS` rows (a
longer prompt) take ``nn.Linear``'s own kernel, as plain `generate`'s forwards do.
"""

from __future__ import annotations

import functools
import statistics

import torch

from ..timing import timed
from .fingerprint import PerModel
from .modules import view_replacing

__all__ = ["FewRowLinear", "few_row_view", "transposed_pays"]

MAX_ROWS = 64  # rows of a forward that take the transposed kernel: verifications, batches of them
MIN_WEIGHT = 1 << 20  # smaller weights (a tiny model's) are launch-bound: both kernels cost alike
PROBE_ROWS = (4, 16)  # the transposed kernel is taken where it is faster at both
PROBE_REPEATS = 7
PAYS_BELOW = 0.9  # ... by at least this ratio of medians


class FewRowLinear(torch.nn.Module):
    """``nn.Linear`` over the same weight and bias, computing 2 to `MAX_ROWS` rows as ``(W @ x.T).T``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same tensors: nothing copied

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = inputs.reshape(-1, self.in_features)
        if not 2 <= rows.shape[0] <= MAX_ROWS:
            return torch.nn.functional.linear(inputs, self.weight, self.bias)
        products = torch.mm(self.weight, rows.T).T  # [rows, out], the weight's rows as the long side
        if self.bias is not None:
            products = products + self.bias
        return products.contiguous().reshape(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, few rows as (W @ x.T).T"


def _seconds(product) -> float:
    with timed() as span:
        product()
    return span.seconds


@functools.lru_cache(maxsize=None)
def transposed_pays(in_features: int, out_features: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether ``(W @ x.T).T`` beats ``nn.Linear`` on this CPU for a weight of this shape and dtype
    with ``threads`` torch threads: faster by `PAYS_BELOW` at each of `PROBE_ROWS` rows (medians of
    interleaved repeats on a random weight). Measured once per process and shape."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    for count in PROBE_ROWS:
        rows = torch.randn(count, in_features, generator=generator).to(dtype)
        default = lambda: torch.nn.functional.linear(rows, weight)  # noqa: E731
        transposed = lambda: torch.mm(weight, rows.T).T.contiguous()  # noqa: E731
        default(), transposed()  # warm-up: kernels built for this shape
        pairs = [(_seconds(default), _seconds(transposed)) for _ in range(PROBE_REPEATS)]
        if statistics.median(t for _, t in pairs) > PAYS_BELOW * statistics.median(d for d, _ in pairs):
            return False
    return True


def _probed_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's largest plain ``nn.Linear`` on the CPU in fp32 or bf16 but its output layer (a
    vocabulary's rows would make the probe slow: 0.9 GB for Qwen2.5's in fp32), None when it has none
    of at least `MIN_WEIGHT` elements."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not output
              and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, torch.bfloat16)]
    largest = max(layers, key=lambda m: m.weight.numel(), default=None)
    return largest if largest is not None and largest.weight.numel() >= MIN_WEIGHT else None


_views = PerModel()  # model -> its view, or the model itself where none pays


def few_row_view(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or a view of it whose CPU ``nn.Linear`` layers in the probed dtype are `FewRowLinear`
    where `transposed_pays` on its largest one (made once per model, and again once the model has
    changed: `hf_polybasic.models.fingerprint`). The model itself where it has hooks (a view does not
    run them: accelerate's device hooks, a user's counters), no large CPU layer, or the kernel does
    not pay."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return model
    return _views.setdefault(model, lambda: _make_view(model))


def _make_view(model: torch.nn.Module) -> torch.nn.Module:
    probed = _probed_layer(model)
    if probed is None:
        return model
    dtype = probed.weight.dtype
    if not transposed_pays(probed.in_features, probed.out_features, dtype, torch.get_num_threads()):
        return model
    return view_replacing(model, torch.nn.Linear, FewRowLinear,
                          lambda linear: linear.weight.device.type == "cpu" and linear.weight.dtype == dtype)
