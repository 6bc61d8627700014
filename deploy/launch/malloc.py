"""glibc malloc settings for processes that move large tensors.

On this machine the cost of moving a model is in copies into freshly allocated memory (page
faults), not in the socket (shared/research/limits.md).  By default glibc serves every
allocation above its mmap threshold (4 MiB chunks, decode buffers) with fresh pages and
returns them on free, so every message pays the page faults again.  Raising the thresholds
keeps freed memory in the heap for the next message: `fedhop bench transport` measured the
codec at ~1.5 GB/s without these settings and ~14 GB/s with them (docs/performance.md).
glibc reads them at process start, so they are set in the environment of child processes.

`MALLOC_ARENA_MAX` caps glibc's per-thread arenas at 2.  Each arena keeps the memory freed in
it (the trim threshold above), so with one arena per thread every gRPC worker that once held a
reply's frames kept them: a server's resident memory grew by tens of MB per client thread
(`fedhop bench large`, 100 MB x 8 clients: 1,132 MB peak with glibc's default of 8 arenas per
core, 842 MB with 2; docs/performance.md).  With two, freed frames are reused by whichever
thread allocates next.  Large allocations are few (one per 4 MiB frame), so the arenas' locks
are not contended.
"""
from __future__ import annotations

import os
import sys

TUNED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
    "MALLOC_ARENA_MAX": "2",
}


def tuned_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with the malloc settings added, keeping any the user set."""
    env = dict(os.environ if base is None else base)
    for key, value in TUNED_MALLOC_ENV.items():
        env.setdefault(key, value)
    return env


def reexec_with_tuned_malloc() -> None:
    """Restart this Python process with the settings unless they are already in effect."""
    if os.environ.get("FEDHOP_MALLOC_TUNED") == "1" or os.environ.get("FEDHOP_NO_MALLOC_TUNING") == "1":
        return
    env = tuned_env()
    env["FEDHOP_MALLOC_TUNED"] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
