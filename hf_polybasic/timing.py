"""One way to time work: a clock, injected, and a context manager around the work.

The chain's levels, its model runners and the decode loop read time only through `Clock`; the
default is `time.perf_counter`. Tests inject a simulated clock (`hf_polybasic.testing.SimulatedClock`)
so that schedules that react to timings are deterministic.

On a GPU, work is queued and the clock would read when it was launched, not when it ran: a timed
forward ends with `synchronize` on the devices its model lives on (`cuda_devices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

Clock = Callable[[], float]
DEFAULT_CLOCK: Clock = time.perf_counter


@dataclass
class Span:
    """The seconds a timed block took (set when the block exits)."""

    seconds: float = 0.0


@contextmanager
def timed(clock: Clock = DEFAULT_CLOCK) -> Iterator[Span]:
    """``with timed(clock) as span: ...`` leaves the block's duration in ``span.seconds``."""
    span = Span()
    started = clock()
    try:
        yield span
    finally:
        span.seconds = clock() - started


def cuda_devices(module: torch.nn.Module) -> tuple[torch.device, ...]:
    """The CUDA devices ``module``'s parameters and buffers live on (a model split by ``device_map``
    may use several); empty on the CPU."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()] if t.device.type == "cuda"}
    return tuple(sorted(devices, key=str))


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until the work queued on each of ``devices`` (CUDA) has run."""
    for device in devices:
        torch.cuda.synchronize(device)
