"""Stream results into a file-backed ``out=`` (a NumPy memmap) without growing resident memory.

NOTE: [Writing a memmap through its file]
Pages written through a shared file mapping stay mapped, and count as the process's resident
memory, until the kernel needs them back; and every first touch of a page is a page fault, which
made writing 1.3 GB through the mapping 2.3x slower than filling a fresh tensor. So when
/proc/self/maps shows that ``out`` lies in a shared mapping of a regular file, each batch is
computed into one reused in-memory buffer and written to the file with ``os.pwrite`` at the
offset of its rows, by a background thread while the next batch is computed. Linux keeps one page cache per file, so the mapping (and anyone who opens
the file) reads the new values at once; ``flush()`` of the memmap has nothing left to do.
Rows that are not contiguous (a ``DistributedSampler``'s stride) are copied through the mapping
and their pages dropped from this process with ``madvise(MADV_DONTNEED)``, which on a shared
file mapping keeps the data (on anonymous memory it would zero it, hence the check).
Elsewhere than Linux nothing of this applies and ``out`` is written like any tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from torch import Tensor

_MADV_DONTNEED = 4


def file_region(t: Tensor) -> Optional[tuple[str, int]]:
    """(path, file offset of ``t``'s first byte) if ``t`` lies in a shared file mapping (Linux)."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.numel() == 0:
        return None
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(a, 16) for a in fields[0].split("-"))
                if start <= lo < end:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    shared_file = (hi <= end and fields[1][3] == "s" and path.startswith("/")
                                   and not path.startswith(("/dev/", "/memfd:", "/SYSV"))
                                   and os.path.isfile(path))
                    return (path, lo - start + int(fields[2], 16)) if shared_file else None
    except OSError:
        return None
    return None


class FileWriter:
    """Writes contiguous rows of a file-backed tensor with ``os.pwrite`` (see the NOTE).

    Double-buffered: the rows of one batch are written by a background thread (``pwrite``
    releases the GIL) while the next batch is computed into the other buffer.
    """

    def __init__(self, out: Tensor, region: tuple[str, int]) -> None:
        self.out = out
        self.row_bytes = out[0].numel() * out.element_size() if len(out) else 0
        self.offset = region[1]
        self.fd = os.open(region[0], os.O_WRONLY)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jacmode-write")
        self._slots: list[tuple[Optional[Tensor], Optional[Future[None]]]] = [(None, None)] * 2
        self._turn = 0

    def buffer(self, count: int) -> Tensor:
        """A (count, *row) buffer whose previous write has finished."""
        buf, pending = self._slots[self._turn]
        if pending is not None:
            pending.result()
        if buf is None or len(buf) < count:
            buf = self.out.new_empty((count, *self.out.shape[1:]))
        self._slots[self._turn] = (buf, None)
        return buf[:count]

    def write(self, first_row: int, value: Tensor) -> None:
        """Start writing ``value`` into rows ``first_row, ...`` of the file."""
        value = value.detach().contiguous()
        pending = self._pool.submit(self._pwrite, self.offset + first_row * self.row_bytes, value)
        self._slots[self._turn] = (self._slots[self._turn][0], pending)
        self._turn ^= 1

    def _pwrite(self, at: int, value: Tensor) -> None:
        data = memoryview(value.numpy()).cast("B")  # type: ignore[arg-type]
        while len(data):
            n = os.pwrite(self.fd, data, at)
            data, at = data[n:], at + n

    def close(self) -> None:
        """Wait for every write (raising the first error), then close the file."""
        try:
            for _, pending in self._slots:
                if pending is not None:
                    pending.result()
        finally:
            self._pool.shutdown()
            os.close(self.fd)


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
