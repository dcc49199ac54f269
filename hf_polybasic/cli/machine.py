"""The machine a measurement ran on: CPU, cores, memory, library versions, git commit, command line.

Every number the tools write is stored next to this description, because cost ratios measured on
one machine do not carry over to another.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from ..costs.hardware import describe_machine


def command_line() -> str:
    """This process's command line, as typed (``python -m benchmarks.bench ...`` for a module run with -m)."""
    program = sys.argv[0] if sys.argv else "python"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if program.endswith("__main__.py") and spec is not None:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = [Path(program).name]
    return shlex.join(head + sys.argv[1:])


def machine_info() -> dict:
    """CPU model, cores, memory, library versions, git commit and load at the start of the run."""
    import transformers

    from .. import __version__

    info = {
        **describe_machine(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_polybasic": __version__,
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["psutil"] = psutil.__version__
    except ImportError:  # pragma: no cover
        pass
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    info.update(_git_state())
    return info


def _git_state() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": bool(dirty)}
