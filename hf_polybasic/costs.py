"""What a forward pass costs on this machine: measured, as a function of the tokens it scores.

A forward pass that scores k new tokens against a warm cache costs T(k) seconds. Speculative
decoding assumes T(k) is about T(1) for small k, which holds on GPUs and on CPUs with fast small
matrix products but not everywhere (an fp32 or emulated-bf16 forward can cost several times a
step at k = 8), so costs are measured, never assumed.

* `forward_cost`: the median seconds of one forward of k tokens after a cached prefix;
* `nondecreasing`, `interpolate_cost`: a cost curve from measured points (isotonic, then linear).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch

from .cache import CachedModel
from .compat import new_dynamic_cache
from .timing import DEFAULT_CLOCK, Clock, timed


def _synchronize(model: torch.nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def forward_cost(
    model: torch.nn.Module, prefix: torch.LongTensor, num_tokens: int, repeats: int = 5, clock: Clock = DEFAULT_CLOCK
) -> float:
    """Median seconds of a forward pass feeding ``num_tokens`` tokens after a cached ``prefix``
    (``[L]`` or ``[1, L]``); one untimed run first warms up."""
    prefix = prefix.reshape(-1)
    runner = CachedModel(model, new_dynamic_cache(model), role="profiled model", clock=clock)
    runner.logits(prefix, 1)  # prefill: the cache now holds the prefix
    sequence = torch.cat([prefix, prefix[-1:].repeat(num_tokens)])
    times = []
    for _ in range(repeats + 1):
        runner.rollback_to(prefix.shape[0])
        _synchronize(model)
        with timed(clock) as span:
            runner.logits(sequence, num_tokens)
            _synchronize(model)  # on a GPU, time the forward pass, not just its kernel launches
        times.append(span.seconds)
    return statistics.median(times[1:])


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares nondecreasing fit of ``values`` (isotonic regression, pool adjacent violators).

    Forward costs grow with the tokens fed; a measured decrease is noise, which this spreads over
    its neighbours instead of letting it make a longer forward look cheaper.
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def interpolate_cost(points: Mapping[int, float], k: float) -> float:
    """Seconds of a forward feeding ``k`` tokens from measured ``{tokens: seconds}`` points.

    The points are first made nondecreasing in tokens (`nondecreasing`); then linear in k between
    them, extrapolated from the last two beyond the last (and from the first two below the first);
    one point is a constant.
    """
    if not points:
        raise ValueError("interpolate_cost needs at least one measured (tokens, seconds) point")
    ks = sorted(points)
    ys = nondecreasing([points[x] for x in ks])
    if len(ks) == 1:
        return float(ys[0])
    upper = next((i for i, x in enumerate(ks) if x >= k), len(ks) - 1)
    upper = min(max(upper, 1), len(ks) - 1)
    k0, k1, y0, y1 = ks[upper - 1], ks[upper], ys[upper - 1], ys[upper]
    return float(max(y0 + (y1 - y0) * (k - k0) / (k1 - k0), 0.0))
