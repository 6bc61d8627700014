"""A fast in-process round loop for checks and figures (no transport, no run directory).

It calls the same algorithm objects as a real run in the same order and with the same seeded
streams as the coordinator and the client host: sampling ("sampling", round), one generator per
client and round ("client", i, "round", round), replies reduced in client-id order.  So for the
same config it gives the same model as `deploy.inmemory.run_inmemory` (tests/test_minimax.py
checks this), while running thousands of rounds per second on the small quadratic problems.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fedhop.common.algorithms.base import Algorithm, ClientContext, ServerState
from fedhop.common.algorithms.local import get_params
from fedhop.common.rng import numpy_stream, torch_stream
from fedhop.common.tasks.base import Task

RoundHook = Callable[[int, ServerState, list[int]], None]


def steps_of(local_steps: int | Sequence[int], client_id: int) -> int:
    """A client's fixed local steps from `[algorithm] local_steps` (an int or one per client)."""
    if isinstance(local_steps, (list, tuple)):
        return int(local_steps[client_id])
    return int(local_steps)


def simulate(algorithm: Algorithm, task: Task, rounds: int, *, per_round: int | None = None, seed: int = 0,
             local_steps: int | Sequence[int] = 0, local_epochs: int = 1,
             on_round: RoundHook | None = None) -> ServerState:
    """Run `rounds` rounds of `algorithm` on `task`; returns the final server state.

    `per_round` clients are sampled uniformly without replacement each round (default: all).
    `on_round(round, state, sampled)` runs after each server step.
    """
    n = task.num_clients
    size = n if per_round is None else int(per_round)
    if not 1 <= size <= n:
        raise ValueError(f"per_round = {per_round}: must be in 1..{n}")
    model = task.build_model()
    state = algorithm.init_state(get_params(model))
    client_states: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(n)}
    sizes = [task.client_data(i).num_samples for i in range(n)]
    for r in range(1, rounds + 1):
        rng = numpy_stream(seed, "sampling", r)
        sampled = sorted(int(c) for c in rng.choice(n, size=size, replace=False))
        message = algorithm.broadcast(state, r)
        replies = []
        for cid in sampled:
            ctx = ClientContext(client_id=cid, task=task, model=model, num_samples=sizes[cid],
                                generator=torch_stream(seed, "client", cid, "round", r), round=r,
                                local_steps=steps_of(local_steps, cid), local_epochs=local_epochs,
                                state=client_states[cid])
            own = algorithm.client_message(state, message, r, cid)   # as the coordinator addresses it
            replies.append((cid, algorithm.client_update(ctx, own)))
        algorithm.server_update(state, algorithm.aggregate(replies), r)
        algorithm.note_participants(state, r, sampled)
        if on_round is not None:
            on_round(r, state, sampled)
    return state
