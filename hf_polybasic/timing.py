"""One way to time work: a clock, injected, and a context manager around the work.

The chain's levels, its model runners and the decode loop read time only through `Clock`; the
default is `time.perf_counter`. Tests inject a simulated clock (`hf_polybasic.testing.SimulatedClock`)
so that schedules that react to timings are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
