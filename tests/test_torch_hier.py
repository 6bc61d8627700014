"""transport.kind = "torch" with topology.kind = "hierarchical" (HierFAVG over process groups):
the same final model as gRPC, the analytic tensor bytes per link and round, a dead rank fails
the run (server/group_rounds.py HierGroupRounds, edge/group_edge.py, client/group_worker.py over
transports/torch/groups.py).

Byte count per round (d parameters of 4 bytes, fedavg: the reply is one delta of d floats;
E edges, P_e client processes under edge e, kappa2 edge iterations; every edge here has sampled
clients, see `_run`, and no client fails):
  edge-server, torch.broadcast: one message to each edge over the top group   E * 4d
  edge-server, torch.reduce:    one partial from each edge                     E * 4d
  client-edge, torch.broadcast: each edge to each of its processes, kappa2 x   kappa2 * sum_e P_e * 4d
  client-edge, torch.reduce:    each process to its edge, kappa2 x             kappa2 * sum_e P_e * 4d
counted once per (collective, non-root rank) on the sender's record.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import LocalRun, run_local
from fedhop.transports.torch.groups import hier_layout
from tests.faultkit import kill_after_round
from tests.helpers import quadratic_config
from tests.test_torch_algorithms import _reference_engine

RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]
D = CENTERS.shape[1]
EDGES, KAPPA2, ROUNDS = 2, 2, 3


def _text(kind: str, processes: int, per_round: int, rounds: int = ROUNDS, extra: str = "") -> str:
    topology = f'kind = "hierarchical"\nedges = {EDGES}\nkappa2 = {KAPPA2}'
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=per_round, processes=processes,
                            topology=topology, local_steps=3)
    return text.replace('kind = "grpc"', f'kind = "{kind}"{extra}')


def _run(tmp_path: Path, kind: str, processes: int, per_round: int):
    """8 clients in 2 clusters of 4; per_round >= 5 samples at least one client of each cluster."""
    cfg = tmp_path / f"{kind}.toml"
    cfg.write_text(_text(kind, processes, per_round))
    assert run_local(str(cfg), _reference_engine(kind), str(tmp_path / kind), quiet=True, show_table=False) == 0
    return load_file(str(tmp_path / kind / "model.safetensors"))["w"], tmp_path / kind


def _check_bytes(run_dir: Path, processes: int) -> None:
    store = RunStore(run_dir / "run.db")
    rows = [m for m in store.messages() if m["method"].startswith("torch.") and m["role"] == "sender"]
    b = 4 * D
    want = {("edge-server", "torch.broadcast"): EDGES * b, ("edge-server", "torch.reduce"): EDGES * b,
            ("client-edge", "torch.broadcast"): KAPPA2 * processes * b,
            ("client-edge", "torch.reduce"): KAPPA2 * processes * b}
    for r in range(1, ROUNDS + 1):
        got = {key: 0 for key in want}
        for m in rows:
            if m["round"] == r:
                got[(m["link"], m["method"])] += m["tensor_bytes"]
        assert got == want, f"round {r}"
    assert store.check_agreement().ok   # every collective recorded by both ends with the same bytes
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["transport"] == "torch"
    assert summary["bytes"]["by_link"]["edge-server"]["tensor_bytes"] == ROUNDS * 2 * EDGES * b
    assert summary["bytes"]["by_link"]["client-edge"]["tensor_bytes"] == ROUNDS * 2 * KAPPA2 * processes * b


def test_layout_ranks_and_groups():
    layout = hier_layout(["edge-0", "edge-1"], {"edge-0": ["client-proc1", "client-proc0"], "edge-1": ["client-proc2"]})
    assert layout["ranks"] == {"edge-0": 1, "edge-1": 2, "client-proc0": 3, "client-proc1": 4, "client-proc2": 5}
    assert layout["groups"] == [[0, 1, 2], [1, 3, 4], [2, 5]]
    assert layout["clusters"] == {"edge-0": 1, "edge-1": 2}


def test_hier_torch_equals_grpc_bit_for_bit_one_process_per_edge(tmp_path):
    """Bit for bit: with one client process per edge that process aggregates its sampled clients
    in the same (sorted) order as the gRPC edge, and each reduce adds one partial to the
    identity 0 (cluster: edge + 1 process; top: server + 2 edges), which is exact in any order."""
    grpc_model, _ = _run(tmp_path, "grpc", processes=2, per_round=6)
    torch_model, run_dir = _run(tmp_path, "torch", processes=2, per_round=6)
    assert torch.equal(torch_model, grpc_model)
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    _check_bytes(run_dir, processes=2)


def test_hier_torch_equals_grpc_within_rounding_two_processes_per_edge(tmp_path):
    """Two processes per edge, every client sampled (4 per edge, 2 per process): the torch path
    sums (c0 + c1) + (c2 + c3) where the gRPC edge sums ((c0 + c1) + c2) + c3, so the results
    agree within float32 rounding (rtol = atol = 1e-6), not necessarily bit for bit."""
    grpc_model, _ = _run(tmp_path, "grpc", processes=4, per_round=8)
    torch_model, run_dir = _run(tmp_path, "torch", processes=4, per_round=8)
    assert torch.allclose(torch_model, grpc_model, rtol=1e-6, atol=1e-6)
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    _check_bytes(run_dir, processes=4)


def test_killed_client_process_fails_the_run_with_a_clear_message(tmp_path):
    rounds = 2000
    cfg = parse_config(_text("torch", processes=2, per_round=8, rounds=rounds, extra="\ntimeout = 15.0")
                       .replace("round_timeout = 60.0", "round_timeout = 20.0").replace("eval_every = 1",
                                                                                          "eval_every = 0"))
    status, seconds = kill_after_round(LocalRun(cfg, tmp_path), 2,
                                       lambda name: name == "client-proc1")   # edge-1's only process
    assert status == 1
    assert seconds < 60   # bounded by the collective / round timeouts, never a hang
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] < rounds
    assert "edge-1" in summary["error"] and "client-proc1" in summary["error"], summary["error"]


@pytest.mark.parametrize("topology", ["star", "hierarchical"])
def test_qsgd_uploads_are_refused_with_the_torch_transport_at_load(topology):
    """The collectives reduce raw float sums: a QSGD config would silently differ from gRPC, so
    the config loader refuses it, naming the key, on every topology (the gRPC config loads)."""
    from fedhop.common.config import ConfigError
    topo = 'kind = "star"' if topology == "star" else f'kind = "hierarchical"\nedges = {EDGES}'
    text = quadratic_config(CENTERS, CURV, SIZES, topology=topo, extra_algorithm='compress = "qsgd"')
    assert parse_config(text).algorithm.compress == "qsgd"
    with pytest.raises(ConfigError, match="algorithm.compress.*transport.kind = 'torch'"):
        parse_config(text.replace('kind = "grpc"', 'kind = "torch"'))
