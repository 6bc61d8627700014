"""Shared helpers for tests: configs for small problems, numpy reference computations."""
from __future__ import annotations

import selectors
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable

import numpy as np

from fedhop.common.records.walfold import connect_ro


def quadratic_config(centers, curvatures, sizes, *, rounds=4, local_steps=5, lr=0.1, server_lr=1.0,
                     per_round=None, processes=2, algorithm="fedavg", extra_algorithm="", seed=0,
                     topology="", name="quad") -> str:
    """TOML text of a FedAvg-style run on the quadratic task."""
    count = len(centers)
    return f"""
[run]
name = "{name}"
seed = {seed}
rounds = {rounds}
eval_every = 1
call_timeout = 30.0
round_timeout = 60.0

[topology]
{topology or 'kind = "star"'}

[algorithm]
name = "{algorithm}"
lr = {lr}
server_lr = {server_lr}
local_steps = {local_steps}
batch_size = 0
{extra_algorithm}

[data]
dataset = "quadratic"
centers = {np.asarray(centers).tolist()}
curvatures = {np.asarray(curvatures).tolist()}
sizes = {list(sizes)}

[model]
init = "zeros"

[clients]
count = {count}
per_round = {per_round if per_round is not None else count}
processes = {processes}

[transport]
kind = "grpc"
"""


def numpy_fedavg_round(w, centers, curvatures, sizes, participants, local_steps, lr, server_lr):
    """One FedAvg round on separable quadratics, in float64 numpy, written from the paper."""
    deltas, weights = [], []
    for i in participants:
        wi = w.copy()
        for _ in range(local_steps):
            wi = wi - lr * curvatures[i] * (wi - centers[i])   # full-batch gradient C_i (w - A_i)
        deltas.append(wi - w)
        weights.append(sizes[i])
    weights = np.asarray(weights, dtype=float)
    avg = sum(p * d for p, d in zip(weights / weights.sum(), deltas))
    return w + server_lr * avg


def read_db(db: Path, sql: str, args: tuple = (), default=None):
    """The first column of the first row of a read-only query on a run.db that may be written
    meanwhile or not be there yet (`default` then, or on any SQLite error).  Read-only: a test's
    polling never takes a writer's lock, and a poll after the run's end adds no WAL file to its
    folder (`connect_ro`)."""
    if not Path(db).exists():
        return default
    try:
        con = connect_ro(db, timeout=1.0)
        try:
            row = con.execute(sql, args).fetchone()
        finally:
            con.close()
    except (FileNotFoundError, sqlite3.Error):
        return default
    return default if row is None or row[0] is None else row[0]


def max_round(db: Path) -> int:
    """The last round recorded in run.db (0 before the first)."""
    return int(read_db(db, "SELECT MAX(round) FROM rounds", default=0))


def data_set_config(dataset: str, partition: str, count: int, *, extra: str = "", kind: str = "mlp",
                    seed: int = 0) -> str:
    """TOML text of a run on a file-backed data set under ./data (data_dir = "data")."""
    return f"""
[run]
seed = {seed}
[data]
dataset = "{dataset}"
partition = "{partition}"
data_dir = "data"
{extra}
[model]
kind = "{kind}"
[clients]
count = {count}
"""


def db_rows(db, sql: str) -> list[tuple]:
    """The rows of `sql` over a run's run.db, opened read-only."""
    con = connect_ro(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def wait_until(what: str, check: Callable[[], Any], procs: Iterable[subprocess.Popen] = (),
               timeout: float = 120.0, every: float = 0.05) -> Any:
    """Poll `check()` (a run.db row, a log line, a file) until it returns something true, and
    return that; fail at once, naming the process, if one of `procs` has ended and the event is
    still not there (looked at once more after the exit is seen), and after `timeout` seconds.
    The event is what the test waits on: `every` is only how often it is looked at (a file or a
    row written by another process gives no notification to block on)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        ended = [p for p in procs if p.poll() is not None]
        if ended:   # the event may have come just before the exit: one last look, after it
            got = check()
            if got:
                return got
            assert not ended, f"{ended[0].args} exited with {ended[0].returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(every)   # the poll interval between looks at the event, not a wait for it


def read_lines(proc: subprocess.Popen, stream: IO[str], needle: str, timeout: float = 120.0) -> list[str]:
    """The lines of `stream` (a text pipe of `proc`: its stdout or stderr) up to and including the
    first holding `needle`, as read (newlines kept).  Blocks on the pipe itself (a selector), so
    the line is the event waited on; fails after `timeout` seconds, or when the pipe ends (the
    process exited) with no such line, showing what it did print."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = stream.readline()
                assert line, f"exited ({proc.wait()}) with no line holding {needle!r}:\n{''.join(seen)}"
                seen.append(line)
                if needle in line:
                    return seen
    raise AssertionError(f"no line holding {needle!r} within {timeout:.0f}s:\n{''.join(seen)}")


def read_line(proc: subprocess.Popen, needle: str, timeout: float = 120.0) -> str:
    """The first line of `proc`'s stderr (a text pipe) holding `needle` (`read_lines`)."""
    return read_lines(proc, proc.stderr, needle, timeout)[-1]   # type: ignore[arg-type]
