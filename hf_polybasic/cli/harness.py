"""The one timing harness of the tools: a ``generate`` call, timed, with its forward passes and memory.

The benchmark, the planner's validation and the demo all time calls with `timed_call`: wall time
with ``time.perf_counter`` around the call only, the target's forward calls (a forward pre-hook;
plain generate makes one per token), and the process's resident memory (RSS) before, after and at
its sampled peak during the call. RSS counts every model loaded in the process. When the target
lives on a CUDA GPU, the clock starts and stops with the GPU's queue drained (`synchronize`: the
work is timed, not its launch) and the GPU's peak allocated memory during the call is recorded too.
"""

from __future__ import annotations

import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..timing import cuda_devices, synchronize

RSS_INTERVAL_S = 0.05


class RssSampler:
    """The process's resident set size (RSS, MiB) before and after a block, and its peak sampled
    every ``interval`` seconds by a background thread while the block runs."""

    def __init__(self, interval: float = RSS_INTERVAL_S):
        self.interval = interval
        self.before = self.after = self.peak = None
        self._stop = threading.Event()
        self._thread = None
        try:
            import psutil

            self._process = psutil.Process()
        except ImportError:  # pragma: no cover - psutil is part of the bench extra
            self._process = None

    def _rss(self) -> float | None:
        return None if self._process is None else self._process.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self.before = self.peak = self._rss()
        if self._process is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.after = self._rss()
        if self.after is not None:
            self.peak = max(self.peak, self.after)


class ForwardCounter:
    """Counts forward calls of a module (a pre-hook), e.g. the target's verification passes."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.count = 0
        self._handle = None

    def _hook(self, module, args) -> None:
        self.count += 1

    def __enter__(self):
        self.count = 0
        self._handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


@dataclass
class Timing:
    """One timed call: its result, wall seconds, the target's forward calls and memory (MiB):
    the process's resident memory, and on a GPU the peak memory allocated by torch during the call
    (``torch.cuda.max_memory_allocated`` over the target's CUDA devices, summed; None on a CPU)."""

    output: Any
    seconds: float
    target_forwards: int | None = None
    rss_before_mib: float | None = None
    rss_after_mib: float | None = None
    rss_peak_mib: float | None = None
    cuda_peak_mib: float | None = None


def timed_call(fn: Callable[[], Any], target: torch.nn.Module | None = None, sample_rss: bool = True,
               count_forwards: bool = True) -> Timing:
    """Call ``fn()`` once, timing it; count ``target``'s forward calls when given (and on a GPU,
    synchronize its devices around the clock and record their peak memory). ``count_forwards=False``
    leaves the target without the counting hook (a hook keeps hf_polybasic from compiling a model:
    our calls count their forwards in their statistics)."""
    rss = RssSampler() if sample_rss else None
    counter = ForwardCounter(target) if target is not None and count_forwards else None
    devices = cuda_devices(target) if target is not None else ()
    synchronize(devices)  # earlier work queued on the GPU is not this call's
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    if rss is not None:
        rss.__enter__()
    if counter is not None:
        counter.__enter__()
    try:
        started = time.perf_counter()
        output = fn()
        synchronize(devices)
        seconds = time.perf_counter() - started
    finally:
        if counter is not None:
            counter.__exit__()
        if rss is not None:
            rss.__exit__()
    return Timing(
        output=output,
        seconds=seconds,
        target_forwards=None if counter is None else counter.count,
        rss_before_mib=None if rss is None else rss.before,
        rss_after_mib=None if rss is None else rss.after,
        rss_peak_mib=None if rss is None else rss.peak,
        cuda_peak_mib=sum(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20 if devices else None,
    )


def median_of(fn: Callable[[], Any], repeats: int, warmup: int = 1, target: torch.nn.Module | None = None) -> Timing:
    """``warmup`` untimed calls, then ``repeats`` timed ones; the last output, the median seconds,
    the highest peak memories."""
    for _ in range(warmup):
        fn()
    timings = [timed_call(fn, target) for _ in range(repeats)]
    peaks = [t.rss_peak_mib for t in timings if t.rss_peak_mib is not None]
    cuda_peaks = [t.cuda_peak_mib for t in timings if t.cuda_peak_mib is not None]
    last = timings[-1]
    return Timing(
        output=last.output,
        seconds=statistics.median(t.seconds for t in timings),
        target_forwards=last.target_forwards,
        rss_before_mib=timings[0].rss_before_mib,
        rss_after_mib=last.rss_after_mib,
        rss_peak_mib=max(peaks) if peaks else None,
        cuda_peak_mib=max(cuda_peaks) if cuda_peaks else None,
    )


def process_peak_rss_mib() -> float:
    """The process's peak RSS so far (getrusage; KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)
