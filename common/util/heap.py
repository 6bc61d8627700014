"""Giving the heap's free memory back to the system after a burst of large sends.

Processes that move models run with glibc's trim threshold raised (deploy/malloc.py): a freed
4 MiB frame stays in the heap for the next message instead of costing its page faults again.
The price is that the heap keeps its high-water mark.  A server sends its model to every
sampled client at once: each send has a few frames in flight (cut ahead, and gRPC's copy), so
the heap grows by a few frames per client while the broadcast lasts, and without a trim it would
hold that memory through the fold, whose accumulator is then the round's peak on top of it
(docs/performance.md, "Pulled replies").

`SendBurst` counts the large sends in flight; when the last one ends, after at least
`TRIM_AFTER_BYTES` were sent since the last trim, `malloc_trim(0)` returns the free pages of
every arena to the system (glibc >= 2.8 also releases free pages inside the heap, not only its
top).  One trim per burst: a round of small messages never trims, and the next burst's faults
are paid once per round, not per message.  Where the C library has no `malloc_trim` (musl,
macOS) nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

#: sends smaller than this (in all, since the last trim) leave the heap as it is
TRIM_AFTER_BYTES = 64 << 20


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class SendBurst:
    """Large sends in flight (module docstring); thread-safe."""

    def __init__(self, trim_after_bytes: int = TRIM_AFTER_BYTES) -> None:
        self.trim_after_bytes = trim_after_bytes
        self._lock = threading.Lock()
        self._in_flight = 0
        self._sent = 0          # bytes sent since the last trim
        self.trims = 0

    def begin(self) -> None:
        with self._lock:
            self._in_flight += 1

    def end(self, sent_bytes: int) -> None:
        """One send ended (finished or not) after `sent_bytes`; the last of a large burst trims."""
        with self._lock:
            self._in_flight -= 1
            self._sent += sent_bytes
            due = self._in_flight == 0 and self._sent >= self.trim_after_bytes
            if due:
                self._sent = 0
                self.trims += 1
        if due:
            trim_heap()
