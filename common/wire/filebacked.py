"""Receive buffers backed by an unnamed file, so that a large reply waits in the page cache, not
in the process's memory.

A streamed round folds each reply into one accumulator (common/processors/streaming.py), but a
reply is verified whole (sizes, XXH3, finiteness) before any of it is added: an addition cannot
be undone bit for bit.  So the server holds, besides its model and the accumulator, the reply
being verified and folded: a third model.  `FileBuffers.take` puts that reply in a file instead
(an unnamed temporary file, `O_TMPFILE`, in the run folder): the decoder writes each frame to
the file (`FileSink.write`, pwrite: the pages stay in the page cache, outside the process), and
once the message is whole maps the file as its buffer.  The reply's tensors are ordinary
tensors over that shared mapping, so every processor sees them as before; the loops that read
a large reply piece by piece (the finiteness check, max |t|, the fold) call `release` after
each piece (`madvise(MADV_DONTNEED)`: for a shared file mapping the bytes stay in the file and a
later read maps them back, an in-place change included), so the reply is never resident whole.
Nothing else changes: the same bytes, the same checks in the same order, the same sums.

The file has no name, so nothing is left behind by a process that dies; its blocks are reserved
when it is made (`posix_fallocate`) and freed with the last tensor over the mapping.  A buffer
that cannot be made there (a filesystem without `O_TMPFILE`, such as NFS, or not enough free
space for the reply) is made in the system's temporary folder, or else is an ordinary one from
memory; a write that fails midway moves the message to memory (`FileSink.to_memory`).  The
pages wait in the page cache: memory the kernel writes back to disk and reclaims under
pressure, not the process's (a run folder on tmpfs gains nothing, its files are memory).
"""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)

# the mapping behind each file-backed buffer, by its first byte's address
_MAPPINGS: dict[int, mmap.mmap] = {}
_LOCK = threading.Lock()


def supported() -> bool:
    """Whether this platform can give a mapping's pages back (`madvise`) and make unnamed files."""
    return _DONTNEED is not None and hasattr(mmap.mmap, "madvise") and hasattr(os, "O_TMPFILE")


class FileBuffers:
    """Receive buffers for messages of at least `min_bytes`, each in its own unnamed file in
    `directory` (None: the system's temporary folder); smaller ones, and any that cannot be made
    in a file, come from `fallback` (a `RecvBuffers`)."""

    def __init__(self, directory: str | Path | None, min_bytes: int, fallback) -> None:
        self.directory = str(directory) if directory is not None else tempfile.gettempdir()
        self.min_bytes = min_bytes
        self.fallback = fallback
        self.made = 0   # buffers made in files (tests, the round's memory summary)

    def take(self, nbytes: int) -> "np.ndarray | FileSink":
        if nbytes < self.min_bytes or not supported():
            return self.fallback.take(nbytes)
        sink = FileSink.open(self.directory, nbytes, self.fallback)
        if sink is None and self.directory != tempfile.gettempdir():
            sink = FileSink.open(tempfile.gettempdir(), nbytes, self.fallback)
        if sink is None:
            return self.fallback.take(nbytes)
        self.made += 1
        return sink


class FileSink:
    """One message's data bytes in an unnamed file: written as they arrive (`write`, pwrite: the
    pages never enter the process), then mapped as the message's buffer (`array`)."""

    def __init__(self, fd: int, nbytes: int, fallback) -> None:
        self.fd, self.nbytes, self.fallback = fd, nbytes, fallback
        self._close = weakref.finalize(self, os.close, fd)   # an abandoned message's file goes with it

    @classmethod
    def open(cls, directory: str, nbytes: int, fallback) -> "FileSink | None":
        """A sink of `nbytes` in `directory`; None when the folder cannot hold it."""
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError:   # no such folder, or a filesystem without O_TMPFILE (NFS)
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)   # the blocks reserved now: a full disk shows here
        except OSError:
            os.close(fd)
            return None
        return cls(fd, nbytes, fallback)

    def write(self, offset: int, data: memoryview) -> None:
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def to_memory(self, filled: int) -> np.ndarray:
        """The message moved to a buffer from memory, its first `filled` bytes read back (a write
        that failed: the rest arrives there)."""
        buf = self.fallback.take(self.nbytes)
        view, got = memoryview(buf), 0
        while got < filled:
            n = os.preadv(self.fd, [view[got:filled]], got)
            if n <= 0:
                raise OSError(f"reading back a receive file: {filled - got} bytes missing")
            got += n
        self._close()
        return buf

    def array(self) -> np.ndarray:
        """The file as a writable array over a shared mapping (its pages enter the process as
        they are read); the file descriptor is closed, the mapping keeps the file."""
        try:
            mapping = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            self._close()
        buf = np.frombuffer(mapping, dtype=np.uint8)
        base = buf.ctypes.data
        with _LOCK:
            _MAPPINGS[base] = mapping
        weakref.finalize(buf, _forget, base)
        return buf

    def close(self) -> None:
        self._close()


def _forget(base: int) -> None:
    with _LOCK:
        _MAPPINGS.pop(base, None)


def file_backed(t: torch.Tensor) -> bool:
    """Whether `t` lies in a file-backed receive buffer."""
    return bool(_MAPPINGS) and t.device.type == "cpu" and t.untyped_storage().data_ptr() in _MAPPINGS


def release(t: torch.Tensor, start: int, stop: int) -> None:
    """Give back the whole pages of elements [start, stop) of the flat, contiguous `t` when `t`
    lies in a file-backed buffer (a no-op otherwise): a loop that reads a large reply piece by
    piece calls it after each piece.  Their contents stay in the file."""
    if not _MAPPINGS or t.device.type != "cpu":
        return
    base = t.untyped_storage().data_ptr()
    mapping = _MAPPINGS.get(base)
    if mapping is None or _DONTNEED is None:
        return
    offset, size = t.data_ptr() - base, t.element_size()
    first = -(-(offset + start * size) // PAGE) * PAGE
    end = offset + stop * size
    last = end // PAGE * PAGE if end < len(mapping) else len(mapping)
    if last > first:
        mapping.madvise(_DONTNEED, first, last - first)


def file_buffers_on() -> bool:
    """FEDHOP_FILE_BUFFERS=0 receives every reply in memory (before/after comparisons, and a
    process whose run folder is on a slow disk); anything else, or unset, uses files where the
    platform can."""
    return os.environ.get("FEDHOP_FILE_BUFFERS", "1") != "0" and supported()
