"""Every use of transformers internals, behind named functions, each covered by tests.

Nothing else in the package reads a private attribute of transformers or relies on behaviour that
changed between releases; the functions below say which internal they touch and why. Grouped by
topic:

* caches: `new_dynamic_cache`, `is_dynamic_cache`, `unrollable_layer`, `windowed_layers`, `replaceable_empty_cache`,
  `record_past_states`, `stop_recording_past_states`, `remove_last_tokens`, `restrict_sliding_layers`,
  `select_batch_rows`, `gather_slots`, `SLIDING_LAYERS_ROLL_BACK` (whether sliding layers that record
  their past hand attention only their window: transformers >= 5.18, checked on a tiny layer)
  (cache layer classes and their ``keys``, ``values``, ``cumulative_length``, ``is_initialized``,
  ``record_past`` fields; ``crop``'s argument; what a recording sliding layer's ``update`` returns);
* recurrent state (hybrid models, for `hf_polybasic.runners.recurrent`, transformers >= 5.15):
  `is_recurrent_cache_layer`, `recurrent_layer_indices`, `read_recurrent_state`,
  `write_recurrent_state`, `trim_conv_states`, `tracks_length`, `holds_recurrent_state`,
  `cached_tokens`, `continues_state_over_several_tokens` (the ``conv_states``,
  ``recurrent_states``, ``has_previous_state``, ``conv_kernel_size`` fields of transformers'
  linear-attention cache layers; which layer code continues a state over several tokens);
  `cache_argument`, `takes_position_ids`, `config_layer_types` (how a model takes its cache and
  positions, its config's ``layer_types``); `given_cache`, `OUTPUT_CACHE_FIELD` (what `generate` and its
  output call the cache: ``cache`` from transformers 5.24 on);
* models: `accepts_logits_to_keep`, `is_stateful`;
* generate: `calling_generate_argument` (an argument of the calling `generate`, read from its frame:
  `streamer_of_calling_generate`, `assistant_model_of_calling_generate`), `pads_finished_rows` (when
  batched `generate` pads a stopped row), `prepared_pad_token_id` (``GenerationConfig._pad_token_tensor``),
  `mark_as_user_config` (``_from_model_config``);
* transformers' assisted loop: `assisted_decoding` (``GenerationMixin._assisted_decoding`` and the
  ``_get_candidate_generator`` it asks), `use_assisted_loop_cache` (``_prepare_cache_for_generation``
  in ``GenerationMode.ASSISTED_GENERATION``), `ASSISTED_DECODING_TAKES_STATIC_CACHE`;
* loading: `gguf_tensors` (transformers' GGUF reader: its dequantization, tensor processors and
  name map, ``transformers.modeling_gguf_pytorch_utils``, one tensor at a time);
* logits processors: `shift_positions` (the attributes that hold absolute positions, the processors
  that read the prefix's length: `LENGTH_READING_PROCESSORS`),
  `processor_for_row` (the attributes that hold the whole batch's prompts or call the user per row),
  `processor_on_device` (the tensors a processor holds),
  `decoding_processors` and `resolved_decoding` (the processors and defaults `generate` builds, for
  the planner, which scores without calling `generate`);
* torch: `onednn_supports`, `onednn_pack_weight`, `onednn_linear` (oneDNN's prepacked linear,
  private ops of ``torch.ops.mkldnn``, for `hf_polybasic.models.packed`).

Tests: ``tests/test_compat.py`` checks each function against the behaviour it stands for; the
greedy-equality tests (sliding windows), streamer, batch and save/reload tests cover the rest.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import logits_process as lp

TESTED_TRANSFORMERS = (Version("4.57.0"), Version("5.25.0"))  # [low, high): README, "Tested versions"
TRANSFORMERS_VERSION = Version(transformers.__version__)


def transformers_is_tested() -> bool:
    low, high = TESTED_TRANSFORMERS
    return low <= TRANSFORMERS_VERSION < high


_warned = False


def warn_if_untested() -> None:
    """Warn once when transformers is outside the range the internals below were checked against."""
    global _warned
    if not _warned and not transformers_is_tested():
        _warned = True
        warnings.warn(
            f"hf_polybasic was tested with transformers {TESTED_TRANSFORMERS[0]} <= v < {TESTED_TRANSFORMERS[1]}; "
            f"found {TRANSFORMERS_VERSION}. Run the test suite before trusting the output.",
            stacklevel=3,
        )


# --- caches -----------------------------------------------------------------------------------------
try:  # transformers >= 5.12 (indexed layers of DeepSeek-style sparse attention)
    from transformers.cache_utils import DynamicIndexedLayer

    ROLLBACK_LAYER_TYPES: tuple[type, ...] = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer)
except ImportError:  # pragma: no cover - older releases
    ROLLBACK_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)


try:  # a layer type that holds nothing (transformers 5.x: "mlp"/"moe" layers of Nemotron-H and the like)
    from transformers.cache_utils import DummyLayer

    ROLLBACK_LAYER_TYPES = (*ROLLBACK_LAYER_TYPES, DummyLayer)
except ImportError:  # pragma: no cover - older releases
    pass


# transformers >= 5.15: sliding-window layers can keep the states that leave their window
# (``activate_past_recording``), so a rollback can reach back across several rounds
HAS_PAST_RECORDING = hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def _recording_sliding_layer_shows_only_its_window() -> bool:
    """Whether a sliding layer that records its past hands attention only the states its mask
    describes (``sliding_window - 1`` + the new tokens), however many it has recorded since its last
    ``crop``. transformers 5.15 - 5.17 return every recorded state, while the mask
    (``get_mask_sizes``) still advertises the window: a chain, which feeds several forwards between
    two crops, crashes there ("size of tensor a (13) must match ... (12)"); 5.18 returns the window
    (PR #48280). Checked on a tiny layer: record, feed 4 tokens, then 1, and count what comes back."""
    if not HAS_PAST_RECORDING:
        return False
    window = 3
    layer = DynamicSlidingWindowLayer(sliding_window=window)
    layer.activate_past_recording()
    states = torch.zeros(1, 1, 4, 2)
    layer.update(states, states)
    keys, _ = layer.update(states[:, :, :1], states[:, :, :1])
    return keys.shape[-2] == window - 1 + 1


# Whether our caches keep sliding layers (recording their past so a rollback can reach across rounds):
# transformers >= 5.18. Before 5.15 a sliding layer cannot record its past, and in 5.15 - 5.17 a
# recording one breaks the window's mask (`_recording_sliding_layer_shows_only_its_window`); there,
# our caches use full layers in their place (the model's masks apply the window whatever the layer keeps).
SLIDING_LAYERS_ROLL_BACK = _recording_sliding_layer_shows_only_its_window()


def _full_layer_for(layer):
    """A fresh full-attention layer to stand in for the sliding layer ``layer`` (same recurrent
    states where it also holds some), or None for a sliding kind we do not know."""
    if type(layer) is DynamicSlidingWindowLayer:
        return DynamicLayer()
    if type(layer).__name__ == "LinearAttentionAndSlidingWindowAttentionLayer":
        from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

        return LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return None


def new_dynamic_cache(model: torch.nn.Module) -> DynamicCache:
    """A fresh `DynamicCache` for ``model``, laid out by its config (sliding layers where it says so,
    recurrent layers of hybrid models) where sliding layers can roll back (`SLIDING_LAYERS_ROLL_BACK`,
    transformers >= 5.18). Before that, full layers stand in for the sliding ones: a sliding layer
    there drops what leaves its window (< 5.15) or returns more states than the mask expects
    (5.15 - 5.17), while the model's attention masks apply the window whatever the layer keeps."""
    if SLIDING_LAYERS_ROLL_BACK:
        return DynamicCache(config=model.config.get_text_config(decoder=True))
    if not HAS_PAST_RECORDING:  # < 5.15: laid out by config only for hybrids (their recurrent layers)
        laid_out = DynamicCache(config=model.config.get_text_config(decoder=True))
        return laid_out if recurrent_layer_indices(laid_out) else DynamicCache()
    laid_out = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, layer in enumerate(laid_out.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            full = _full_layer_for(layer)
            if full is not None:
                laid_out.layers[index] = full
    return laid_out


def is_dynamic_cache(cache) -> bool:
    """Exactly a `DynamicCache` (subclasses such as quantized caches cannot be cut token by token)."""
    return type(cache) is DynamicCache


def is_static_cache(cache) -> bool:
    """A transformers `StaticCache` (of any layout: its layers are preallocated, written in place)."""
    from transformers.cache_utils import StaticCache

    return isinstance(cache, StaticCache)


# transformers >= 5.24 takes a static cache in its own assisted decoding (it crops a static layer by
# moving its length) and then compiles the target's forward on a GPU; earlier releases refuse it
# ("assisted generate is not supported with Static cache classes")
ASSISTED_DECODING_TAKES_STATIC_CACHE = TRANSFORMERS_VERSION >= Version("5.24.0")


def forget_generate_static_cache(model, cache) -> None:
    """transformers up to 5.14 at least keeps the `StaticCache` that `generate` built for
    ``cache_implementation="static"`` on the model (``_cache``) and reuses it at the next such call,
    reading its layers' sizes; a chain never fills it (its static runners keep caches of their own),
    so on 5.4 the next call failed on its never-initialized layers. Forget it: the next call builds
    a new one (allocated lazily). Releases that keep none (5.24) are unaffected."""
    if getattr(model, "_cache", None) is cache:
        del model._cache


def unrollable_layer(cache) -> tuple[int, str] | None:
    """(index, class name) of the first layer whose state cannot be cut back (recurrent or linear
    attention), or None."""
    for index, layer in enumerate(cache.layers):
        if type(layer) not in ROLLBACK_LAYER_TYPES:
            return index, type(layer).__name__
    return None


def windowed_layers(model: torch.nn.Module) -> list[tuple[int, str]]:
    """(index, kind) of the decoder layers whose cache keeps a window of slots: every layer class
    transformers derives from its sliding-window layer (``sliding_attention``; Llama 4's
    ``chunked_attention`` is backed by the same class), read from the `DynamicCache` laid out by
    the model's config, so a new windowed kind is found by its class, not its name. Releases whose
    cache cannot be laid out by config fall back to the config's layer types and window fields."""
    config = model.config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or [])
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - older releases, or configs they cannot lay out
        layers = []
    if layers:
        return [
            (index, f"{type(layer).__name__}" + (f" ({layer_types[index]})" if index < len(layer_types) else ""))
            for index, layer in enumerate(layers)
            if isinstance(layer, DynamicSlidingWindowLayer)
        ]
    if layer_types:
        return [(index, str(kind)) for index, kind in enumerate(layer_types) if "sliding" in str(kind) or "chunk" in str(kind)]
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or getattr(config, "attention_chunk_size", None):
        return [(index, "sliding_attention" if window else "chunked_attention") for index in range(config.num_hidden_layers)]
    return []


def replaceable_empty_cache(cache, made_by_generate: bool) -> bool:
    """Whether ``cache`` is an empty one a chain cannot roll back, which a fresh `new_dynamic_cache`
    replaces: one that `generate` built for ``cache_implementation`` (static, hybrid, quantized; some
    hub configs set it), or, before transformers 5.18, one with sliding-window layers (they cannot
    roll back there: `SLIDING_LAYERS_ROLL_BACK`). A cache the caller built stays theirs: it is used or
    refused."""
    if cached_tokens(cache) != 0:
        return False
    if not is_dynamic_cache(cache):
        return made_by_generate
    return not SLIDING_LAYERS_ROLL_BACK and any(
        isinstance(layer, DynamicSlidingWindowLayer) for layer in getattr(cache, "layers", ())
    )


def record_past_states(cache) -> None:
    """Make sliding-window layers keep the states that leave their window until `restrict_sliding_layers`,
    so a rollback can reach back across several rounds (transformers' ``activate_past_recording``;
    recurrent layers keep their convolution states' past the same way).

    Where sliding layers cannot roll back (`SLIDING_LAYERS_ROLL_BACK`: before transformers 5.18),
    caches we build have none (`new_dynamic_cache`), and a cache passed in with one is refused with a
    clear error naming the release to install."""
    if not SLIDING_LAYERS_ROLL_BACK:
        sliding = [i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer)]
        if sliding:
            reason = (
                "cannot record the states that leave their window"
                if not HAS_PAST_RECORDING
                else "hands attention more states than its mask expects once it records them (fixed in 5.18)"
            )
            raise ValueError(
                f"the cache passed in (past_key_values) has sliding-window layers ({len(sliding)}, first: {sliding[0]}), "
                f"which transformers {TRANSFORMERS_VERSION} cannot roll back across rounds (a sliding layer there "
                f"{reason}); continue without past_key_values, or install transformers >= 5.18"
            )
    if HAS_PAST_RECORDING:
        cache.activate_past_recording()


def stop_recording_past_states(cache) -> None:
    """Undo `record_past_states` on a cache handed back to the caller: its sliding layers drop what
    leaves their window again (``record_past``, transformers >= 5.15; as `generate` itself does), and
    its convolution states keep their kernel's width only."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "record_past", False):
            layer.record_past = False
    trim_conv_states(cache)  # a layer that no longer records updates its convolution state in place


def remove_last_tokens(cache, count: int) -> None:
    """Drop the last ``count`` tokens of every attention layer; sliding layers keep their recorded past.

    Full layers use the public ``crop(-count)``. A sliding layer is trimmed by hand
    (``keys``/``values``/``cumulative_length``), because its ``crop`` also restricts it to the window,
    after which an intermediate level could no longer roll back over several rounds. The recurrent
    and convolution state of a linear-attention layer is left alone (`hf_polybasic.runners.recurrent` puts
    it back); only the attention part of a layer holding both is cut.
    """
    if count <= 0:
        return
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            _trim_sliding_layer_tail(layer, count)
        elif is_recurrent_cache_layer(layer):
            if isinstance(layer, DynamicLayer):  # e.g. Falcon-H1: attention and Mamba-2 side by side
                DynamicLayer.crop(layer, -count)
        else:
            layer.crop(-count)


def _trim_sliding_layer_tail(layer: DynamicSlidingWindowLayer, count: int) -> None:
    if not layer.is_initialized:
        return
    stored = layer.keys.shape[-2]
    if count > stored:
        raise RuntimeError(
            f"cannot roll back {count} tokens of a sliding-window layer that stores {stored}; "
            "this is a bug in hf_polybasic (past recording should have kept them)"
        )
    layer.keys = layer.keys[..., :-count, :]
    layer.values = layer.values[..., :-count, :]
    layer.cumulative_length -= count


def select_batch_rows(cache, indices: torch.LongTensor) -> None:
    """Keep only the batch rows ``indices`` of every layer (the public ``batch_select_indices``)."""
    cache.batch_select_indices(indices)


def gather_slots(cache, index: torch.LongTensor) -> None:
    """Rearrange the slots of every layer: slot j of batch row b becomes its old slot
    ``index[b, j]`` (``[batch, new slots]``). Full-attention layers (``keys``/``values``
    ``[B, H, S, D]``) and DeepSeek-style indexed layers (also ``indexer_keys`` ``[B, S, D]`` and
    ``indexer_position_ids`` ``[P, B, S]``); a layer that stores nothing (KV sharing) is skipped;
    any other kind raises (its batches are decoded row by row, `hf_polybasic.runners.probe.rows_problem`)."""
    for number, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None:
            continue
        if type(layer) not in (DynamicLayer, *(t for t in ROLLBACK_LAYER_TYPES if t.__name__ == "DynamicIndexedLayer")):
            raise TypeError(f"cannot compact cache layer {number}, a {type(layer).__name__}")
        if layer.keys.numel() == 0:
            continue
        layer.keys = _gather_along(layer.keys, index, dim=2)
        layer.values = _gather_along(layer.values, index, dim=2)
        if getattr(layer, "indexer_keys", None) is not None and layer.indexer_keys.numel():
            layer.indexer_keys = _gather_along(layer.indexer_keys, index, dim=1)
        if getattr(layer, "indexer_position_ids", None) is not None:
            positions = layer.indexer_position_ids  # [P, B, S]
            layer.indexer_position_ids = positions.gather(2, index.to(positions.device).unsqueeze(0).expand(
                positions.shape[0], -1, -1))


def _gather_along(tensor: torch.Tensor, index: torch.LongTensor, dim: int) -> torch.Tensor:
    """``tensor`` (batch first) with positions along ``dim`` picked per batch row by ``index`` ``[B, S']``."""
    shape = [1] * tensor.dim()
    shape[0], shape[dim] = index.shape
    expanded = index.to(tensor.device).reshape(shape).expand(*[
        index.shape[1] if axis == dim else size for axis, size in enumerate(tensor.shape)
    ])
    return tensor.gather(dim, expanded)


# --- static caches (hf_polybasic.runners.static) -------------------------------------------------------------
# A static runner's cache is a transformers `Cache` of layers of its own (`CacheLayerMixin`, whose
# abstract methods differ between releases: the layer implements every name any release asks for),
# so that models call ``update`` on it as on any cache. Both base classes exist from 4.56 on.
from transformers.cache_utils import Cache as CacheBase  # noqa: E402
from transformers.cache_utils import CacheLayerMixin as CacheLayerBase  # noqa: E402


def attention_implementation(model) -> str:
    """The attention implementation the model's config names (``_attn_implementation``: "sdpa",
    "eager", "flash_attention_2", "flex_attention", ...); "eager" where none is set."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def decoder_layer_count(model) -> int:
    """Decoder layers of the model (its text config's ``num_hidden_layers``): one cache layer each."""
    return int(model.config.get_text_config(decoder=True).num_hidden_layers)


# --- recurrent state (hybrid models) ------------------------------------------------------------------
# transformers >= 5.15 keeps the state of every linear-attention, state-space and short-convolution
# layer in cache layers of one kind (``LinearAttentionCacheLayerMixin``), with per-state dicts
# ``conv_states``, ``recurrent_states``, ``has_previous_state`` and ``conv_kernel_size`` (checked on
# 5.15.1, 5.18.0, 5.22.2, 5.23.0). Hybrid models are refused on earlier releases: 5.14 has that layout
# but some families still keep state elsewhere (OLMo hybrid) or continue it wrongly over several
# tokens (Nemotron-H, LFM2); 5.5 - 5.13 had the class with single tensors; 4.57 - 5.4 one cache class
# per family (``HybridMambaAttentionDynamicCache``, ``MambaCache``, ``Qwen3NextDynamicCache``, ...).
try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

    HAS_RECURRENT_CACHE_LAYERS = TRANSFORMERS_VERSION >= Version("5.15.0") and isinstance(
        LinearAttentionLayer().conv_states, dict
    )
except ImportError:  # pragma: no cover - transformers < 5.5
    LinearAttentionCacheLayerMixin = None
    HAS_RECURRENT_CACHE_LAYERS = False

# the layer types of a config (``layer_types``) that are not attention
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def is_recurrent_cache_layer(layer) -> bool:
    """Whether a cache layer holds recurrent / convolution state in transformers' shared layout."""
    return LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)


def recurrent_layer_indices(cache) -> list[int]:
    """Indices of the cache layers holding recurrent / convolution state (`is_recurrent_cache_layer`)."""
    return [index for index, layer in enumerate(getattr(cache, "layers", ())) if is_recurrent_cache_layer(layer)]


def tracks_length(cache) -> bool:
    """Whether ``cache`` has a layer that counts the tokens it holds (an attention layer, alone or
    beside a recurrent state): a cache of recurrent layers only cannot tell its length
    (``get_seq_length`` raises)."""
    return any(isinstance(layer, DynamicLayer) for layer in getattr(cache, "layers", ()))


def holds_recurrent_state(cache) -> bool:
    """Whether a recurrent layer of ``cache`` has seen a token (its next forward continues a state)."""
    return any(
        any(cache.layers[index].has_previous_state.values()) for index in recurrent_layer_indices(cache)
    )


# Layer kinds (`hf_polybasic.runners.recurrent.LayerKind.key`) whose transformers code does not continue a
# cached state in a forward of several tokens (checked by tests/test_compat.py on the installed
# release): "mamba", the Mamba (1) layers of Jamba, Mamba and FalconMamba, transformers 5.14 - 5.23
# (no release seen since): the selective scan of a forward of several tokens starts from a zero state
# (it takes no initial state). Their one-token path is right.
def continues_state_over_several_tokens(kind: str) -> bool:
    """Whether transformers' layers of ``kind`` continue their cached state correctly over a forward of
    several tokens on this release (else they must be fed one token at a time once they hold state)."""
    return kind != "mamba"


def cached_tokens(cache) -> int:
    """How many tokens ``cache`` holds (``get_seq_length``). A cache of recurrent layers only (a pure
    state-space model: Mamba, Mamba-2, FalconMamba) does not count them: 0 while no layer has seen
    a token, else a clear error (nor can transformers continue such a cache)."""
    if tracks_length(cache) or not recurrent_layer_indices(cache):
        return cache.get_seq_length()
    if holds_recurrent_state(cache):
        raise ValueError(
            "the cache passed in (past_key_values / cache_params) belongs to a model without attention layers and "
            "already holds a state: such a cache does not say how many tokens it holds, so it cannot be continued; "
            "pass the whole text without a cache"
        )
    return 0


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


# transformers 5.24 renamed a model's and `generate`'s cache argument to ``cache`` (``past_key_values``
# and ``cache_params`` stay as deprecated aliases that warn): `generate`'s model_kwargs hold it as
# ``cache``, forwards take ``cache=`` and `GenerateDecoderOnlyOutput` has a ``cache`` field.
try:
    from transformers.generation import GenerateDecoderOnlyOutput as _GenerateOutput

    CACHE_IS_CALLED_CACHE = "cache" in getattr(_GenerateOutput, "__dataclass_fields__", {})
except ImportError:  # pragma: no cover
    CACHE_IS_CALLED_CACHE = False

# the names under which `generate`'s model_kwargs may hold the caller's cache, newest first
# (``cache_params``: the cache of a model without attention layers, Mamba, before 5.24)
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")
# the field of `GenerateDecoderOnlyOutput` that returns the cache (``past_key_values`` before 5.24;
# 5.24 keeps ``past_key_values`` as a read-only alias of ``cache``)
OUTPUT_CACHE_FIELD = "cache" if CACHE_IS_CALLED_CACHE else "past_key_values"


def given_cache(model_kwargs: Mapping[str, Any]):
    """The cache the caller passed to `generate` (under any of `CACHE_KWARGS`), or None."""
    for name in CACHE_KWARGS:
        if model_kwargs.get(name) is not None:
            return model_kwargs[name]
    return None


def cache_argument(model) -> str:
    """The name under which ``model.forward`` takes its cache: ``cache`` (transformers >= 5.24, every
    model), ``past_key_values`` (before), or ``cache_params`` for the pure state-space models of
    transformers 5.0 - 5.23 (Mamba, Mamba-2, FalconMamba). A forward that names none of them (``**kwargs``)
    gets the release's own name."""
    parameters = _forward_parameters(type(model))
    for name in ("cache", "past_key_values", "cache_params") if CACHE_IS_CALLED_CACHE else ("past_key_values", "cache_params"):
        if name in parameters:
            return name
    return "cache" if CACHE_IS_CALLED_CACHE else "past_key_values"


def takes_position_ids(model) -> bool:
    """Whether ``model.forward`` takes ``position_ids`` (models without attention do not)."""
    return "position_ids" in _forward_parameters(type(model))


def config_layer_types(model) -> list[str] | None:
    """The config's ``layer_types`` (e.g. ``["linear_attention", "full_attention", ...]``), if it has them."""
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    return None if layer_types is None else [str(kind) for kind in layer_types]


# One state of a recurrent cache layer: (has_previous_state, conv state, recurrent state); the
# tensors are the layer's own (`read_recurrent_state` callers copy what they keep).
RecurrentState = tuple[bool, "torch.Tensor | None", "torch.Tensor | None"]


def read_recurrent_state(layer) -> list[RecurrentState]:
    """Each state of a recurrent cache layer (a layer may hold several, e.g. Kimi's q/k/v convs):
    whether it has seen a token, its convolution state cut to the kernel's width (the columns the
    next forward reads; more are kept while ``record_past`` is on) and its recurrent state."""
    states = []
    for index in range(layer.number_of_states):
        conv = layer.conv_states[index]
        if conv is not None and layer.conv_kernel_size[index] is not None:
            conv = conv[..., -layer.conv_kernel_size[index] :]
        states.append((bool(layer.has_previous_state[index]), conv, layer.recurrent_states[index]))
    return states


def write_recurrent_state(layer, states: list[RecurrentState]) -> None:
    """Put ``states`` (from `read_recurrent_state`) into the layer, which then uses those tensors
    (no copy). A state that had seen no token makes the layer start afresh there (as a new cache)."""
    for index, (seen, conv, recurrent) in enumerate(states):
        layer.has_previous_state[index] = seen
        if seen:
            layer.conv_states[index] = conv
            layer.recurrent_states[index] = recurrent
        else:  # nothing seen yet: its tensors are read as zeros, if at all
            for tensor in (layer.conv_states[index], layer.recurrent_states[index]):
                if tensor is not None:
                    tensor.zero_()


def trim_conv_states(cache) -> None:
    """Cut every convolution state to its kernel's width: what a layer that does not record its past
    keeps (and what its in-place update expects); done before a cache is handed back."""
    for index in recurrent_layer_indices(cache):
        layer = cache.layers[index]
        for state in range(layer.number_of_states):
            conv, width = layer.conv_states[state], layer.conv_kernel_size[state]
            if conv is not None and width is not None and conv.shape[-1] > width:
                layer.conv_states[state] = conv[..., -width:].contiguous()


def restrict_sliding_layers(cache) -> None:
    """Let sliding layers drop the states outside their window (``crop(0)``; skipped on a layer that
    never saw a token, where 5.23's ``crop(0)`` fails)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
            layer.crop(0)


# --- models -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` can compute logits for the last positions only."""
    return _forward_takes_logits_to_keep(type(model))


def is_stateful(model) -> bool:
    """Whether transformers marks the model as carrying recurrent state that cannot be rolled back
    (``PreTrainedModel._is_stateful``)."""
    return bool(getattr(model, "_is_stateful", False))


def gguf_tensors(gguf_path, model, after_each=None):
    """``(name, float32 tensor)`` for each weight of ``model`` stored in the GGUF file ``gguf_path``,
    one at a time: what ``from_pretrained(..., gguf_file=...)`` loads (transformers'
    ``load_gguf_checkpoint`` with ``return_tensors=True``: gguf's ``dequantize``, transformers'
    tensor processor for the architecture, its GGUF-to-transformers name map), without collecting
    the whole dequantized state dict, and without loading the model: ``model`` only gives the names
    and may live on the meta device. ``after_each(data)`` is called with each GGUF tensor's raw data
    (a view of the memory-mapped file) once its weight has been used, e.g. to give its pages back.

    The weights a tensor processor gathers itself over several GGUF tensors (the experts of a
    mixture of experts) come last, once complete."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)  # the metadata only
    parsed["tensors"] = {}
    reader = GGUFReader(str(gguf_path))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    # 4.57 maps names without the processor (it has no processor argument); later releases take it
    takes_processor = "processor" in inspect.signature(get_gguf_hf_weights_map).parameters
    names = get_gguf_hf_weights_map(model, processor) if takes_processor else get_gguf_hf_weights_map(model)
    for info in reader.tensors:
        result = processor.process(
            weights=dequantize(info.data, info.tensor_type),
            name=info.name,
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        weights, name = result.weights, result.name
        del result
        if name in names:
            if not (weights.flags.writeable and weights.flags.c_contiguous):  # a view of the file
                weights = np.copy(weights)
            tensor = torch.from_numpy(weights).to(torch.float32)
            del weights
            yield names[name], tensor
            del tensor
        else:
            del weights
        if after_each is not None:
            after_each(info.data)
    yield from parsed.pop("tensors").items()


# --- generate -------------------------------------------------------------------------------------
def streamer_of_calling_generate(max_depth: int = 6):
    """The ``streamer`` argument of the `generate` call that invoked our `custom_generate`, or None.

    transformers 5.23 calls ``streamer.put(prompt)`` and then never passes the streamer to a
    `custom_generate` callable (a `TextIteratorStreamer` would wait forever). This walks up a few
    frames (decorators such as ``torch.no_grad`` add some) to the nearest `GenerationMixin.generate`
    frame and reads its local variable.
    """
    return calling_generate_argument("streamer", max_depth + 1)


def assistant_model_of_calling_generate(max_depth: int = 6):
    """The ``assistant_model`` argument of the `generate` call that invoked our `custom_generate`, or None.

    transformers (4.57 - 5.24, `_extract_generation_mode_kwargs`) passes a `custom_generate` callable
    only the arguments its own signature adds to `_sample`'s, so ``assistant_model=`` never reaches
    it and the call would silently decode without that model. ``assistant_model`` is a parameter of
    `GenerationMixin.generate` on every release the package admits: its frame still holds it.
    """
    return calling_generate_argument("assistant_model", max_depth + 1)


def pads_finished_rows(stopping_criteria) -> bool:
    """Whether plain batched `generate` writes pad ids after a row that a stopping criterion ended: only
    when one of its criteria has an ``eos_token_id`` (`_sample`'s ``has_eos_stopping_criteria``, 4.57 -
    5.24). Without one, such a row goes on with the model's own tokens until every row has stopped."""
    return any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)


def prepared_pad_token_id(generation_config):
    """The pad id `generate` settled on (``_pad_token_tensor``, which falls back to EOS), else the
    configured one."""
    prepared = getattr(generation_config, "_pad_token_tensor", None)
    return prepared if prepared is not None else generation_config.pad_token_id


def mark_as_user_config(generation_config) -> None:
    """Make transformers keep custom entries of this generation config when it is reloaded (it drops
    them from a config marked ``_from_model_config``)."""
    generation_config._from_model_config = False


def calling_generate_argument(name: str, max_depth: int = 8):
    """The argument ``name`` of the `generate` call that invoked our `custom_generate`, or None.

    transformers hands a `custom_generate` callable neither ``assistant_model`` nor ``streamer``
    (4.57 - 5.24: the callable's own keyword arguments replace them), so the callable reads them
    from the nearest `GenerationMixin.generate` frame, a few frames up (decorators add some)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
            return frame.f_locals.get(name)
    return None


# --- transformers' own assisted loop (`hf_polybasic.assisted`) ---------------------------------------
class _CandidateGeneratorHook:
    """Stands on a model as ``_get_candidate_generator`` while `assisted_decoding` runs: each thread
    gets the generator it registered for this model, any other caller transformers' own choice."""

    def __init__(self, model):
        self.plain = type(model)._get_candidate_generator.__get__(model)
        self.by_thread: dict[int, list] = {}

    def __call__(self, *args, **kwargs):
        stack = self.by_thread.get(threading.get_ident())
        return stack[-1] if stack else self.plain(*args, **kwargs)


_hooks_lock = threading.Lock()


def assisted_decoding(model, candidate_generator, input_ids: torch.LongTensor, model_kwargs: dict, **loop_arguments):
    """transformers' own assisted loop (``GenerationMixin._assisted_decoding``, one signature from
    4.57 to 5.24) for ``model``, proposing with ``candidate_generator``.

    No release lets a caller hand that loop a `CandidateGenerator`: it asks
    ``self._get_candidate_generator(...)``, looked up on the model. So for the call the model gets an
    instance attribute of that name (removed afterwards, whatever happens) answering each thread with
    the generator it registered: two threads can run this on one model, and anyone else asking
    during the call gets transformers' own choice. ``loop_arguments``: ``logits_processor``,
    ``stopping_criteria``, ``generation_config``, ``synced_gpus``, ``streamer``."""
    thread = threading.get_ident()
    with _hooks_lock:
        hook = vars(model).get("_get_candidate_generator")
        if not isinstance(hook, _CandidateGeneratorHook):
            hook = _CandidateGeneratorHook(model)
            model._get_candidate_generator = hook
        hook.by_thread.setdefault(thread, []).append(candidate_generator)
    try:
        return model._assisted_decoding(input_ids, **loop_arguments, **model_kwargs)
    finally:
        with _hooks_lock:
            stack = hook.by_thread[thread]
            stack.pop()
            if not stack:
                del hook.by_thread[thread]
            if not hook.by_thread and vars(model).get("_get_candidate_generator") is hook:
                del model._get_candidate_generator


def _cache_layout(cache) -> tuple:
    return type(cache), tuple(type(layer) for layer in getattr(cache, "layers", ()))


def use_assisted_loop_cache(model, generation_config, model_kwargs: dict) -> None:
    """Give transformers' assisted loop a cache it can crop: the one its own assisted mode makes.

    `generate` prepares the cache by the generation mode it sees, and a `custom_generate` call is
    "greedy" or "sample" to it: up to 5.13 its assisted mode builds a cache of full layers instead
    of sliding ones (a sliding layer cannot be cropped there) and replaces other implementations
    (quantized, offloaded) with a dynamic cache; 5.14 - 5.23 do the latter. Where the empty cache in
    ``model_kwargs`` is laid out otherwise than that one (``GenerationMixin._prepare_cache_for_generation``
    with ``GenerationMode.ASSISTED_GENERATION``, one signature from 4.57 to 5.24), it is replaced
    (in place). Where that makes none (5.0 leaves the cache to the model's forward, which lays out
    sliding layers: transformers' own assisted generation fails there on a sliding-window model),
    the loop gets `new_dynamic_cache`. A cache that already holds tokens is left alone, as are static
    caches (refused before 5.24, kept by 5.24's assisted mode)."""
    from transformers.generation.configuration_utils import GenerationMode

    name = next((key for key in CACHE_KWARGS if model_kwargs.get(key) is not None), None)
    current = None if name is None else model_kwargs[name]
    if current is not None and (cached_tokens(current) != 0 or is_static_cache(current)):
        return
    prepared: dict = {}
    model._prepare_cache_for_generation(copy.deepcopy(generation_config), prepared,
                                        GenerationMode.ASSISTED_GENERATION, 1, generation_config.max_length - 1)
    key = next((key for key in CACHE_KWARGS if prepared.get(key) is not None), None)
    if key is None:
        if not getattr(model, "_supports_default_dynamic_cache", lambda: True)():
            return  # a model that makes a cache of its own kind (refused targets aside, none the chain meets)
        key = name or ("cache" if CACHE_IS_CALLED_CACHE else "past_key_values")
        prepared[key] = new_dynamic_cache(model)
    if current is None or _cache_layout(prepared[key]) != _cache_layout(current):
        if name is not None:
            del model_kwargs[name]
        model_kwargs[key] = prepared[key]


# --- logits processors ------------------------------------------------------------------------------
# Processors that count positions from the start of the padded batch `generate` saw, with the
# attribute holding the position. A row decoded without its left padding shifts them, so that the
# number of *new* tokens they allow is the batch's (`min_new_tokens` becomes `min_length` there,
# `forced_eos_token_id` fires at `max_length - 1`).
POSITION_ATTRIBUTES: dict[type, str] = {
    lp.MinLengthLogitsProcessor: "min_length",
    lp.MinNewTokensLengthLogitsProcessor: "prompt_length_to_skip",
    lp.ExponentialDecayLengthPenalty: "regulation_start",
    lp.SuppressTokensAtBeginLogitsProcessor: "begin_index",
    lp.ForcedEOSTokenLogitsProcessor: "max_length",
}


def logits_processor_classes(*names: str) -> tuple[type, ...]:
    """The processor classes of these names that this transformers release has (e.g.
    ``TopHLogitsWarper`` exists from 5.0 on)."""
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


# Processors that skip the first tokens of each row, with the attribute holding how many: shifted
# like positions, but never below 0 (a negative count would count from the end).
# ``RepetitionPenaltyLogitsProcessor.prompt_ignore_length``: an int (the user's, of the padded
# batch) or, from transformers 5.x's `generate`, one count per row (each row's left padding).
SKIPPED_PREFIX_ATTRIBUTES: dict[type, str] = {lp.RepetitionPenaltyLogitsProcessor: "prompt_ignore_length"}


def _repetition_penalty_skips_row_padding() -> bool:
    """Whether this release's `generate` makes the repetition penalty skip each row's left padding
    (one ``prompt_ignore_length`` per row). Before it (<= 5.14 at least), plain batched `generate`
    also penalizes the pad id in a padded row's prompt, so its rows can differ from the same rows
    generated alone; a chain decodes every row as it is generated alone on every release."""
    try:
        lp.RepetitionPenaltyLogitsProcessor(1.1, prompt_ignore_length=torch.tensor([0]))
    except (TypeError, ValueError):
        return False
    return True


REPETITION_PENALTY_SKIPS_ROW_PADDING = _repetition_penalty_skips_row_padding()


# Processors that read the length of the prefix they are handed, not its tokens (4.57 - 5.24:
# `ForcedBOSTokenLogitsProcessor` forces BOS where that length is 1): in a padded batch they count the
# row's padding too, so a row decoded without it hands them a prefix with the padding put back.
LENGTH_READING_PROCESSORS: tuple[type, ...] = (lp.ForcedBOSTokenLogitsProcessor,)


class _LeftPadded(lp.LogitsProcessor):
    """``processor`` handed every prefix behind ``padding`` pad ids: the length the padded batch gave it."""

    def __init__(self, processor: lp.LogitsProcessor, padding: int):
        self.processor, self.padding = processor, padding

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.processor(torch.nn.functional.pad(input_ids, (self.padding, 0)), scores)


def shift_positions(processor: lp.LogitsProcessor, shift: int) -> lp.LogitsProcessor:
    """``processor`` with its absolute positions moved ``shift`` tokens earlier (a copy), or itself
    when it counts none. A count of skipped leading tokens shrinks by ``shift`` down to 0; a
    processor that reads the prefix's length sees it with the ``shift`` pads back in front."""
    if shift != 0 and type(processor) in LENGTH_READING_PROCESSORS:
        return _LeftPadded(processor, shift)
    attribute = POSITION_ATTRIBUTES.get(type(processor))
    if attribute is not None and shift != 0:
        shifted = copy.copy(processor)
        setattr(shifted, attribute, getattr(processor, attribute) - shift)
        return shifted
    attribute = SKIPPED_PREFIX_ATTRIBUTES.get(type(processor))
    value = None if attribute is None else getattr(processor, attribute, None)
    if isinstance(value, int) and shift != 0:
        shifted = copy.copy(processor)
        setattr(shifted, attribute, max(value - shift, 0))
        return shifted
    return processor


def processor_for_row(processor: lp.LogitsProcessor, row: int, prompt: torch.LongTensor) -> lp.LogitsProcessor:
    """``processor`` for row ``row`` of the (expanded) batch decoded alone, as a batch of one whose
    prompt is ``prompt`` ``[L]`` (without its left padding); itself when it holds nothing per row.

    * `PrefixConstrainedLogitsProcessor`: the user's function gets the row's index as ``batch_id``,
      as in the batched `generate` (``_prefix_allowed_tokens_fn``, ``_num_beams``);
    * `EncoderRepetitionPenaltyLogitsProcessor` / `EncoderNoRepeatNGramLogitsProcessor`: they hold the
      whole batch's prompts (``encoder_input_ids``), and see the row's own;
    * `RepetitionPenaltyLogitsProcessor` with one ``prompt_ignore_length`` per row (transformers 5.x
      passes each row's left padding): the row's own count, as an int (`shift_positions` then
      removes the padding the row lost).
    """
    if isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
        function = processor._prefix_allowed_tokens_fn
        view = copy.copy(processor)
        view._prefix_allowed_tokens_fn = lambda batch_id, sent: function(row, sent)
        view._num_beams = 1
        return view
    if isinstance(processor, lp.EncoderRepetitionPenaltyLogitsProcessor):
        view = copy.copy(processor)
        view.encoder_input_ids = prompt.unsqueeze(0).to(processor.encoder_input_ids.device)
        return view
    if isinstance(processor, lp.EncoderNoRepeatNGramLogitsProcessor):
        return type(processor)(processor.ngram_size, prompt.unsqueeze(0))
    attribute = SKIPPED_PREFIX_ATTRIBUTES.get(type(processor))
    value = None if attribute is None else getattr(processor, attribute, None)
    if isinstance(value, torch.Tensor):  # one count per row of the (expanded) batch: this row's
        view = copy.copy(processor)
        setattr(view, attribute, int(value[row]) if value.dim() else int(value))
        return view
    return processor


def processor_on_device(processor: lp.LogitsProcessor, device: torch.device) -> lp.LogitsProcessor:
    """``processor`` with the tensors it holds (EOS ids, suppressed tokens, epsilon, ...) on ``device``
    (a copy), or itself when it holds none elsewhere. `generate` builds processors on the device of
    ``input_ids``; a chain decodes where its target runs."""
    moved = {
        name: value.to(device)
        for name, value in vars(processor).items()
        if isinstance(value, torch.Tensor) and value.device != torch.device(device)
    }
    if not moved:
        return processor
    view = copy.copy(processor)
    for name, value in moved.items():
        setattr(view, name, value)
    return view


# transformers' values for options that neither the call nor the model's generation config sets
DECODING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}


def resolved_decoding(target, **options) -> dict[str, Any]:
    """The decoding settings as `generate` resolves them: the call's value, else the target's
    generation config, else transformers' default (e.g. top_k=50 when sampling)."""
    config = getattr(target, "generation_config", None)
    do_sample = options.get("do_sample")
    resolved = {"do_sample": bool(getattr(config, "do_sample", False) if do_sample is None else do_sample)}
    for name, default in DECODING_DEFAULTS.items():
        value = options.get(name)
        if value is None:
            value = getattr(config, name, None)
        resolved[name] = default if value is None else value
    return resolved


def decoding_processors(decoding: Mapping[str, Any]) -> lp.LogitsProcessorList:
    """The logits processors `generate` builds for these options, in its order (repetition penalty,
    then the sampling warpers: temperature, top-k, top-p, min-p)."""
    processors = lp.LogitsProcessorList()
    if decoding.get("repetition_penalty") not in (None, 1.0):
        processors.append(lp.RepetitionPenaltyLogitsProcessor(decoding["repetition_penalty"]))
    if decoding.get("do_sample"):
        if decoding.get("temperature") not in (None, 1.0):
            processors.append(lp.TemperatureLogitsWarper(decoding["temperature"]))
        if decoding.get("top_k") not in (None, 0):
            processors.append(lp.TopKLogitsWarper(top_k=decoding["top_k"], min_tokens_to_keep=1))
        if decoding.get("top_p") is not None and decoding["top_p"] < 1.0:
            processors.append(lp.TopPLogitsWarper(top_p=decoding["top_p"], min_tokens_to_keep=1))
        if decoding.get("min_p") is not None:
            processors.append(lp.MinPLogitsWarper(min_p=decoding["min_p"], min_tokens_to_keep=1))
    return processors


# --- torch: oneDNN's prepacked linear (private ops of torch.ops.mkldnn) -----------------------------
ONEDNN_BATCH_HINT = 8  # rows the packed layout is tuned for; 4 .. 64 measure alike for 1 .. 16 rows


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run oneDNN's prepacked linear in ``dtype`` (fp32 on any
    x86 CPU with oneDNN; bf16 only with AVX-512 (bw, vl, dq) or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    return False


def onednn_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_BATCH_HINT)


def onednn_linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``inputs @ weight.T + bias`` with a weight packed by `onednn_pack_weight`; inputs ``[rows, in]``."""
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")


# --- trained draft heads ---------------------------------------------------------------------------------
try:  # transformers >= 5.14: a model's native multi-token-prediction layers as a module of their own
    from transformers.modeling_layers import MtpModel as _MtpModel
except ImportError:  # pragma: no cover - older releases
    _MtpModel = None
MTP_SINCE = "5.14"


def mtp_model_class():
    """transformers' `MtpModel`, or None where the release lacks it (before `MTP_SINCE`)."""
    return _MtpModel


def causal_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache, position_ids: torch.Tensor):
    """transformers' own causal mask for a decoder layer of ``config`` (a 4-D mask given is returned as
    it is, a 2-D one over the cache's slots and the new tokens applied), as the releases with `MtpModel`
    (>= `MTP_SINCE`) take its arguments: config, embeddings, mask, cache, positions."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids)


def layer_cache_kwargs(cache) -> dict:
    """``cache`` under the keyword a decoder layer takes it by: ``cache`` (>= 5.24), ``past_key_values`` (before)."""
    return {"cache" if CACHE_IS_CALLED_CACHE else "past_key_values": cache}


def is_output_capturing_hook(hook) -> bool:
    """Whether ``hook`` is one transformers (>= 5.0) leaves on a model's layers the first time hidden states
    are asked of it: it records outputs only while a forward asked for them (``output_hidden_states``) and
    does nothing otherwise, so a compiled forward traces through it."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and getattr(hook, "__module__", "").startswith(
        "transformers.")
