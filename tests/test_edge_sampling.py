"""topology.edges_per_round: partial participation of edge servers in a hierarchical run.
Each round draws k edges from the stream ("edges", round); the round's clients are sampled among
theirs; only those edges are called; the model is FedAvg over exactly those clients."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.rng import numpy_stream
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import run_local
from tests.helpers import numpy_fedavg_round, quadratic_config

RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(8, 4))
CURV = RNG.uniform(0.5, 2.0, size=(8, 4))
SIZES = [6, 11, 3, 9, 14, 2, 8, 5]
EDGES, SEED = 4, 0
CLUSTERS = [[0, 1], [2, 3], [4, 5], [6, 7]]     # assignment = "blocks" of 8 clients over 4 edges


def _text(edges_per_round: int, per_round: int, rounds: int = 6, transport: str = "grpc") -> str:
    topology = f'kind = "hierarchical"\nedges = {EDGES}\nedges_per_round = {edges_per_round}'
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=3, lr=0.2, per_round=per_round,
                            topology=topology, seed=SEED)
    return text.replace('kind = "grpc"', f'kind = "{transport}"')


def _drawn(round: int, k: int) -> list[int]:
    return sorted(int(e) for e in numpy_stream(SEED, "edges", round).choice(EDGES, size=k, replace=False))


@pytest.mark.parametrize("k, per_round", [(2, 8), (1, 8), (3, 4)])
def test_rounds_use_the_drawn_edges_and_equal_numpy_fedavg(tmp_path: Path, k: int, per_round: int) -> None:
    summary, coord = run_inmemory(parse_config(_text(k, per_round)), tmp_path)
    assert summary["status"] == "completed"
    calls: dict[int, set[str]] = {}
    for m in RunStore(tmp_path / "run.db").messages():
        if m["method"] == "edge_round" and m["role"] == "sender":
            calls.setdefault(m["round"], set()).add(m["dst"])
    w = np.zeros(CENTERS.shape[1])
    drawn_sets = set()
    for result in coord.history:
        edges = _drawn(result.round, k)
        drawn_sets.add(tuple(edges))
        pool = [c for e in edges for c in CLUSTERS[e]]
        assert set(result.sampled) <= set(pool) and len(result.sampled) == min(per_round, len(pool))
        assert result.participants == result.sampled
        # only edges with sampled clients are called, and each of them is one of the drawn edges
        assert calls[result.round] == {f"edge-{e}" for e in edges if set(CLUSTERS[e]) & set(result.sampled)}
        w = numpy_fedavg_round(w, CENTERS, CURV, SIZES, result.participants, 3, 0.2, 1.0)
    assert len(drawn_sets) > 1    # the draw changes from round to round
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), w, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(w) > 0.5


def test_more_edges_per_round_than_edges_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="topology.edges_per_round.*4 edges"):
        parse_config(_text(EDGES + 1, 8))


def test_zero_keeps_every_edge_and_the_old_sampling(tmp_path: Path) -> None:
    """edges_per_round = 0 samples from every client with the stream ("sampling", round) alone."""
    _, coord = run_inmemory(parse_config(_text(0, 3, rounds=3)), tmp_path)
    for result in coord.history:
        rng = numpy_stream(SEED, "sampling", result.round)
        assert result.sampled == sorted(int(c) for c in rng.choice(8, size=3, replace=False))


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_processes_sample_edges_as_the_inmemory_run(tmp_path: Path, transport: str) -> None:
    text = _text(2, 8, rounds=3, transport=transport)
    _, coord = run_inmemory(parse_config(_text(2, 8, rounds=3)), tmp_path / "mem")
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    assert run_local(str(cfg), [], str(tmp_path / "p"), quiet=True, show_table=False) == 0
    got = load_file(str(tmp_path / "p" / "model.safetensors"))["w"]
    assert torch.allclose(got, coord.state.params["w"], rtol=1e-6, atol=1e-6)
    rounds = RunStore(tmp_path / "p" / "run.db").rounds()
    assert [r["participants"] for r in rounds] == [len(res.participants) for res in coord.history]


def test_the_coordinator_keeps_the_latest_rounds_results_only(tmp_path: Path) -> None:
    """Coordinator.history holds the last HISTORY_ROUNDS rounds' results (run.db holds every
    round): each the round's own sample, drawn from its stream, and run.db's count."""
    from fedhop.server.coordinator import HISTORY_ROUNDS

    rounds = HISTORY_ROUNDS + 9
    _, coord = run_inmemory(parse_config(_text(0, 3, rounds=rounds)), tmp_path)
    assert [r.round for r in coord.history] == list(range(10, rounds + 1))
    for result in coord.history:
        rng = numpy_stream(SEED, "sampling", result.round)
        assert result.sampled == sorted(int(c) for c in rng.choice(8, size=3, replace=False))
    stored = RunStore(tmp_path / "run.db", create=False).rounds()
    assert len(stored) == rounds
    assert [r["participants"] for r in stored[-HISTORY_ROUNDS:]] == [len(r.participants) for r in coord.history]
