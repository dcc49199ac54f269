"""What crosses between the host and the device, and when the host waits for it.

On a GPU the host queues work and runs ahead; it waits for the queue when it reads a value back
(``.tolist()``, ``.item()``, ``bool(t)``) and when it copies host data into a device tensor from
pageable memory (the copy ends in a stream synchronization). A decoding round on a GPU therefore
reads back once per verification and uploads nothing blocking: forward inputs go up from pinned
memory without waiting (`upload`), and a model drafter reads nothing itself (`reads_wait`): the
level above reads its drafts with its own decision and the drafter's block is cut after that read,
not after every token. On the CPU neither costs anything: the work has already run.

``tests/test_host_reads.py`` counts both kinds of wait, on the CPU, under a GPU's rules.
"""

from __future__ import annotations

import torch


def reads_wait(device: torch.device | str) -> bool:
    """Whether reading a value of ``device`` back to the host waits for work queued there (every
    device but the CPU, whose work has run by the time the host reads)."""
    return torch.device(device).type != "cpu"


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a tensor the host just built) on ``device`` without the host waiting: through
    pinned memory, copied asynchronously (PyTorch's pinned-memory pool keeps the buffer until the
    copy has run). On the CPU, ``host`` itself."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
