"""Giving the heap's free memory back to the system after a burst of large sends.

Processes that move models run with glibc's trim threshold raised (deploy/launch/malloc.py): a freed
4 MiB frame stays in the heap for the next message instead of costing its page faults again.
The price is that the heap keeps its high-water mark.  A server sends its model to every
sampled client at once: each send has two frames in flight (the one cut for it, and gRPC's copy), so
the heap grows by a few frames per client while the broadcast lasts, and without a trim it would
hold that memory through the fold, whose accumulator is then the round's peak on top of it
(docs/performance.md, "Pulled replies").

`SendBurst` counts the large sends in flight and what each left in the heap: the frames it
had in memory at once besides those its message keeps (`transient_bytes`: the frame being cut or
sent and gRPC's copy of it; frames a message keeps are still referenced when its
send ends, so no trim could free them then).  When the last send of a burst ends and the burst
left at least `TRIM_AFTER_BYTES`, `malloc_trim(0)` returns the free pages of every arena to the
system (glibc >= 2.8 also releases free pages inside the heap, not only its top).  A lone send of
a 4 MiB-chunked message leaves about 8 MiB, which the next message reuses: it does not trim, and
its next send does not pay the page faults of those frames again (about 8 ms per 100 MB call
here, docs/performance.md).  A server's broadcast to two or more clients trims once per round.
Where the C library has no `malloc_trim` (musl, macOS) nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

#: a burst of sends that left less than this in the heap leaves the heap as it is: more than a
#: lone send of 4 MiB frames leaves, which the next message reuses
TRIM_AFTER_BYTES = 16 << 20
#: the data frames a streamed send has in memory at once besides those its message keeps: the one
#: being cut or sent (codec `Frames`: cut as gRPC pulls it) and gRPC's copy of it
FRAMES_IN_FLIGHT = 2


def transient_bytes(data_bytes: int, chunk_bytes: int) -> int:
    """What a send of `data_bytes` in `chunk_bytes` frames leaves freed in the heap when it ends."""
    return min(data_bytes, FRAMES_IN_FLIGHT * chunk_bytes)


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
    """Large sends in flight and what they left in the heap (module docstring); thread-safe."""

    def __init__(self, trim_after_bytes: int = TRIM_AFTER_BYTES) -> None:
        self.trim_after_bytes = trim_after_bytes
        self._lock = threading.Lock()
        self._in_flight = 0
        self._left = 0          # bytes the sends of this burst left in the heap
        self.trims = 0

    def begin(self) -> None:
        with self._lock:
            self._in_flight += 1

    def end(self, left_bytes: int) -> None:
        """One send ended (finished or not), leaving `left_bytes` freed in the heap
        (`transient_bytes`); the last of a burst that left enough trims."""
        with self._lock:
            self._in_flight -= 1
            self._left += left_bytes
            due = False
            if self._in_flight == 0:
                due = self._left >= self.trim_after_bytes
                self._left = 0
                self.trims += due
        if due:
            trim_heap()
