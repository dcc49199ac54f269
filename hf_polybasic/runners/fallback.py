"""Compiled forwards that fail: the model's forwards run uncompiled from then on, said once.

Compiling a model's forward (dynamo's tracing, inductor's and Triton's code generation), capturing it
as a CUDA graph or replaying one can raise where the plain forward runs: an operator dynamo cannot
trace, a compiler bug of a newer torch, a call a capture forbids, dynamo's recompile limit. That is
the compiler's failure, not the user's: the static runner (`hf_polybasic.runners.static`) runs the
same forward again uncompiled on the same cache, and every later forward of that model, in every
call of the process, uncompiled (`compile_failure`), said in one warning that names the model and
the cause (`record_failure`). Where the uncompiled forward raises too, the forward itself is at
fault, and its error is the user's, as it would be in plain `generate`.

The re-run is exact: a forward writes its tokens' keys and values at its write slots only (whatever
a failed one wrote there, a value or garbage, is written again before any query reads it), and a
runner's lengths move only once a forward has returned.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..user_warnings import warn

# why compiled forwards of a model failed, per model object (for the rest of the process)
_failures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
CAUSE_LENGTH = 300  # characters of an error's message a warning quotes


def compile_failure(model: torch.nn.Module) -> str | None:
    """Why compiled forwards of ``model`` failed in this process (its forwards then run uncompiled), or None."""
    with _lock:
        return _failures.get(model)


def describe(error: BaseException) -> str:
    """``error`` in one line: its type and message (dynamo's name the error inside on their second line),
    cut to `CAUSE_LENGTH` characters."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= CAUSE_LENGTH else text[: CAUSE_LENGTH - 3] + "..."


def record_failure(model: torch.nn.Module, role: str, error: BaseException) -> str:
    """Remember that a compiled forward of ``model`` (``role`` names it) raised ``error`` while its plain
    forward ran; the first time for this model, say so in a warning. Returns the cause, as remembered."""
    with _lock:
        known = _failures.get(model)
        first = known is None
        if first:
            _failures[model] = known = describe(error)
    if first:
        warn(
            f"hf_polybasic: a compiled forward of {role} failed ({known}); its forwards now run uncompiled on the "
            "same static cache, for the rest of this process: the output is unchanged, only slower. polybasic_stats "
            "shows its runner as 'static, compile failed'. Set PolybasicConfig(compile=False) to skip compiling"
        )
    return known
