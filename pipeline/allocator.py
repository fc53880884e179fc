"""The process's memory allocator: large freed buffers kept mapped for reuse (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


def keep_freed_buffers_mapped() -> bool:
    """Ask glibc to keep freed large buffers in the heap (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD
    2 GiB) instead of unmapping each one, unless the user set MALLOC_MMAP_THRESHOLD_ already.
    A decoded sample at the flagship width is ~150 MB; by default each one is a fresh mmap that
    page-faults in as the decoder writes it, which measured 10-45% off the read rate here
    (BENCHMARKS.md, issue 15); the training step's activations and gradients are such buffers too
    (issue 32: at the flagship width, a third of a CPU step). For the trainer's process; returns
    whether it applied."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))
