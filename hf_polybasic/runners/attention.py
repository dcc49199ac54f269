"""Which attention kernels the chain's forwards may use on a device, scoped to those forwards.

On recent GPUs torch prefers cuDNN for ``scaled_dot_product_attention``, and cuDNN builds an
execution plan for every new (query length, key length) pair: 23-70 ms of host time each
(`../shared/research/gpu-2026-11.md` §1). A dynamic cache changes the key length at every forward
and a speculative verification the query length at every round, so every forward of ours would
pay it. `attention_for` therefore leaves cuDNN out of the forwards whose shapes change (flash,
memory-efficient and math kernels remain, in torch's order) and leaves torch's choice alone where
the shapes are fixed (a static runner's few widths over a fixed capacity: a plan is built once per
width). Only our own forwards run under it: the user's other code keeps torch's defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def attention_for(device: torch.device | str, fixed_shapes: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory to run one forward under: on a CUDA device with shapes that change,
    `torch.nn.attention.sdpa_kernel` without cuDNN; anywhere else, nothing."""
    if torch.device(device).type != "cuda" or fixed_shapes:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(backends)
