"""The round engine's loop as a system of `fedhop bench peers` ("fedhop loop"): the floor of what
an engine with fedhop's training code can reach on a workload.

    python -m fedhop.deploy.bench.engine_loop CONFIG

`RoundEngine.run`'s steps (common/engine/rounds.py) in this one process: the same sampling, the
same client code (`local_update`, the upload), the same checks on each reply and the same
aggregation and server step as a `fedhop run`, so the final model is a run's bit for bit; but no
message is encoded, sent or recorded, and nothing is written.  What `fedhop bench peers` prints
for an engine beside this loop is therefore what moving and recording the messages costs a
round.  Configs the loop cannot play (`RoundEngine.check_local`: deadline cuts, topologies with
their own round protocol) are refused with one line, exit 2.

Prints one JSON line, the peer scripts' contract (deploy/bench/peers/peerkit.py): `per_round_s`,
`round_end_s` (time.perf_counter at the end of each round), `accuracy` or `objective` after the
last round, and `model_sha256`, the hash `tensors_sha256` of the final model as `fedhop run`
writes it to model.safetensors.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from safetensors import safe_open

from fedhop.common.algorithms.local import whole_params
from fedhop.common.config import load_config
from fedhop.common.engine.rounds import RoundEngine


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the tensors in sorted name order, each its name, dtype and shape, then its raw
    C-order bytes (benchmarks/identity_check.py hashes a model file the same way)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes(order="C"))
    return digest.hexdigest()


def model_sha256(path: Path) -> str:
    """`tensors_sha256` of a run's model.safetensors, read as numpy arrays (no code runs)."""
    with safe_open(str(path), framework="numpy") as model:
        return tensors_sha256({name: model.get_tensor(name) for name in model.keys()})


def play(config: Path) -> dict[str, object]:
    """Every round of the config in this process; the figures of the module docstring."""
    cfg = load_config(str(config))
    torch.set_num_threads(cfg.run.torch_threads)
    engine = RoundEngine(cfg)
    engine.check_local()
    per_round, ends, metrics = [], [], {}
    for r in range(1, cfg.run.rounds + 1):
        started = time.perf_counter()
        _, aggregate = engine.train_round(r)
        metrics = engine.metrics(r, aggregate)   # an evaluation when due, the last round's included
        ends.append(time.perf_counter())
        per_round.append(ends[-1] - started)
    final = whole_params(engine.model, engine.state.params)
    return {"system": "fedhop loop", "per_round_s": per_round, "round_end_s": ends,
            "accuracy": metrics.get("test_accuracy"), "objective": metrics.get("objective"),
            "model_sha256": tensors_sha256({k: v.detach().cpu().numpy() for k, v in final.items()})}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fedhop.deploy.bench.engine_loop CONFIG", file=sys.stderr)
        return 2
    try:
        figures = play(Path(argv[0]))
    except ValueError as exc:   # a config the loop cannot play, or an invalid one
        print(f"fedhop bench loop: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
