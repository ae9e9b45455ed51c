"""Keep resident memory flat while results stream into a file-backed ``out=`` (a NumPy memmap).

NOTE: [Releasing written pages of a memmap]
Pages written through a shared file mapping stay mapped, and count as the process's resident
memory, until the kernel needs them back: writing 1.3 GB into a memmap makes the process 1.3 GB
large. After a batch is written, ``madvise(MADV_DONTNEED)`` drops the written pages from this
process; for a *shared file* mapping the data stays in the page cache and reaches the file
(mapped again, the pages read the written values). On anonymous memory the same call would
zero the data, so it is only made when /proc/self/maps shows the tensor lies in a shared
mapping of a regular file. Linux only; elsewhere nothing is released (still correct).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Optional

from torch import Tensor

_MADV_DONTNEED = 4


def file_backed(t: Tensor) -> bool:
    """Whether all of ``t``'s memory lies in one shared mapping of a regular file (Linux)."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.numel() == 0:
        return False
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(a, 16) for a in fields[0].split("-"))
                if start <= lo < end:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return (hi <= end and fields[1][3] == "s" and path.startswith("/")
                            and not path.startswith(("/dev/", "/memfd:", "/SYSV")))
    except OSError:
        return False
    return False


_libc: Optional[ctypes.CDLL] = None


def release(t: Tensor) -> None:
    """Drop the whole pages inside contiguous ``t`` from resident memory (see the NOTE)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
