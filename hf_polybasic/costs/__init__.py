"""What a forward pass costs on this machine: measured, as a function of the tokens it scores.

A forward pass that scores k new tokens against a warm cache costs T(k) seconds: a drafting step is
T(1), a verification of k drafts T(k + 1). Speculative decoding assumes T(k) is about T(1) for
small k. That holds on GPUs and on CPUs with fast small matrix products, but not everywhere: on a
CPU without bf16 units a bf16 forward over k tokens costs about k steps, and fp32 products of a
few rows can take a slow kernel (docs: *Speed on your machine*). So costs are measured, never
assumed. One concept per module:

* `curve`: `CostCurve`, T(k) of one model on one machine from measured points (slowed timings
  replaced, then linear: `unslowed`, `interpolate_cost`);
* `measure`: measuring one (`measure_curve`, `forward_cost`) and what it belongs to (`cost_key`);
* `store`: `CostCurves`, the curves of the models a process uses, measured once per (model, dtype,
  device, threads, machine), kept on disk (``$HF_POLYBASIC_COSTS``, default
  ``~/.cache/hf_polybasic/costs``) and refreshed from decoding; unreadable or foreign files never
  break `generate`, and measuring can be switched off (``HF_POLYBASIC_MEASURE_COSTS=0``);
* `estimate`: `CostEstimate`, T(k) of one model during one call, corrected online by the forwards
  just made (a busy machine scales every cost alike).
"""

from .curve import CURVE_FORMAT, SLOWED, CostCurve, interpolate_cost, unslowed
from .estimate import ONLINE_DECAY, ONLINE_MAX_TOKENS, CostEstimate
from .measure import (
    CALIBRATION_CONTEXT,
    MEASURED_TOKENS,
    cost_key,
    forward_cost,
    machine_description,
    measure_curve,
    model_description,
)
from .store import (
    COSTS_DIRECTORY_VARIABLE,
    DEFAULT_COST_CURVES,
    MEASURE_VARIABLE,
    CostCurves,
    default_directory,
    measuring_allowed,
)

__all__ = [
    "SLOWED",
    "CALIBRATION_CONTEXT",
    "COSTS_DIRECTORY_VARIABLE",
    "CURVE_FORMAT",
    "CostCurve",
    "CostCurves",
    "CostEstimate",
    "DEFAULT_COST_CURVES",
    "MEASURED_TOKENS",
    "MEASURE_VARIABLE",
    "ONLINE_DECAY",
    "ONLINE_MAX_TOKENS",
    "cost_key",
    "default_directory",
    "forward_cost",
    "interpolate_cost",
    "machine_description",
    "measure_curve",
    "measuring_allowed",
    "model_description",
    "unslowed",
]
