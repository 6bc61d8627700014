"""Shared helpers for tests: configs for small problems, numpy reference computations."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np


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
    polling never takes a writer's lock."""
    if not Path(db).exists():
        return default
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            row = con.execute(sql, args).fetchone()
        finally:
            con.close()
    except sqlite3.Error:
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
    import sqlite3
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
