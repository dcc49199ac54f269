"""What a forward pass costs on this machine: measured, as a function of the tokens it scores.

A forward pass that scores k new tokens against a warm cache costs T(k) seconds: a drafting step is
T(1), a verification of k drafts T(k + 1). Speculative decoding assumes T(k) is about T(1) for
small k. That holds on GPUs and on CPUs with fast small matrix products, but not everywhere: on a
CPU without bf16 units a bf16 forward over k tokens costs about k steps, and fp32 products of a
few rows can take a slow kernel (docs: *Speed on your machine*). So costs are measured, never
assumed:

* `CostCurve`: T(k) of one model on one machine, from measured points (isotonic, then linear);
* `measure_curve`: measures one, in a second or a few (forwards of 1, 2, 4, 8 and 16 tokens);
* `CostCurves`: the curves of the models a process uses, measured once per (model, dtype,
  device, threads, machine), kept on disk (``$HF_POLYBASIC_COSTS``, default
  ``~/.cache/hf_polybasic/costs``) and refreshed from the forwards decoding makes;
* `CostEstimate`: T(k) of one model during one call: the curve's shape, its level set by the
  forwards just made (a busy machine scales every cost alike);
* `forward_cost`, `nondecreasing`, `interpolate_cost`: the measuring and fitting primitives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import CachedModel
from .compat import new_dynamic_cache
from .hardware import describe_machine
from .timing import DEFAULT_CLOCK, Clock, timed

log = logging.getLogger("hf_polybasic")

MEASURED_TOKENS = (1, 2, 4, 8, 16)
CALIBRATION_CONTEXT = 64
# forwards feeding more tokens than this (prefills, long catch-ups) do not update an estimate
ONLINE_MAX_TOKENS = 32
# weight of the newest forward in the running scale of an estimate
ONLINE_DECAY = 0.8
COSTS_DIRECTORY_VARIABLE = "HF_POLYBASIC_COSTS"
CURVE_FORMAT = 1


# --- primitives ------------------------------------------------------------------------------------
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
    return statistics.median(_forward_times(model, prefix.reshape(-1), num_tokens, repeats, clock))


def _forward_times(
    model, prefix: torch.LongTensor, num_tokens: int, repeats: int, clock: Clock, runner=None, warm: bool = True
) -> list:
    """Seconds of ``repeats`` forwards of ``num_tokens`` tokens after ``prefix`` (after one untimed
    warm-up forward unless ``warm=False``, when one forward is timed)."""
    if runner is None:
        runner = CachedModel(model, new_dynamic_cache(model), role="measured model", clock=clock)
        runner.logits(prefix, 1)  # prefill: the cache now holds the prefix
    sequence = torch.cat([prefix, prefix[-1:].repeat(num_tokens)])
    times = []
    for _ in range(repeats + 1 if warm else 1):  # the first run warms up and is dropped
        runner.rollback_to(prefix.shape[0])
        _synchronize(model)
        with timed(clock) as span:
            runner.logits(sequence, num_tokens)
            _synchronize(model)  # on a GPU, time the forward pass, not just its kernel launches
        times.append(span.seconds)
    return times[1:] if warm else times


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


# --- what a curve belongs to ---------------------------------------------------------------------
def machine_description() -> dict:
    """What a cost depends on besides the model: CPU, the kernels torch picks, threads, versions
    (`hf_polybasic.hardware.describe_machine`)."""
    return describe_machine()


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


def cost_key(model: torch.nn.Module) -> str:
    """A short key for (model shape and kinds, machine): curves are stored under it."""
    text = json.dumps({"model": model_description(model), "machine": machine_description()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# --- curves ------------------------------------------------------------------------------------------
@dataclass
class CostCurve:
    """T(k): seconds of one forward of a model scoring k new tokens against a warm cache.

    Attributes:
        points: measured ``{k: seconds}``; in between and beyond, `interpolate_cost`.
        context: tokens in the cache when the points were measured.
        description: the model and machine the curve belongs to (for people reading it).
        observations: forwards of decoding that refreshed the points since they were measured.
    """

    points: dict[int, float]
    context: int = CALIBRATION_CONTEXT
    description: dict = field(default_factory=dict)
    observations: int = 0

    def seconds(self, k: float) -> float:
        return interpolate_cost(self.points, k)

    def ratio(self, k: float) -> float:
        """T(k) / T(1): what scoring k tokens costs in steps."""
        return self.seconds(k) / max(self.seconds(1), 1e-12)

    def to_dict(self) -> dict:
        return {
            "format": CURVE_FORMAT,
            "points": {str(k): v for k, v in sorted(self.points.items())},
            "context": self.context,
            "description": self.description,
            "observations": self.observations,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> CostCurve:
        if data.get("format") != CURVE_FORMAT:
            raise ValueError(f"not a cost curve of format {CURVE_FORMAT}")
        points = {int(k): float(v) for k, v in data["points"].items()}
        if not points or any(k < 1 or not v > 0 for k, v in points.items()):
            raise ValueError(f"a cost curve needs seconds > 0 for k >= 1 tokens, got {points}")
        return cls(points, int(data.get("context", CALIBRATION_CONTEXT)), dict(data.get("description", {})),
                   int(data.get("observations", 0)))


@torch.no_grad()
def measure_curve(
    model: torch.nn.Module,
    tokens: Sequence[int] = MEASURED_TOKENS,
    context: int = CALIBRATION_CONTEXT,
    repeats: int = 3,
    clock: Clock = DEFAULT_CLOCK,
) -> CostCurve:
    """Measure T(k) of ``model`` for each k in ``tokens`` after ``context`` cached tokens: two untimed
    forwards of every size first (weights paged in, kernels built for each shape), then ``repeats``
    timed rounds over all sizes (interleaved, so drift hits every size alike); the median of each.
    Uses its own cache and changes nothing."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    device = next(model.parameters()).device
    prefix = (torch.arange(context, device=device) * 7919 % max(vocab - 3, 1)) + 3
    runner = CachedModel(model, new_dynamic_cache(model), role="measured model", clock=clock)
    runner.logits(prefix, 1)
    sizes = [int(k) for k in tokens]
    for k in sizes:
        _forward_times(model, prefix, k, 1, clock, runner)  # its own warm-up run plus one more
    rounds = [[_forward_times(model, prefix, k, 0, clock, runner, warm=False)[0] for k in sizes] for _ in range(repeats)]
    points = {k: max(statistics.median(r[i] for r in rounds), 1e-9) for i, k in enumerate(sizes)}
    return CostCurve(points, context, {"model": model_description(model), "machine": machine_description()})


def default_directory() -> Path | None:
    """Where curves are kept: ``$HF_POLYBASIC_COSTS`` (empty: nowhere), else ``~/.cache/hf_polybasic/costs``."""
    value = os.environ.get(COSTS_DIRECTORY_VARIABLE)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    return Path.home() / ".cache" / "hf_polybasic" / "costs"


DEFAULT_DIRECTORY = object()  # CostCurves' default: `default_directory()`, read when first needed


class CostEstimate:
    """T(k) of one model during one call: the curve, corrected by what its forwards cost now.

    Every forward of at most `ONLINE_MAX_TOKENS` tokens updates a running, decayed mean of
    log(observed / predicted): one for the curve as a whole (a busy machine scales every cost
    alike) and one at the measured point nearest to the forward's size (so a wrong shape is
    corrected where decoding works). Longer forwards (prefills, catch-ups) are left out.

    Attributes:
        observed: forwards that updated the estimate.
        last_seconds: seconds of the most recent forward, whatever its size.
    """

    def __init__(self, curve: CostCurve):
        self.curve = curve
        self._whole = [0.0, 0.0]  # decayed sum of log ratios, decayed weight
        self._at = {k: [0.0, 0.0] for k in curve.points}
        self.observed = 0
        self.last_seconds: float | None = None

    def _nearest_point(self, tokens: int) -> int:
        return min(self.curve.points, key=lambda k: abs(math.log(k) - math.log(tokens)))

    def observe(self, tokens: int, seconds: float) -> None:
        self.last_seconds = seconds
        if not 1 <= tokens <= ONLINE_MAX_TOKENS or seconds <= 0:
            return
        ratio = math.log(seconds / self.curve.seconds(tokens))
        for running in (self._whole, self._at[self._nearest_point(tokens)]):
            running[0] = ONLINE_DECAY * running[0] + ratio
            running[1] = ONLINE_DECAY * running[1] + 1.0
        self.observed += 1

    def scale(self, point: int | None = None) -> float:
        """observed / measured at a measured ``point`` (that point's own evidence when it has some,
        else the whole curve's), or for the curve as a whole."""
        running = self._at.get(point) if point is not None else None
        if running is None or running[1] < 1.0:
            running = self._whole
        return math.exp(running[0] / running[1]) if running[1] else 1.0

    def points(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k, as this call sees them now."""
        return {k: v * self.scale(k) for k, v in self.curve.points.items()}

    def seconds(self, k: float) -> float:
        return interpolate_cost(self.points(), k)

    def snapshot(self) -> dict[int, float]:
        """``{k: seconds}`` at the measured k as the schedule uses them (made nondecreasing in k)."""
        points = dict(sorted(self.points().items()))
        return dict(zip(points, nondecreasing(list(points.values()))))


class CostCurves:
    """The cost curves of the models a process uses: measured on first use of each (model, machine),
    kept in memory and on disk, refreshed from the forwards of decoding.

    Args:
        directory: where curves are kept as JSON (None: memory only; the default: `default_directory`,
            read when first needed).
        measure: how a missing curve is measured (`measure_curve`).
    """

    def __init__(
        self,
        directory: Path | str | None | object = DEFAULT_DIRECTORY,
        measure: Callable[..., CostCurve] = measure_curve,
    ):
        self._directory = directory
        self.measure = measure
        self._curves: dict[str, CostCurve] = {}
        self._lock = threading.Lock()

    @property
    def directory(self) -> Path | None:
        if self._directory is DEFAULT_DIRECTORY:
            return default_directory()
        return None if self._directory is None else Path(self._directory)

    def _path(self, key: str) -> Path | None:
        directory = self.directory
        return None if directory is None else directory / f"{key}.json"

    def curve_for(self, model: torch.nn.Module, clock: Clock = DEFAULT_CLOCK) -> CostCurve:
        """The curve of ``model`` on this machine: from memory, else from disk, else measured now."""
        key = cost_key(model)
        with self._lock:
            if key in self._curves:
                return self._curves[key]
            curve = self._load(key)
            if curve is None:
                log.info("hf_polybasic: measuring the forward costs of %s on this machine", type(model).__name__)
                curve = self.measure(model, clock=clock)
                self._save(key, curve)
            self._curves[key] = curve
            return curve

    def refresh(self, model: torch.nn.Module, estimate: CostEstimate) -> None:
        """Move the stored curve towards what ``estimate`` saw during a call (each point by its
        observed / measured ratio, weighted by how many forwards the call made), so the next call
        starts from today's costs."""
        if estimate.observed == 0:
            return
        key = cost_key(model)
        with self._lock:
            curve = self._curves.get(key)
            if curve is None or curve is not estimate.curve:
                return
            weight = min(1.0, estimate.observed / 50)
            factors = {k: estimate.scale(k) ** weight for k in curve.points}
            curve.points = {k: v * factors[k] for k, v in curve.points.items()}
            curve.observations += estimate.observed
            if max(abs(math.log(f)) for f in factors.values()) > 0.05:
                self._save(key, curve)

    def _load(self, key: str) -> CostCurve | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            return CostCurve.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            return None  # a torn or foreign file: measure again

    def _save(self, key: str, curve: CostCurve) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
            partial.replace(path)
        except OSError as error:  # a read-only home: curves then live for this process only
            log.warning("hf_polybasic: could not store a cost curve in %s (%s)", path.parent, error)


DEFAULT_COST_CURVES = CostCurves()
