"""The CPU's KV cache in 2 MiB pages where Linux allows them (transparent huge pages).

The decode attention reads each sequence's blocks (2 KiB per KV head at block size 16) from
anywhere in a layer's cache: in 4 KiB pages nearly every block is a page of its own, likely a
TLB miss besides the cache miss. Many distributions run THP in `madvise` mode (the Zen 5 measured
below did), so a tensor gets huge pages only if it asks before its pages are first touched.
Measured on a Zen 5 (two threads, 211 decode rows of 144-208 tokens, 30 layers' caches read in
turn): scratch, the least of 9, 1.23-1.24 -> 1.11-1.15 ms a layer; `benchmarks/cpu_kernels.py`,
the two commits in turns, 3-9%. Where THP is `never` the advice changes nothing, and a kernel
without THP refuses it: the cache is then the same tensor in small pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory starts on a 2 MiB boundary and was advised into huge pages
    before it was written. Returns an ordinary tensor (a view of a slightly larger buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # The KV cache is allocated at start-up, most likely in memory fresh from the OS; a page that
    # was touched before keeps its 4 KiB frames until khugepaged merges them.
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    length = (buffer.numel() - start) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if _madvise(buffer.data_ptr() + start, length, MADV_HUGEPAGE) != 0:
        logger.debug("the kernel refused huge pages for the KV cache (errno %d): small pages", ctypes.get_errno())
    tensor = buffer[start : start + nbytes].view(dtype).view(shape)
    return tensor.zero_()


def _madvise(address: int, length: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, advice)
