"""How a model is named in error messages, warnings and statistics."""

from __future__ import annotations

import torch


def model_label(model: torch.nn.Module) -> str:
    """A short name for error messages and statistics, e.g. 'Qwen2ForCausalLM(qwen2.5-coder-0.5b)'
    (the last part of ``config.name_or_path``, when there is one)."""
    name = str(getattr(getattr(model, "config", None), "name_or_path", "") or "").rstrip("/").split("/")[-1]
    return f"{type(model).__name__}({name})" if name else type(model).__name__
