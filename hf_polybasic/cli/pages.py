"""Giving memory back to the kernel while models are converted and loaded: the pages of a tensor
read from a memory-mapped file (`release_file_pages`) and the heap the process has freed
(`release_freed_heap`). `loading` and `models` (the GGUF conversion) both use them; neither
imports the other for them.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's memory mappings that are backed by a file."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def release_file_pages(tensor) -> bool:
    """Hand the pages of a tensor (torch, or a numpy array such as a view of an ``np.memmap``) that
    lives in a memory-mapped *file* back to the kernel (Linux ``madvise(MADV_DONTNEED)``); True if
    it did. Safe for clean file-backed pages: read again, they come back from the file unchanged.
    Anonymous memory is never touched (there it would zero the data), nor is anything on systems
    without /proc."""
    if not sys.platform.startswith("linux"):
        return False
    if isinstance(tensor, torch.Tensor):
        if tensor.device.type != "cpu":
            return False
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    else:
        start, size = tensor.ctypes.data, tensor.nbytes
    end = start + size
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
    if last <= first or not any(low <= start and end <= high for low, high in _file_mappings()):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0


def release_freed_heap() -> bool:
    """Hand the heap memory this process has freed back to the kernel (glibc ``malloc_trim(0)``);
    True if it did. Freed memory otherwise stays resident: converting a GGUF leaves about 1 GiB of
    it (millions of small objects from reading the GGUF's metadata), which would add to every model
    loaded after it. Does nothing where the C library has no ``malloc_trim`` (not glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
    return bool(trim(0)) if trim is not None else False
