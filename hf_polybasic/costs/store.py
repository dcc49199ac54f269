"""`CostCurves`: the cost curves a process uses, measured once, kept in memory and on disk.

The store never breaks `generate`: a directory it cannot read or write, a file that is not a curve
(torn, foreign, valid JSON of another shape) and two processes writing the same curve all fall back
to measuring (or to memory only) with one warning. Curves are written atomically under a unique
temporary name. Measuring takes ~25 forwards of the model; it holds a lock for that model's key
only, so other models are not blocked. ``HF_POLYBASIC_MEASURE_COSTS=0`` (or
``PolybasicConfig(measure_costs=False)``) skips measuring: a model without a stored curve then
runs with the costs its own forwards show during the call (`hf-polybasic costs` measures ahead).

A compiled runner's curve is measured without compiling: a graph per measured width would compile
widths decoding may never use (each an inductor compile and a CUDA graph capture), so its points are
first the same runner's forwards uncompiled (the same cache, the same padded widths: the shape of
T(k)), listed in the curve's ``description["uncompiled_points"]``. Decoding then prices compiled
forwards: the call's estimate scales the curve by what its compiled forwards cost
(`hf_polybasic.costs.CostEstimate`), and at the end of the call each listed point takes what they
showed, in full (`CostCurves.refresh`); a point a compiled forward of its own size priced leaves the list.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..timing import DEFAULT_CLOCK, Clock
from .curve import CostCurve, unslowed
from .estimate import CostEstimate
from .measure import cost_key, measure_curve
from ..user_warnings import warn

# the most a call's observations move a stored point (either way)
MAX_REFRESH_FACTOR = 2.0

log = logging.getLogger("hf_polybasic")

# a compiled runner's points still measured uncompiled (`CostCurves.curve_for`), in its description
UNCOMPILED_POINTS = "uncompiled_points"

# a dynamic runner's curves are kept under this suffix: measured at every width (`measure.EVERY_TOKEN`)
DYNAMIC_KEY = "every-width"

COSTS_DIRECTORY_VARIABLE = "HF_POLYBASIC_COSTS"
MEASURE_VARIABLE = "HF_POLYBASIC_MEASURE_COSTS"


def default_directory() -> Path | None:
    """Where curves are kept: ``$HF_POLYBASIC_COSTS`` (empty: nowhere), else ``~/.cache/hf_polybasic/costs``."""
    value = os.environ.get(COSTS_DIRECTORY_VARIABLE)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    return Path.home() / ".cache" / "hf_polybasic" / "costs"


def measuring_allowed() -> bool:
    """False when ``$HF_POLYBASIC_MEASURE_COSTS`` is 0 / false / no / off."""
    return os.environ.get(MEASURE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


DEFAULT_DIRECTORY = object()  # CostCurves' default: `default_directory()`, read when first needed


class CostCurves:
    """The cost curves of the models a process uses: measured on first use of each (model, machine),
    kept in memory and on disk, refreshed from the forwards of decoding.

    Args:
        directory: where curves are kept as JSON (None: memory only; the default: `default_directory`,
            read when first needed).
        measure: how a missing curve is measured (`hf_polybasic.costs.measure_curve`).
        key: which models share a curve (`cost_key`: models of one architecture, size, dtype and
            kind of layers, on one machine; a simulated machine that charges each model object its
            own cost keys them by object).
    """

    def __init__(
        self,
        directory: Path | str | None | object = DEFAULT_DIRECTORY,
        measure: Callable[..., CostCurve] = measure_curve,
        key: Callable[[torch.nn.Module], str] | None = None,
    ):
        self._directory = directory
        self.measure = measure
        self._key = key or cost_key
        self._curves: dict[str, CostCurve] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()  # held only to look up or add a key's lock
        self._warned: set[str] = set()

    @property
    def directory(self) -> Path | None:
        if self._directory is DEFAULT_DIRECTORY:
            return default_directory()
        return None if self._directory is None else Path(self._directory)

    def _path(self, key: str) -> Path | None:
        directory = self.directory
        return None if directory is None else directory / f"{key}.json"

    def _lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def key_of(self, model: torch.nn.Module, runner: str = "dynamic") -> str:
        """The key a curve is kept under: the model's (`cost_key`) and the runner its forwards go
        through (a static runner's T(k) is a step function of its widths, a compiled one's runs as
        graphs: another curve; a dynamic runner's is measured at every width, `measure.EVERY_TOKEN`,
        so a curve stored by an earlier release at five widths is measured again)."""
        key = self._key(model)
        return f"{key}-{DYNAMIC_KEY}" if runner == "dynamic" else f"{key}-{runner}"

    def curve_for(
        self, model: torch.nn.Module, clock: Clock = DEFAULT_CLOCK, measure: bool = True, runner: str = "dynamic",
        capacity: int | None = None,
    ) -> CostCurve | None:
        """The curve of ``model`` on this machine, through ``runner`` ("dynamic", "static" or
        "compiled": the runner decoding uses, `measure_curve`): from memory, else from disk, else
        measured now (only this key is locked meanwhile; a compiled runner's through the same runner
        uncompiled, its points listed as such: see the module docstring). None when there is none
        and measuring is off (``measure=False`` or ``$HF_POLYBASIC_MEASURE_COSTS=0``). ``capacity``:
        a static runner's slots per row in the call that asks, so the measurement uses its cache."""
        key = self.key_of(model, runner)
        with self._lock(key):
            if key in self._curves:
                return self._curves[key]
            curve = self._load(key)
            if curve is None:
                if not (measure and measuring_allowed()):
                    return None
                log.info("hf_polybasic: measuring the forward costs of %s on this machine", type(model).__name__)
                static = {} if runner == "dynamic" else {"runner": "static", "capacity": capacity}
                curve = self.measure(model, clock=clock, **static)
                if runner == "compiled":  # priced by compiled forwards once decoding makes them
                    curve.description = {**curve.description, "runner": runner, UNCOMPILED_POINTS: sorted(curve.points)}
                self._save(key, curve)
            self._curves[key] = curve
            return curve

    def refresh(self, model: torch.nn.Module, estimate: CostEstimate, runner: str = "dynamic") -> None:
        """Move the stored curve towards what ``estimate`` saw during a call (each point by its
        observed / predicted ratio, weighted by how many forwards the call made, at most a factor
        `MAX_REFRESH_FACTOR` per call), so the next call starts from today's costs.

        The ratios are against the curve's predictions, which come from its points with slowed timings
        replaced (`CostCurve.seconds`, `hf_polybasic.costs.curve.unslowed`); so those are what gets scaled. Scaling
        the raw points instead kept any noisy pair (T(2) above T(4)) in its ratio forever, and call
        after call of a benchmark drove such points to nonsense (a stored T(4) of 7 ns).

        A point still measured uncompiled (``description["uncompiled_points"]``) takes the call's view
        in full, however few forwards it rests on and however far it moves: any compiled forward
        prices a compiled runner better than an uncompiled one. It leaves the list once forwards of
        its own size priced it (`CostEstimate.priced_points`)."""
        if estimate.observed == 0:
            return
        key = self.key_of(model, runner)
        with self._lock(key):
            curve = self._curves.get(key)
            if curve is None or curve is not estimate.curve:
                return
            weight = min(1.0, estimate.observed / 50)
            bound = math.log(MAX_REFRESH_FACTOR)
            uncompiled = set(curve.description.get(UNCOMPILED_POINTS, ()))
            factors = {k: estimate.scale(k) if k in uncompiled else
                       math.exp(min(max(weight * math.log(estimate.scale(k)), -bound), bound)) for k in curve.points}
            if uncompiled:
                curve.description = {**curve.description,
                                     UNCOMPILED_POINTS: sorted(uncompiled - estimate.priced_points())}
            ks = sorted(curve.points)
            smooth = dict(zip(ks, unslowed([curve.points[k] for k in ks])))
            # scaled by their own factors: a point pushed past twice a longer one's is not stored as such
            curve.points = dict(zip(ks, unslowed([smooth[k] * factors[k] for k in ks])))
            curve.observations += estimate.observed
            if uncompiled or max(abs(math.log(f)) for f in factors.values()) > 0.05:
                self._save(key, curve)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warn(message)

    def _load(self, key: str) -> CostCurve | None:
        path = self._path(key)
        if path is None:
            return None
        try:
            if not path.is_file():
                return None
            return CostCurve.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError) as error:  # unreadable, torn or foreign: measure again
            self._warn_once(
                f"read {path.parent}",
                f"hf_polybasic: could not read the cost curve {path} ({error!r}); measuring the forward costs again "
                f"(set {COSTS_DIRECTORY_VARIABLE} to a directory of your own, or to '' to keep curves in memory only)",
            )
            return None

    def _save(self, key: str, curve: CostCurve) -> None:
        path = self._path(key)
        if path is None:
            return
        partial = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{key}.", suffix=".partial",
                                             delete=False) as handle:
                partial = Path(handle.name)
                handle.write(json.dumps(curve.to_dict(), indent=1) + "\n")
            os.replace(partial, path)  # atomic: readers see the old curve or the new one, never a torn file
        except OSError as error:  # a read-only home: curves then live for this process only
            if partial is not None:
                partial.unlink(missing_ok=True)
            self._warn_once(
                f"write {path.parent}",
                f"hf_polybasic: could not store a cost curve in {path.parent} ({error!r}); curves live in memory "
                "for this process only",
            )


DEFAULT_COST_CURVES = CostCurves()
