"""A fast in-process round loop for checks and figures (no transport, no run directory).

It is the round engine (common/engine/rounds.py) on a task and an algorithm object built by hand: the
same sampling stream ("sampling", round), one generator per client and round ("client", i,
"round", round), replies reduced in client-id order as the coordinator and the client host use.
So for the same config it gives the same model as `deploy.launch.inmemory.run_inmemory`
(tests/test_minimax.py checks this), while running thousands of rounds per second on the small
quadratic problems.
"""
from __future__ import annotations

from typing import Callable

from fedhop.common.algorithms.base import Algorithm, ServerState
from fedhop.common.config.schema import AlgorithmConfig, ClientsConfig, Config, RunConfig
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.tasks.base import Task

RoundHook = Callable[[int, ServerState, list[int]], None]


def simulate(algorithm: Algorithm, task: Task, rounds: int, *, per_round: int | None = None, seed: int = 0,
             local_steps: int | list[int] | tuple[int, ...] = 0, local_epochs: int = 1,
             on_round: RoundHook | None = None) -> ServerState:
    """Run `rounds` rounds of `algorithm` on `task`; returns the final server state.

    `per_round` clients are sampled uniformly without replacement each round (default: all).
    `on_round(round, state, sampled)` runs after each server step.
    """
    n = task.num_clients
    size = n if per_round is None else int(per_round)
    if not 1 <= size <= n:
        raise ValueError(f"per_round = {per_round}: must be in 1..{n}")
    steps = list(local_steps) if isinstance(local_steps, (list, tuple)) else int(local_steps)
    cfg = Config(run=RunConfig(seed=seed, rounds=rounds), clients=ClientsConfig(count=n, per_round=size),
                 algorithm=AlgorithmConfig(name=algorithm.name, local_steps=steps, local_epochs=local_epochs))
    engine = RoundEngine(cfg, task, algorithm)
    for r in range(1, rounds + 1):
        sampled, _ = engine.train_round(r)
        if on_round is not None:
            on_round(r, engine.state, sampled)
    return engine.state
