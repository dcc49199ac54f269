"""Measuring T(k) of a model on this machine, and what a measured curve belongs to (`cost_key`)."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Sequence

import torch

from ..runners.dynamic import CachedModel
from ..compat import new_dynamic_cache
from .hardware import describe_machine
from ..timing import DEFAULT_CLOCK, Clock, cuda_devices, synchronize, timed
from ..config import MAX_DRAFT_TOKENS
from .curve import CALIBRATION_CONTEXT, CostCurve

# the widths a curve is measured at: a static runner's forwards are padded to a few widths (its shape is
# a step function of k, these points find the steps); a dynamic runner's run the kernels' own paths for
# every row count, and those differ from one k to the next (an unpacked fp32 CPU forward over 3 or 7
# tokens costs 1.45x one over 4 or 8: docs/speed.md), so it is measured at every width a verification
# of the longest proposal takes
MEASURED_TOKENS = (1, 2, 4, 8, 16)
EVERY_TOKEN = tuple(range(1, MAX_DRAFT_TOKENS + 2))


@torch.no_grad()
def forward_cost(
    model: torch.nn.Module, prefix: torch.LongTensor, num_tokens: int, repeats: int = 5, clock: Clock = DEFAULT_CLOCK
) -> float:
    """Median seconds of a forward pass feeding ``num_tokens`` tokens after a cached ``prefix``
    (``[L]`` or ``[1, L]``); one untimed run first warms up."""
    return statistics.median(_forward_times(model, prefix.reshape(-1), num_tokens, repeats, clock))


def _forward_times(
    model, prefix: torch.LongTensor, num_tokens: int, repeats: int, clock: Clock, runner=None, warm: bool = True
) -> list:
    """Seconds of ``repeats`` forwards of ``num_tokens`` tokens after ``prefix`` (after one untimed
    warm-up forward unless ``warm=False``, when one forward is timed). On a GPU each is timed to
    the end of its work (the model's devices are synchronized), not to its kernels' launch."""
    if runner is None:
        runner = CachedModel(model, new_dynamic_cache(model), role="measured model", clock=clock)
        runner.logits(prefix, 1)  # prefill: the cache now holds the prefix
    sequence = torch.cat([prefix, prefix[-1:].repeat(num_tokens)])
    devices = cuda_devices(model)
    times = []
    for _ in range(repeats + 1 if warm else 1):  # the first run warms up and is dropped
        runner.rollback_rows({0: prefix.shape[0]})
        synchronize(devices)
        with timed(clock) as span:
            runner.logits(sequence, num_tokens)
            synchronize(devices)  # ends when the work has run
        times.append(span.seconds)
    return times[1:] if warm else times


def model_description(model: torch.nn.Module) -> dict:
    """What a forward's cost depends on in the model: its shape, dtypes, devices and the kinds of
    its linear layers (a quantized or packed layer costs differently), not its weights' values."""
    text = model.config.get_text_config(decoder=True)
    shape = {
        name: getattr(text, name, None)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim", "sliding_window")
    }
    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) or "Linear" in type(module).__name__:
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
    tensors = list(model.parameters()) + list(model.buffers())
    return {
        "class": type(model).__name__,
        "shape": shape,
        "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors}),
        "devices": sorted({str(t.device) for t in tensors}),
        "linear_kinds": kinds,
    }


def machine_description(model: torch.nn.Module | None = None) -> dict:
    """What a cost depends on besides the model: CPU, the kernels torch picks, threads, versions, and
    the GPUs the model lives on (`hf_polybasic.costs.hardware.describe_machine`)."""
    devices = sorted({t.device for t in model.parameters()}, key=str) if model is not None else ()
    return describe_machine(devices)


def cost_key(model: torch.nn.Module) -> str:
    """A short key for (model shape and kinds, machine): curves are stored under it."""
    text = json.dumps({"model": model_description(model), "machine": machine_description(model)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


RUNNERS = ("dynamic", "static", "compiled")


def measuring_runner(model: torch.nn.Module, runner: str, longest: int, clock: Clock = DEFAULT_CLOCK,
                     capacity: int | None = None):
    """A runner of the kind decoding uses (``runner``: "dynamic" `CachedModel`, "static" or "compiled"
    `StaticRunner`), so that a curve holds what that runner's forwards cost: a static runner's are
    padded to its widths (a step function of k) and a compiled one's run as graphs, on the cache
    (``capacity`` slots, at least what ``longest`` tokens need) and so the graphs decoding then uses."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner == "dynamic":
        return CachedModel(model, new_dynamic_cache(model), role="measured model", clock=clock)
    from ..runners.static import StaticRunner, capacity_for

    return StaticRunner(model, "measured model", max(capacity_for(longest), capacity or 0), clock=clock,
                        compiled=runner == "compiled")


@torch.no_grad()
def measure_curve(
    model: torch.nn.Module,
    tokens: Sequence[int] | None = None,
    context: int = CALIBRATION_CONTEXT,
    repeats: int = 3,
    clock: Clock = DEFAULT_CLOCK,
    runner: str = "dynamic",
    capacity: int | None = None,
) -> CostCurve:
    """Measure T(k) of ``model`` for each k in ``tokens`` (default: `EVERY_TOKEN` through a dynamic
    runner, `MEASURED_TOKENS` through a static one) after ``context`` cached tokens: untimed forwards
    of every size first (weights paged in, kernels built for each shape: one each on a dynamic runner,
    two on a static one), then ``repeats`` timed rounds over all sizes (interleaved, so drift hits
    every size alike); the median of each. ``runner``: the kind of runner the forwards go through
    (`measuring_runner`, with a static runner's ``capacity``). Uses its own cache and changes nothing."""
    if tokens is None:
        tokens = EVERY_TOKEN if runner == "dynamic" else MEASURED_TOKENS
    vocab = model.config.get_text_config(decoder=True).vocab_size
    device = next(model.parameters()).device
    prefix = (torch.arange(context, device=device) * 7919 % max(vocab - 3, 1)) + 3
    kind, runner = runner, measuring_runner(model, runner, context + max(int(k) for k in tokens) + 1, clock, capacity)
    sizes = [int(k) for k in tokens]
    try:
        runner.logits(prefix, 1)
        for k in sizes:  # one untimed forward of every size (a static runner's: its own warm-up run plus one more)
            _forward_times(model, prefix, k, 0 if kind == "dynamic" else 1, clock, runner, warm=kind != "dynamic")
        rounds = [[_forward_times(model, prefix, k, 0, clock, runner, warm=False)[0] for k in sizes]
                  for _ in range(repeats)]
    finally:
        if hasattr(runner, "close"):  # a static runner's cache goes back for decoding, even after an error
            runner.close()
    points = {k: max(statistics.median(r[i] for r in rounds), 1e-9) for i, k in enumerate(sizes)}
    return CostCurve(points, context, {"model": model_description(model), "machine": machine_description(model),
                                       "runner": kind})
