"""Every use of transformers internals lives here, each behind a version check and a test.

* `trim_sliding_layer_tail`: writes `DynamicSlidingWindowLayer.keys/values/cumulative_length`
  (see `hf_polybasic.cache` for why `crop` cannot be used). Tested by the sliding-window greedy
  equality tests.
* `streamer_of_calling_generate`: reads the local variable ``streamer`` of the
  `GenerationMixin.generate` frame that called a `custom_generate` callable, because transformers
  5.23 never passes the streamer to such callables (it calls ``streamer.put(prompt)`` and then
  drops it, so a `TextIteratorStreamer` would wait forever). Tested by the streamer tests.
* `prepared_pad_token_id`: `GenerationConfig._pad_token_tensor`, the pad id `generate` settled on
  (it falls back to EOS). Tested by the batch tests.
* `mark_as_user_config`: clears `GenerationConfig._from_model_config`, without which transformers
  drops custom entries on reload. Tested by the save/reload test.
* `is_stateful`: `PreTrainedModel._is_stateful` (recurrent models). Tested by the error tests.
"""

from __future__ import annotations

import sys
import warnings

import transformers
from packaging.version import Version
from transformers.cache_utils import DynamicSlidingWindowLayer

TESTED_TRANSFORMERS = (Version("5.23.0"), Version("5.24.0"))  # [low, high)
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


def trim_sliding_layer_tail(layer: DynamicSlidingWindowLayer, tokens_to_remove: int) -> None:
    """Drop the last ``tokens_to_remove`` states of a past-recording sliding layer, keeping the rest."""
    if tokens_to_remove <= 0 or not layer.is_initialized:
        return
    stored = layer.keys.shape[-2]
    if tokens_to_remove > stored:
        raise RuntimeError(
            f"cannot roll back {tokens_to_remove} tokens of a sliding-window layer that stores {stored}; "
            "this is a bug in hf_polybasic (past recording should have kept them)"
        )
    layer.keys = layer.keys[..., :-tokens_to_remove, :]
    layer.values = layer.values[..., :-tokens_to_remove, :]
    layer.cumulative_length -= tokens_to_remove


def streamer_of_calling_generate(max_depth: int = 6):
    """The ``streamer`` argument of the `generate` call that invoked our `custom_generate`, or None.

    Walks up a few frames (decorators such as ``torch.no_grad`` add some) to the nearest
    `GenerationMixin.generate` frame.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
            return frame.f_locals.get("streamer")
    return None


def prepared_pad_token_id(generation_config):
    """The pad id `generate` prepared (a tensor or None), else the configured one."""
    prepared = getattr(generation_config, "_pad_token_tensor", None)
    return prepared if prepared is not None else generation_config.pad_token_id


def mark_as_user_config(generation_config) -> None:
    """Make transformers keep custom entries of this generation config when it is reloaded."""
    generation_config._from_model_config = False


def is_stateful(model) -> bool:
    """Whether transformers marks the model as carrying recurrent state that cannot be rolled back."""
    return bool(getattr(model, "_is_stateful", False))
