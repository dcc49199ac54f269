"""One way to time work: a clock, injected, and a context manager around the work.

The chain's levels, its model runners and the decode loop read time only through `Clock`; the
default is `time.perf_counter`. Tests inject a simulated clock (`hf_polybasic.testing.SimulatedClock`)
so that schedules that react to timings are deterministic.

On a GPU, work is queued and the clock would read when it was launched, not when it ran: a model
runner's forwards are timed by CUDA events read once they have run (`ForwardTimer`, which never
makes a forward wait), and a measurement ends with `synchronize` on the devices its model lives on
(`cuda_devices`).
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


class DeviceSpan:
    """The device's time for the work queued between `start` and `stop`, known once that work has
    run, without waiting for it: a pair of CUDA events on a GPU (under the default clock); elsewhere
    the work ran while the host waited, and the host's own span is it."""

    def __init__(self, device: torch.device | str, clock: Clock = DEFAULT_CLOCK):
        self.events = torch.device(device).type == "cuda" and clock is DEFAULT_CLOCK
        self._marks: list = []

    def start(self) -> None:
        self._record()

    def stop(self) -> None:
        self._record()

    def _record(self) -> None:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)

    def seconds(self, host_seconds: float) -> float:
        """The span's seconds on the device (call once its work has run), at least ``host_seconds``
        (the host's own span of launching it)."""
        if not self.events or len(self._marks) < 2:
            return host_seconds
        return max(host_seconds, self._marks[0].elapsed_time(self._marks[-1]) / 1000.0)


class ForwardTimer:
    """Times forwards for a cost observer (``observe(tokens, seconds, rows)``) without making them wait.

    On the CPU (or under an injected clock) a forward is timed by the clock around it. On a GPU a
    pair of CUDA events brackets it, and the seconds are read once the events have run (at a later
    forward, by then the round's decision has been read back anyway): the host keeps queueing work.
    """

    def __init__(self, device: torch.device, clock: Clock = DEFAULT_CLOCK, devices: tuple[torch.device, ...] = ()):
        self.clock = clock
        # events time one device's queue; a model split over several GPUs is synchronized instead
        self.events = torch.device(device).type == "cuda" and clock is DEFAULT_CLOCK and len(devices) <= 1
        self.devices = devices
        self._started: float | torch.cuda.Event | None = None
        self._pending: list[tuple] = []  # (start event, end event, tokens, rows), oldest first

    def start(self) -> None:
        if self.events:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = self.clock()

    def stop(self, tokens: int, rows: int, observer) -> None:
        """The forward started last has been launched; its cost goes to ``observer`` (None: nobody asks)."""
        if observer is None:
            return
        if not self.events:
            synchronize(self.devices)  # on GPUs, time the work, not its launch
            observer.observe(tokens, self.clock() - self._started, rows=rows)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._started, end, tokens, rows))
        self.flush(observer)

    def flush(self, observer, wait: bool = False) -> None:
        """Report every forward whose events have run (all of them with ``wait``)."""
        while self._pending and (wait or self._pending[0][1].query()):
            start, end, tokens, rows = self._pending.pop(0)
            if wait:
                end.synchronize()
            observer.observe(tokens, start.elapsed_time(end) / 1000.0, rows=rows)
