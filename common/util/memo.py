"""Results a process builds once from its config and keeps (`process_memo`).

A topology's seeded client graph and its weights are a function of a few integers of the config,
and at 1,000,000 clients they take a minute or more to build; the config check, the driver and a
client host each ask for them.  Kept, a process builds them once, and the processes that
`fedhop run` forks after its config check (deploy/launch/forkstart.py) start with them built.
The launcher then forgets them (`forget_process_memos`): it runs no rounds, and a graph of
1,000,000 clients is hundreds of MB; so does `run_local` at the end of a run, for a Python API
caller's process.  What a memo returns is shared: read it, never change it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

R = TypeVar("R")

_MEMOS: list[Any] = []


def process_memo(fn: Callable[..., R]) -> "functools._lru_cache_wrapper[R]":
    """`fn` (of hashable arguments) with its last two results kept for this process."""
    kept = functools.lru_cache(maxsize=2)(fn)
    _MEMOS.append(kept)
    return kept


def forget_process_memos() -> None:
    """Drop every kept result in this process (a launcher whose children have started)."""
    for kept in _MEMOS:
        kept.cache_clear()
