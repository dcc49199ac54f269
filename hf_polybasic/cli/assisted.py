"""transformers' own assisted generation, as the tools compare against it.

transformers reads an assistant's settings (``num_assistant_tokens``, its schedule, the confidence
threshold) from the *assistant's* generation config, not from ``generate``'s arguments, and its
heuristic schedule writes back into it. `assisted_generate` sets them for one call and restores
them afterwards, so a comparison never changes the models it compares.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers

# assistant generation-config fields set for one call and then restored
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def assistant_settings(num_assistant_tokens: int | None, schedule: str = "constant", confidence: float = 0.0) -> dict:
    """The fields for a fixed draft length K (no confidence threshold), or transformers' own
    defaults (no field set) for ``num_assistant_tokens=None``."""
    if num_assistant_tokens is None:
        return {}
    return {
        "num_assistant_tokens": num_assistant_tokens,
        "num_assistant_tokens_schedule": schedule,
        "assistant_confidence_threshold": confidence,
    }


@contextmanager
def configured_assistant(assistant: torch.nn.Module, settings: dict) -> Iterator[None]:
    """``assistant.generation_config`` with ``settings`` for the block, as it was afterwards; its
    per-call notice about the generation config is silenced."""
    config = assistant.generation_config
    saved = {key: getattr(config, key, None) for key in ASSISTANT_FIELDS}
    for key, value in settings.items():
        setattr(config, key, value)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        for key, value in saved.items():
            setattr(config, key, value)


def assisted_generate(target, assistant, settings: dict, **generate_options):
    """``target.generate(assistant_model=assistant, ...)`` with the assistant's ``settings`` for this
    call only (see `assistant_settings`)."""
    with configured_assistant(assistant, settings):
        return target.generate(assistant_model=assistant, **generate_options)
