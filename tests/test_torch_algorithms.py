"""transport.kind = "torch" beyond FedAvg: FedExP and SCAFFOLD on the star, Fed-CHS (sequential
topology: cluster collectives, point-to-point hand-offs between edges, the final model sent to
the server), each against the same config over gRPC (played in-process, `_reference_engine`),
with the tensor bytes of every operation against the analytic count (topologies/sequential/driver.py, topologies/sequential/edge.py, transports/torch/dist.py).

Equality, and why:
- bit for bit where every reduce adds one partial to the identity 0 (one client process per
  star or per edge cluster): that process aggregates its clients in the same sorted order as
  the gRPC server or edge, and 0 + x = x exactly;
- within float32 rounding (rtol = atol = 1e-6) with several processes, whose partials are summed
  in another order than the gRPC aggregator's client-by-client sum.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import LocalRun, read_progress, run_local
from tests.faultkit import kill_after_round
from tests.helpers import quadratic_config
from tests.test_fedchs import ASSIGN, GRAPH, D, fedchs_config, rule_sequence
from tests.test_fedchs import SIZES as CHS_SIZES

RNG = np.random.default_rng(23)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]


def _reference_engine(kind: str) -> list[str]:
    """The gRPC reference is played by the in-process engine: a gRPC run's model bit for bit and
    its bytes (tests/test_examples_engines.py, tests/test_inprocess_engine.py), without starting
    the server, edges and client processes a second time."""
    return ["run.engine=inprocess"] if kind == "grpc" else []


def _run(tmp_path: Path, name: str, text: str, kind: str) -> tuple[torch.Tensor, Path]:
    cfg = tmp_path / f"{name}-{kind}.toml"
    cfg.write_text(text.replace('kind = "grpc"', f'kind = "{kind}"'))
    out = tmp_path / f"{name}-{kind}"
    assert run_local(str(cfg), _reference_engine(kind), str(out), quiet=True, show_table=False) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["transport"] == kind
    return load_file(str(out / "model.safetensors"))["w"], out


def _sender_bytes(run_dir: Path) -> Counter:
    """(round, link, method) -> tensor bytes on the sender's records of torch operations."""
    out: Counter = Counter()
    for m in RunStore(run_dir / "run.db").messages():
        if m["method"].startswith("torch.") and m["role"] == "sender":
            out[(m["round"], m["link"], m["method"])] += m["tensor_bytes"]
    return out


# ----------------------------------------------------------------------------- star: FedExP, SCAFFOLD
@pytest.mark.parametrize("algorithm", ["fedexp", "scaffold"])
@pytest.mark.parametrize("processes", [1, 3])
def test_star_algorithms_over_torch_equal_grpc(tmp_path, algorithm, processes):
    rounds, d = 3, CENTERS.shape[1]
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=5, processes=processes,
                            algorithm=algorithm)
    grpc_model, _ = _run(tmp_path, algorithm, text, "grpc")
    torch_model, run_dir = _run(tmp_path, algorithm, text, "torch")
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    if processes == 1:
        assert torch.equal(torch_model, grpc_model)
    else:
        assert torch.allclose(torch_model, grpc_model, rtol=1e-6, atol=1e-6)
    # the broadcast carries the model (and SCAFFOLD's server control variate c); each process
    # reduces one partial of the reply tensors (a delta; SCAFFOLD adds the control delta)
    tensors = 2 if algorithm == "scaffold" else 1
    got = _sender_bytes(run_dir)
    for r in range(1, rounds + 1):
        assert got[(r, "client-server", "torch.broadcast")] == processes * tensors * 4 * d, r
        reduced = got[(r, "client-server", "torch.reduce")]
        assert reduced >= processes * tensors * 4 * d, r   # + 0-dim scalars such as FedExP's norm sum
        assert reduced - processes * tensors * 4 * d < processes * 4 * 4, r
    assert RunStore(run_dir / "run.db").check_agreement().ok


# ----------------------------------------------------------------------------- Fed-CHS
def _fedchs_bytes_check(run_dir: Path, K: int, rounds: int, procs_per_edge: int) -> None:
    """Per round t at edge m(t): K broadcasts of w_k (4d bytes) and K reduces of the gradient
    (4d bytes) to and from each of its P client processes, one hand-off of w (4d) to the next edge,
    and in the last round the final model (4d) to the server instead of a hand-off."""
    got = _sender_bytes(run_dir)
    b = 4 * D
    for t in range(1, rounds + 1):
        want = {(t, "client-edge", "torch.broadcast"): K * procs_per_edge * b,
                (t, "client-edge", "torch.reduce"): K * procs_per_edge * b,
                (t, "edge-edge" if t < rounds else "edge-server", "torch.send"): b}
        assert {k: v for k, v in got.items() if k[0] == t} == want, t
    store = RunStore(run_dir / "run.db")
    assert store.check_agreement().ok
    # no gRPC message carries a tensor: control only
    assert all(m["tensor_bytes"] == 0 for m in store.messages() if not m["method"].startswith("torch."))


def test_fedchs_over_torch_equals_grpc_bit_for_bit_one_process_per_edge(tmp_path):
    K, rounds = 3, 6
    text = fedchs_config(rounds=rounds, K=K, processes=len(ASSIGN))
    grpc_model, grpc_dir = _run(tmp_path, "fedchs", text, "grpc")
    torch_model, run_dir = _run(tmp_path, "fedchs", text, "torch")
    assert torch.equal(torch_model, grpc_model)
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    data = [sum(CHS_SIZES[c] for c in group) for group in ASSIGN]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["edge_sequence"] == rule_sequence(GRAPH, data, 0, rounds)
    assert summary["edge_sequence"] == json.loads((grpc_dir / "summary.json").read_text())["edge_sequence"]
    _fedchs_bytes_check(run_dir, K, rounds, procs_per_edge=1)


def test_fedchs_over_torch_within_rounding_two_processes_per_edge_and_delta_form(tmp_path):
    """Two processes per edge (an edge with one client has an idle process that adds the
    identity), E = 2 local iterations (the broadcast also carries the E step sizes)."""
    K, rounds, E = 2, 5, 2
    text = fedchs_config(rounds=rounds, K=K, processes=2 * len(ASSIGN), local_iters=E, schedule="constant",
                         lr=0.3)
    grpc_model, _ = _run(tmp_path, "fedchs2", text, "grpc")
    torch_model, run_dir = _run(tmp_path, "fedchs2", text, "torch")
    assert torch.allclose(torch_model, grpc_model, rtol=1e-6, atol=1e-6)
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    got = _sender_bytes(run_dir)
    b = 4 * D
    for t in range(1, rounds + 1):
        assert got[(t, "client-edge", "torch.broadcast")] == K * 2 * (b + 4 * E), t   # w_k + E step sizes
        assert got[(t, "client-edge", "torch.reduce")] == K * 2 * b, t
    assert RunStore(run_dir / "run.db").check_agreement().ok


def test_fedchs_over_torch_killed_client_process_fails_the_run_clearly(tmp_path):
    rounds = 3000
    text = fedchs_config(rounds=rounds, K=2, processes=len(ASSIGN), eval_every=0)
    text = (text.replace('kind = "grpc"', 'kind = "torch"\ntimeout = 15.0')
            .replace("round_timeout = 60.0", "round_timeout = 20.0"))
    status, seconds = kill_after_round(LocalRun(parse_config(text), tmp_path), 3,
                                       lambda name: name.startswith("client-proc"))   # every cluster's only process
    assert status == 1
    assert seconds < 60   # bounded by the collective / round timeouts, never a hang
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] < rounds
    assert "holds the model, failed" in summary["error"] and "client-proc" in summary["error"], summary["error"]


def test_chain_over_torch_is_refused_at_load():
    text = quadratic_config(CENTERS, CURV, SIZES, topology='kind = "chain"')
    assert parse_config(text).topology.kind == "chain"
    with pytest.raises(ConfigError, match="transport.kind.*chain"):
        parse_config(text.replace('kind = "grpc"', 'kind = "torch"'))


# ----------------------------------------------------------------------------- per-client tensors, NaN replies
def test_fedlga_straggler_tensors_travel_as_a_gather_by_reduce(tmp_path):
    """FedLGA keeps each straggler's delta apart under a per-client name, so the client processes'
    partials hold different tensors: the reduce runs over the union of their layouts, each name
    contributed by its one owner and as 0 by the rest (transports/torch/dist.py
    `merge_layouts`); the final model equals gRPC's within float32 rounding."""
    from tests.test_fedlga import DIGITS
    text = DIGITS.format(algo="fedlga", rho=0.5, extra="").replace('kind = "inmemory"', 'kind = "grpc"')
    outs = {}
    for kind in ("grpc", "torch"):
        cfg = tmp_path / f"{kind}.toml"
        cfg.write_text(text.replace('kind = "grpc"', f'kind = "{kind}"'))
        assert run_local(str(cfg), [], str(tmp_path / kind), quiet=True, show_table=False) == 0
        outs[kind] = load_file(str(tmp_path / kind / "model.safetensors"))
    for name, t in outs["grpc"].items():
        assert torch.allclose(outs["torch"][name], t, rtol=1e-5, atol=1e-6), name
    # the stragglers' tensors were in the reduce: more than one model of reply bytes per process
    n = sum(t.numel() for t in outs["grpc"].values())
    reduced = [m["tensor_bytes"] for m in RunStore(tmp_path / "torch" / "run.db").messages()
               if m["method"] == "torch.reduce" and m["role"] == "sender"]
    assert max(reduced) > 4 * n


def test_merge_layouts_unions_names_and_names_a_conflict():
    from fedhop.common.wire.fedhop_pb2 import ReduceEntry
    from fedhop.transports.torch.dist import LayoutMismatch, merge_layouts

    def layout(*entries):
        return [ReduceEntry(name=n, dtype=d, shape=s, op=o) for n, d, s, o in entries]
    a = layout(("w", "float32", [3], "wsum"), ("s.1.w", "float32", [3], "wsum"))
    b = layout(("w", "float32", [3], "wsum"), ("s.4.w", "float32", [3], "wsum"))
    assert [e.name for e in merge_layouts({"p1": b, "p0": a}, "here")] == ["w", "s.1.w", "s.4.w"]
    c = layout(("w", "float32", [4], "wsum"))
    with pytest.raises(LayoutMismatch, match=r"tensor 'w' is .*\[3\].* at p0 but .*\[4\].* at p2"):
        merge_layouts({"p0": a, "p2": c}, "here")


def test_worker_leaves_a_nan_reply_out_of_its_partial():
    """client/group_worker.py: a client whose reply holds NaN is a NON_FINITE failure (the
    server's nan_policy applies), the other clients' replies form the partial."""
    from types import SimpleNamespace

    from fedhop.client.group_worker import GroupWorker
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.algorithms.fedavg import FedAvg
    from fedhop.common.transport.control import failures_of
    from fedhop.common.wire.fedhop_pb2 import Control, TensorSpec
    from fedhop.transports.torch.groups import CollectiveMember

    def train(cid, round, message, step):
        w = message.tensors["w"] + cid
        if cid == 2:
            w[0] = float("nan")
        return Payload(tensors={"w": w}, scalars={"weight": 1.0})

    host = SimpleNamespace(node_id="client-proc0", train=train, algorithm=FedAvg(SimpleNamespace()))
    worker = GroupWorker(host)
    worker.member = CollectiveMember(SimpleNamespace(node_id="client-proc0", root_node="server",
                                                     broadcast=lambda empties, round, peers, step: [torch.zeros(3)]))
    out = worker.round(1, Payload(control=Control(clients=[1, 2, 3], specs=[TensorSpec(name="w", dtype="float32",
                                                                                    shape=[3], nbytes=12)])))
    failures = failures_of(out)
    assert list(failures) == [2] and failures[2].startswith("NON_FINITE")
    assert torch.equal(worker.member.partial.tensors["w"], torch.full((3,), 4.0))   # 1 + 3, weights 1


def test_set_up_fails_at_once_when_a_rank_dies_before_joining():
    """transports/torch/dist.py `init_watching`: the join would wait out the store's timeout
    for a dead rank; the failed control call that asked that rank to join ends the set-up at
    once, naming the node (the join here blocks until released, as the real one would)."""
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    from fedhop.transports.torch.dist import init_watching
    release = threading.Event()
    coll = SimpleNamespace(node_id="server", init=lambda *args, **kwargs: release.wait(30))
    alive, dead = Future(), Future()
    dead.set_exception(ConnectionError("connection refused"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="set-up failed: client-proc1 did not join torch.distributed: "
                                           "connection refused"):
        init_watching(coll, "127.0.0.1:1", {"client-proc0": alive, "client-proc1": dead}, "set-up failed")
    assert time.monotonic() - started < 5
    release.set()
    # every rank joins: no error
    init_watching(SimpleNamespace(node_id="server", init=lambda *args, **kwargs: None), "127.0.0.1:1",
                  {"client-proc0": alive}, "set-up failed")


def test_fedchs_over_torch_passes_over_a_killed_edge(tmp_path):
    """Edge 3 is killed (SIGKILL) after round 1, while edge 1 runs round 2 and would hand the model
    to it (least visited, then the larger cluster): the neighbour query fails, the rule passes
    edge 3 over, and the run completes over the world's other ranks (a dead rank breaks only the
    operations that need it)."""
    rounds, dead = 4, 3
    text = fedchs_config(rounds=rounds, K=150, processes=len(ASSIGN), eval_every=0)
    text = text.replace('kind = "grpc"', 'kind = "torch"\ntimeout = 20.0').replace("call_timeout = 30.0",
                                                                                   "call_timeout = 5.0")
    run = LocalRun(parse_config(text), tmp_path)
    server = run.start([])
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not read_progress(tmp_path / "run.db", 0):   # rounds after 0
            time.sleep(0.02)
        assert read_progress(tmp_path / "run.db", 0), "round 1 never finished"
        assert not read_progress(tmp_path / "run.db", 1), "round 2 finished before the kill: make rounds longer"
        os.kill(next(c for c in run.children if c.name == f"edge-{dead}").proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=120)
    finally:
        run.stop_all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed", summary["error"]
    data = [sum(CHS_SIZES[c] for c in group) for group in ASSIGN]
    assert summary["edge_sequence"] == rule_sequence(GRAPH, data, 0, rounds, dead={dead})
    assert rule_sequence(GRAPH, data, 0, rounds)[:3] == [0, 1, dead]   # alive, edge 3 would hold round 3
    skips = RunStore(tmp_path / "run.db").events("handoff_skipped")
    assert skips and all(e["node"] == f"edge-{dead}" for e in skips)
