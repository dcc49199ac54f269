"""Warnings said at the user's line, whatever the depth of the call that warns.

A warning's ``stacklevel`` counted by hand points somewhere else as soon as the call it is said in
runs at another depth (a target's runner is made inside torch's ``no_grad`` wrapper, an assistant's
is not). `warn` finds the line instead: the first frame outside hf_polybasic and the libraries it
runs inside (torch, transformers, the standard library's context-manager and ``functools`` wrappers).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch
import transformers

_INSIDE = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                for path in (__file__, torch.__file__, transformers.__file__)) + (contextlib.__file__, functools.__file__)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first line of the call stack outside the package and
    the libraries it runs inside."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
