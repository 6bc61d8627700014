"""FedExP's Eq. 9 step on a deterministic heterogeneous quadratic (full-batch local steps): it grows
without bound near the fixed point and the run ends far from FedAvg's point; the optional
`max_server_step` safeguard (not in the paper, off by default) caps it at min(c, Eq. 9)."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.algorithms.fedexp import FedExPParams
from fedhop.common.config import ConfigError, parse_config
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

RNG = np.random.default_rng(0)
CENTERS = RNG.normal(size=(6, 5)) * 3
CURVATURES = RNG.uniform(0.2, 3.0, size=(6, 5))


def run(tmp_path, algorithm: str, extra: str = "") -> tuple[list[float], float]:
    text = quadratic_config(CENTERS, CURVATURES, [1] * 6, rounds=60, local_steps=10, lr=0.02, algorithm=algorithm,
                            extra_algorithm='weighting = "uniform"\n' + extra, name=f"{algorithm}{len(extra)}")
    etas: list[float] = []

    def record(net, procs, coord):
        step = coord.algorithm.server_update

        def wrapped(state, aggregate, round):
            step(state, aggregate, round)
            etas.append(state.scalars.get("fedexp_eta_g", 1.0))
        coord.algorithm.server_update = wrapped

    summary, coord = run_inmemory(parse_config(text), tmp_path / f"{algorithm}{len(extra)}", before_run=record)
    assert summary["status"] == "completed", summary["error"]
    return etas, float((coord.state.params["w"].double() - coord.task.optimum()).norm())


def test_the_step_grows_and_the_safeguard_caps_it(tmp_path):
    assert FedExPParams().max_server_step == 0.0          # off by default
    _, fedavg = run(tmp_path, "fedavg")
    etas, dist = run(tmp_path, "fedexp")
    assert max(etas) > 100 and dist > 10 * fedavg       # Eq. 9 unbounded: far from FedAvg's point
    cap = 5.0
    capped, dist_capped = run(tmp_path, "fedexp", f"max_server_step = {cap}")
    assert max(capped) == cap and all(1.0 <= e <= cap for e in capped)
    first = next(i for i, e in enumerate(etas) if e > cap)
    assert capped[:first] == etas[:first]               # the same run until the cap first binds
    assert capped[first] == cap
    assert dist_capped < 2 * fedavg


def test_safeguard_key_is_validated():
    text = quadratic_config(CENTERS, CURVATURES, [1] * 6, algorithm="fedexp", extra_algorithm="max_server_step = -1")
    with pytest.raises(ConfigError, match="max_server_step"):
        parse_config(text)
