"""What a model's forward does with a cache and with holes, checked once per model on a tiny input.

A chain relies on properties that a model's class does not state and some models lack:

* **its cache is its past** (`cache_problem`): logits for tokens fed on top of a cache, after a
  rollback, equal a full forward's. Models that silently drop ``past_key_values`` (OpenAI-GPT keeps
  no cache), cannot score several tokens on a filled cache (BLT) or need their whole input at
  every step (CPM-Ant) fail it; a chain over them would emit other tokens than plain `generate`,
  so they are refused before decoding.
* **a row's logits ignore the other rows and the holes** (`rows_problem`): the rows of a batch
  share forwards through one cache with holes (`hf_polybasic.runners.dynamic.CachedModel`); a model that
  takes positions from the cache's physical length instead of ``position_ids`` (TrOCR) or whose
  window counts slots would see another row's layout. Such a batch is decoded row by row.
* **its logits on a static cache are its logits** (`static_problem`): the static runner
  (`hf_polybasic.runners.static`) attends over a preallocated cache under a 4-D mask of its own; a model
  that builds its own mask or position bias from a 2-D one (BLOOM) or has windowed or recurrent
  layers keeps the dynamic runner. So does a model with dynamically quantized int8 layers: one
  activation scale per forward lets the pad tokens of a padded width change its logits, which the
  probe tells from a mask error by running the model again with its weights dequantized. Whether
  its forwards may be compiled now (`compile_problem`: no forward hooks) is asked at every call.

Each probe runs the package's own runner on a few deterministic token ids, against the same
rows decoded alone (and a full forward), and is remembered per model object while the model stays
what it was probed as (`hf_polybasic.models.fingerprint`: a cast, another attention implementation
or an in-place quantization between calls gets a new verdict). What it cannot show
from the model's outputs (windows longer than the probe, recurrent state) is decided from the cache
layers (`hf_polybasic.compat.windowed_layers`).
"""

from __future__ import annotations

import copy

import torch

from .. import compat
from ..labels import model_label
from ..vocabulary import input_vocabulary_size
from .dynamic import CachedModel, check_rollback_support
from ..models.fingerprint import PerModel
from ..models.vocab_head import dynamic_int8_type

# A probe's logits count as different from the reference when they are off by more than a share of
# the reference's largest logit (`TOLERANCE`, by the model's dtype: the rounding of a forward over a
# different number of tokens or rows stays far below it). The cache probe, which every level passes,
# also asks for more than `NULL_SHARE` of what a model that loses the probe's context would be off
# by (a model that drops its past reaches all of it). Dynamically quantized layers scale each
# forward's activations by its largest one, so a forward over other tokens is quantized differently:
# a model with one (the first token's "massive activation" of Qwen and Llama) is off by more than
# rounding while keeping its context (the int8 Qwen2.5-Coder-0.5B: 7.6 where losing the context
# costs 13.8, 0.55 of it); such a model is refused only near a lost context (`DYNAMIC_NULL_SHARE`).
# The rows probe, for the target only, asks for rounding alone: a systematic error of a few percent
# (holes shifting a bias) changes tokens.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.02  # bfloat16, float16 and anything else
NULL_SHARE = 0.25
DYNAMIC_NULL_SHARE = 0.9

# why a model keeps the dynamic runner when the static probe's logits differ (`static_problem`)
STATIC_LOGITS_REASON = ("its logits on a static cache differ from a full forward's (it builds its own mask or position "
                        "bias, or reads positions off the cache)")
DYNAMIC_QUANTIZATION_REASON = (
    "its dynamically quantized linear layers (torch.ao quantize_dynamic, e.g. quantized_copy(method='int8-dynamic')) "
    "quantize a forward's activations with one scale over all of its tokens, so the pad tokens that the static runner "
    "adds up to a bucket width would change its logits (its masks and positions are not at fault: with its weights "
    "dequantized it decodes on a static cache exactly)"
)

# verdicts per model, each found again only while the model is what it was probed as (its dtype,
# device, modules, weights and attention implementation: `hf_polybasic.models.fingerprint`)
_cache_problems = PerModel()
_rows_problems = PerModel()
_static_problems = PerModel()


def _remembered(store: PerModel, model: torch.nn.Module, check):
    def probe():
        with torch.no_grad():
            return check(model)

    return store.setdefault(model, probe)


def _probe_ids(model: torch.nn.Module, count: int, seed: int) -> torch.LongTensor:
    """``count`` deterministic token ids the model can embed, avoiding the first few (pad, BOS, EOS
    in most vocabularies)."""
    high = min(input_vocabulary_size(model), 1000)
    low = 3 if high > 8 else 0
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (count,), generator=generator).to(model.device)


def _tolerance(model: torch.nn.Module) -> float:
    dtypes = {parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()}
    return max((TOLERANCE.get(dtype, HALF_TOLERANCE) for dtype in dtypes), default=HALF_TOLERANCE)


def _dynamic_int8_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's dynamically quantized int8 linear layers (``torch.ao`` ``quantize_dynamic``, which
    quantizes each forward's activations with one scale over the whole input)."""
    kind = dynamic_int8_type()
    return [module for module in model.modules()
            if isinstance(module, kind) and module._packed_params.dtype == torch.qint8]


def _null_share(model: torch.nn.Module) -> float:
    """`DYNAMIC_NULL_SHARE` for a model with dynamically quantized linear layers, else `NULL_SHARE`."""
    return DYNAMIC_NULL_SHARE if _dynamic_int8_layers(model) else NULL_SHARE


def _differs(value: torch.Tensor, reference: torch.Tensor, tolerance: float, null: torch.Tensor | None = None,
             share: float = NULL_SHARE) -> bool:
    """Whether ``value`` differs from ``reference`` beyond rounding. ``null``, when given, is what the
    model gives without the context (the same tokens fed alone): the error of a model that loses it,
    which a difference must then also approach (`NULL_SHARE`). Logits may be -inf where the model
    scores no token (`hf_polybasic.models.vocab_head`): the two must be finite at the same ids."""
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(value), finite):
        return True
    value, reference = torch.where(finite, value, 0), torch.where(finite, reference, 0)
    error = float((value - reference).abs().max())
    if error <= tolerance * max(float(reference.abs().max()), 1e-6):
        return False
    return null is None or error > share * float((torch.where(finite, null, 0) - reference).abs().max())


def _full_logits(model: torch.nn.Module, sequence: torch.LongTensor, count: int) -> torch.Tensor:
    """Logits for the last ``count`` positions of ``sequence`` from one forward without a cache."""
    return CachedModel(model, None, role=model_label(model)).logits(sequence, count)


def cache_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode incrementally on its own cache, or None (remembered per model).

    Feeds 4 probe tokens, then 3 more, rolls back 2 and feeds 2 others, on a fresh cache, and
    compares the logits of each incremental forward with a full forward over the same tokens."""
    return _remembered(_cache_problems, model, _check_cache)


def _check_cache(model: torch.nn.Module) -> str | None:
    ids = _probe_ids(model, 9, seed=1)
    steps = [(ids[:4], 2), (ids[:7], 3), (torch.cat([ids[:5], ids[7:9]]), 2)]  # the last after a rollback to 5
    runner = CachedModel(model, compat.new_dynamic_cache(model), role=model_label(model))
    try:
        for number, (sequence, count) in enumerate(steps):
            fed = sequence.shape[0] - runner.length
            logits = runner.logits(sequence, count)
            # a cache of recurrent layers only (a pure state-space model) cannot count its tokens
            if compat.tracks_length(runner.cache) and compat.cached_tokens(runner.cache) != runner.length:
                return "it does not keep its past in the cache it is given (past_key_values stays empty)"
            null = _full_logits(model, sequence[-fed:], count)
            if _differs(logits, _full_logits(model, sequence, count), _tolerance(model), null, _null_share(model)):
                return (
                    "its logits for tokens fed on top of its cache differ from a full forward's (it needs its whole "
                    "input at every step, or mishandles a cut cache)"
                )
            if number == 1:
                runner.rollback_rows({0: 5})
    except Exception as error:  # noqa: BLE001 - any failure to decode on a cache is the answer
        return f"a forward on its own filled cache fails ({type(error).__name__}: {error})"
    return None


def check_cache(model: torch.nn.Module, role: str) -> None:
    """Raise a clear error if ``model`` (``role`` names it in the message) cannot roll its cache back
    (`hf_polybasic.runners.dynamic.check_rollback_support`) or fails `cache_problem`."""
    check_rollback_support(model, compat.new_dynamic_cache(model), role)
    problem = cache_problem(model)
    if problem is not None:
        raise ValueError(
            f"{role} cannot be part of a speculative chain: {problem}. A chain scores drafted tokens on top of each "
            "model's cache and cuts the rejected ones; use plain generate for this model"
        )


def rows_problem(model: torch.nn.Module, compare_logits: bool = True) -> str | None:
    """Why the rows of a batch of ``model`` cannot share forwards through one cache with holes, or
    None (remembered per model): windowed cache layers (their window counts slots, holes
    included), a forward that fails on such a batch, or, with ``compare_logits``, a row whose logits
    differ from the row decoded alone (two rows of different lengths, fed together with a
    rolled-back hole). Only the target needs the last: a level below it that computes other logits
    in a batch stays exact (its proposals are what it sampled; the target decides), and dynamic
    int8 copies, whose activation scale spans every row of a forward, always do a little."""
    structural, logits = _remembered(_rows_problems, model, _check_rows)
    return structural or (logits if compare_logits else None)


def _check_rows(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """(a structural problem, a logits problem): see `rows_problem`."""
    windowed = compat.windowed_layers(model)
    if windowed:
        index, kind = windowed[0]
        return (
            f"{model_label(model)} has windowed attention (layer {index}: {kind}), whose window counts cache slots, "
            "holes of other rows included"
        ), None
    # wide holes inside both rows (a model that reads positions or distances off the slots is then
    # far off): row 1 feeds 1 token while row 0 feeds 10, then row 0 rolls 6 back and both go on
    a, b = _probe_ids(model, 16, seed=2), _probe_ids(model, 8, seed=3)
    steps = [{0: (a[:2], 1), 1: (b[:2], 1)}, {0: (a[:12], 3), 1: (b[:3], 1)}, {0: (a[:16], 3), 1: (b[:8], 3)}]
    rolled_back = {0: 6}  # after the second step
    try:
        together = CachedModel(model, compat.new_dynamic_cache(model), role=model_label(model), rows=2)
        alone = [CachedModel(model, compat.new_dynamic_cache(model), role=model_label(model)) for _ in range(2)]
        for number, step in enumerate(steps):
            logits = together.logits_rows(step)
            for row, (sequence, count) in step.items():
                if _differs(logits[row], alone[row].logits(sequence, count), _tolerance(model)):
                    return None, (
                        f"{model_label(model)} gives a row of a batch other logits than the row alone (it takes "
                        "positions from the cache's layout rather than position_ids, or attends across holes)"
                    )
            if number == 1:
                together.rollback_rows(rolled_back)
                alone[0].rollback_rows({0: rolled_back[0]})
    except Exception as error:  # noqa: BLE001 - a model that cannot run a batch with holes is answered the same way
        return f"{model_label(model)} cannot run a batch whose rows have holes ({type(error).__name__}: {error})", None
    return None, None


def compile_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forwards should not be compiled now, or None (checked at every call: hooks
    come and go): forward hooks on it or a submodule run Python at every forward (accelerate's
    device hooks move weights, a restricted vocabulary grows its output layer), which a graph
    would either freeze or break on. transformers' own hooks that record hidden states only when asked
    (left on a model once hidden states were asked of it: a draft head below it asks) are not such hooks."""
    hooked = next((name or type(model).__name__ for name, module in model.named_modules()
                   if module._forward_pre_hooks or any(not compat.is_output_capturing_hook(hook)
                                                       for hook in module._forward_hooks.values())), None)
    if hooked is not None:
        return f"it has forward hooks ({hooked}: Python run at every forward, e.g. accelerate's or a counter's)"
    return None


# --- which models a static runner takes (`hf_polybasic.runners.static`) ------------------------------------------
def static_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode exactly on a `StaticRunner`, or None (checked once per model):
    recurrent or windowed layers, an attention implementation that takes no explicit mask, or a
    probe whose logits differ from full forwards: two rows of different lengths fed together, one
    rolled back and fed other tokens (a model that builds its own mask or position bias from a 2-D
    attention mask, such as BLOOM's ALiBi, fails it).

    A model with dynamically quantized int8 layers always fails the probe: each forward quantizes
    its activations with one scale over all of its tokens, the static runner's pads (and a full
    forward's other tokens) included. When the same model with those layers dequantized
    (`_dequantized_twin`: nothing copied but the module tree) passes, that is the reason said
    (`DYNAMIC_QUANTIZATION_REASON`); else the model's masks or positions are at fault too."""
    return _remembered(_static_problems, model, _check_static)


def _check_static(model: torch.nn.Module) -> str | None:
    from .recurrent import recurrent_layers

    if recurrent_layers(model) or compat.is_stateful(model):
        return "it has recurrent layers (their state is not a slot per token)"
    windowed = compat.windowed_layers(model)
    if windowed:
        index, kind = windowed[0]
        return f"it has windowed attention (layer {index}: {kind}), which the static runner's masks do not apply"
    implementation = compat.attention_implementation(model)
    if implementation not in ("sdpa", "eager"):
        return f"its attention implementation {implementation!r} takes no explicit attention mask (sdpa and eager do)"
    problem = _static_logits_problem(model)
    if problem == STATIC_LOGITS_REASON and _dynamic_int8_layers(model):
        try:
            twin_problem = _static_logits_problem(_dequantized_twin(model))
        except Exception:  # noqa: BLE001 - a twin that cannot be made leaves the reason unknown: the general one
            twin_problem = problem
        if twin_problem is None:
            return DYNAMIC_QUANTIZATION_REASON
    return problem


def _static_logits_problem(model: torch.nn.Module) -> str | None:
    """The static probe itself: rows of different lengths, a rollback, other tokens; every logit must
    equal a full forward's."""
    from .static import StaticRunner, capacity_for

    a, b = _probe_ids(model, 16, seed=2), _probe_ids(model, 8, seed=3)
    steps = [{0: (a[:2], 1), 1: (b[:2], 1)}, {0: (a[:12], 3), 1: (b[:3], 1)}, {0: (torch.cat([a[:6], b[:5]]), 3),
                                                                               1: (b[:8], 3)}]
    try:
        runner = StaticRunner(model, model_label(model), capacity_for(32), rows=2)
        try:
            for number, step in enumerate(steps):
                if number == 2:
                    runner.rollback_rows({0: 6})
                logits = runner.logits_rows(step)
                for row, (sequence, count) in step.items():
                    if _differs(logits[row], _full_logits(model, sequence, count), _tolerance(model)):
                        return STATIC_LOGITS_REASON
        finally:
            runner.close()
    except Exception as error:  # noqa: BLE001 - a model that cannot run on the static cache is answered the same way
        return f"a forward on a static cache fails ({type(error).__name__}: {error})"
    return None


class _DequantizedLinear(torch.nn.Module):
    """A dynamically quantized int8 linear layer computed in float32 with its weights dequantized at
    every forward (one layer's float weight at a time): a token's output no longer depends on the
    other tokens of the forward. The layer's hooks are kept (shared, as in `module_view`)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self._layer = (layer,)  # not a submodule: the twin's module tree holds no quantized layer
        for name, value in vars(layer).items():
            if "hook" in name and isinstance(value, (dict, set)):
                setattr(self, name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self._layer[0]
        return torch.nn.functional.linear(x, layer.weight().dequantize(), layer.bias())


def _dequantized_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its dynamically quantized int8 layers computed in float (`_DequantizedLinear`),
    leaving ``model`` untouched: the twin's module tree is new, its tensors and quantized layers
    are ``model``'s own (nothing is copied but the tree)."""
    layers = _dynamic_int8_layers(model)
    shared = {id(tensor): tensor for tensor in [*model.parameters(), *model.buffers()]}
    shared.update({id(layer): layer for layer in layers})
    twin = copy.deepcopy(model, memo=shared)
    quantized = {id(layer) for layer in layers}
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in quantized:
                setattr(parent, name, _DequantizedLinear(child))
    return twin.eval()
