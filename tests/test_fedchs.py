"""Fed-CHS (sequential topology, topologies/sequential/edge.py + topologies/sequential/driver.py) against closed forms
(digest seed-004 section 6.4 T1, T7, T8), an independent implementation of the selection rule,
and edge faults (a killed hierarchical edge; an unreachable Fed-CHS neighbour)."""
from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, load_config, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.topologies.graphs import random_graph
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import LocalRun, read_progress, run_local
from fedhop.topologies.sequential.rule import edge_graph
from tests.helpers import quadratic_config

RNG = np.random.default_rng(11)
D = 3
# 9 clients in 4 clusters of unequal size and data (explicit assignment)
CENTERS = RNG.normal(0, 3, size=(9, D))
SIZES = [4, 7, 2, 5, 9, 3, 6, 1, 8]
ASSIGN = [[0, 1], [2, 3, 4], [5], [6, 7, 8]]
GRAPH = [[1, 3], [0, 2, 3], [1], [0, 1]]        # 0-1, 0-3, 1-2, 1-3: node 2 is a leaf


def fedchs_config(*, rounds=6, K=4, graph=GRAPH, assign=ASSIGN, start=0, count_start=False, lr=1.0,
                  schedule="inv_sqrt", centers=CENTERS, sizes=SIZES, local_iters=1, processes=4,
                  eval_every=1) -> str:
    count = len(centers)
    extra = f'lr_schedule = "{schedule}"' + (f"\nlocal_iters = {local_iters}" if local_iters != 1 else "")
    text = quadratic_config(centers, np.ones_like(centers), sizes, rounds=rounds, local_steps=1, lr=lr,
                            algorithm="fedchs", processes=processes, extra_algorithm=extra,
                            topology=f'kind = "sequential"\nedges = {len(assign)}\nassignment = {assign}\n'
                                     f'graph = {json.dumps(graph)}\nstart = {start}\nsteps_per_round = {K}\n'
                                     f'count_start = {"true" if count_start else "false"}')
    return text.replace("eval_every = 1", f"eval_every = {eval_every}")


def etas(lr, K, schedule="inv_sqrt"):
    return [lr / (K * math.sqrt(k + 1)) if schedule == "inv_sqrt" else lr for k in range(K)]


def cluster_means(centers, sizes, assign):
    return [sum(sizes[c] * centers[c] for c in group) / sum(sizes[c] for c in group) for group in assign]


def closed_form(sequence, centers, sizes, assign, rho):
    """w <- a_m + rho (w - a_m) for m along the sequence (T1), float64."""
    a = cluster_means(centers, sizes, assign)
    w = np.zeros(centers.shape[1])
    for m in sequence:
        w = a[m] + rho * (w - a[m])
    return w


def rule_sequence(graph, data, start, rounds, count_start=False, dead=()):
    """Independent Fed-CHS walk: c(m(0)) = 0 (literal) or 1; at each hop the neighbours alive,
    least visited, then largest cluster data, then smallest id (written without sorting)."""
    visits = [0] * len(graph)
    if count_start:
        visits[start] += 1
    seq, cur = [start], start
    for _ in range(rounds - 1):
        best = None
        for e in graph[cur]:
            if e in dead:
                continue
            if best is None or visits[e] < visits[best] or (visits[e] == visits[best] and
                                                           (data[e] > data[best] or
                                                            (data[e] == data[best] and e < best))):
                best = e
        cur = best
        visits[cur] += 1
        seq.append(cur)
    return seq


# ----------------------------------------------------------------------------- closed forms
def test_one_round_is_contraction_to_cluster_mean_and_several_rounds_follow_closed_form(tmp_path):
    K, lr, rounds = 4, 1.0, 7
    summary, coord = run_inmemory(parse_config(fedchs_config(rounds=rounds, K=K, lr=lr)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    rho = float(np.prod([1 - e for e in etas(lr, K)]))
    seq = summary["edge_sequence"]
    assert len(seq) == rounds
    expected = closed_form(seq, CENTERS, SIZES, ASSIGN, rho)
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), expected, rtol=0, atol=2e-5)
    # one round alone: w^1 = a_m0 + rho (w^0 - a_m0) with w^0 = 0, on the edge's round-1 evaluation
    rounds_rows = RunStore(tmp_path / "run.db").rounds()
    a0 = cluster_means(CENTERS, SIZES, ASSIGN)[seq[0]]
    w1 = a0 * (1 - rho)
    task = coord.task
    assert rounds_rows[0]["metrics"]["objective"] == pytest.approx(task.objective(torch.tensor(w1)), rel=1e-5)


def test_multi_step_clients_delta_form(tmp_path):
    """E = 2 local iterations per interaction: the round contracts by prod_j (1 - eta_j), j < K E."""
    K, E, lr = 3, 2, 0.9
    summary, coord = run_inmemory(parse_config(fedchs_config(rounds=4, K=K, lr=lr, local_iters=E)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    rho = float(np.prod([1 - e for e in etas(lr, K * E)]))
    expected = closed_form(summary["edge_sequence"], CENTERS, SIZES, ASSIGN, rho)
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), expected, rtol=0, atol=2e-5)


def test_real_processes_match_closed_form_and_inmemory(tmp_path):
    text = fedchs_config(rounds=5, K=3, schedule="constant", lr=0.3)
    cfg_file = tmp_path / "fedchs.toml"
    cfg_file.write_text(text)
    assert run_local(str(cfg_file), [], str(tmp_path / "run"), quiet=True) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == "sequential"
    w = load_file(str(tmp_path / "run" / "model.safetensors"))["w"]
    expected = closed_form(summary["edge_sequence"], CENTERS, SIZES, ASSIGN, (1 - 0.3) ** 3)
    np.testing.assert_allclose(w.double().numpy(), expected, rtol=0, atol=2e-5)
    _, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    assert torch.equal(w, coord.state.params["w"])
    assert RunStore(tmp_path / "run" / "run.db").check_agreement().ok
    assert len(RunStore(tmp_path / "run" / "run.db").events("handoff")) == 4


# ----------------------------------------------------------------------------- selection rule
@pytest.mark.parametrize("count_start", [False, True])
def test_edge_sequence_equals_independent_rule(tmp_path, count_start):
    rounds = 14
    summary, _ = run_inmemory(parse_config(fedchs_config(rounds=rounds, K=1, start=2, count_start=count_start,
                                                         eval_every=0)), tmp_path)
    data = [sum(SIZES[c] for c in g) for g in ASSIGN]
    assert summary["edge_data_sizes"] == data
    assert summary["edge_graph"] == GRAPH
    assert summary["edge_sequence"] == rule_sequence(GRAPH, data, 2, rounds, count_start)
    events = RunStore(tmp_path / "run.db").events("handoff")
    hops = [(json.loads(e["detail"])["from"], json.loads(e["detail"])["to"]) for e in events]
    assert hops == list(zip(summary["edge_sequence"][:-1], summary["edge_sequence"][1:]))


@pytest.mark.parametrize("count_start, expected", [
    (False, [0, 1, 0, 4, 3, 2, 1, 0, 4, 3, 2, 1]),   # the paper's literal pseudocode (digest 2.2)
    (True, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]),
])
def test_ring_example_of_the_digest(tmp_path, count_start, expected):
    centers = RNG.normal(size=(5, 2))
    text = fedchs_config(rounds=12, K=1, graph="ring", assign=[[0], [1], [2], [3], [4]], start=0,
                         count_start=count_start, centers=centers, sizes=[100, 90, 80, 70, 60], processes=5,
                         eval_every=0)
    summary, _ = run_inmemory(parse_config(text), tmp_path)
    assert summary["edge_sequence"] == expected


def test_random_graph_is_connected_bounded_and_seeded():
    for seed in range(30):
        adj = random_graph(10, 3, seed)
        assert all(len(n) <= 3 for n in adj)
        assert all(e in adj[v] for e, ns in enumerate(adj) for v in ns)
        seen, todo = {0}, [0]
        while todo:
            for v in adj[todo.pop()]:
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        assert seen == set(range(10))
        assert adj == random_graph(10, 3, seed)
    assert random_graph(10, 3, 0) != random_graph(10, 3, 1)


def test_bad_graph_is_refused_with_the_key():
    text = fedchs_config(graph=[[1], [0], [3], [2]])   # two components
    with pytest.raises(ValueError, match="topology.graph.*not connected"):
        edge_graph(parse_config(text))
    with pytest.raises(ConfigError, match="topology.steps_per_round"):
        parse_config(fedchs_config(K=0))


# ----------------------------------------------------------------------------- bytes
def test_bytes_per_round_and_no_model_reaches_the_server_but_the_final_one(tmp_path):
    K, rounds = 3, 6
    summary, _ = run_inmemory(parse_config(fedchs_config(rounds=rounds, K=K)), tmp_path)
    store = RunStore(tmp_path / "run.db")
    per_round = store.bytes_per_round()
    for t, m in enumerate(summary["edge_sequence"], start=1):
        n_m = len(ASSIGN[m])
        assert per_round[t]["tensor_bytes"] == (2 * K * n_m + 1) * 4 * D, t   # digest 2.5
    once = [r for r in store.messages() if r["role"] == "sender"]
    to_server = [r for r in once if r["dst"] == "server" and r["tensor_bytes"] > 0]
    assert [(r["method"], r["round"], r["tensor_bytes"]) for r in to_server] == [("seq_round.reply", rounds, 4 * D)]
    from_server = [r for r in once if r["src"] == "server" and r["tensor_bytes"] > 0]
    assert from_server == []
    links = summary["bytes"]["by_link"]
    assert links["edge-edge"]["tensor_bytes"] == (rounds - 1) * 4 * D
    assert links["control"]["tensor_bytes"] == 0
    queries = [r for r in once if r["method"] == "control.seq_query"]
    assert queries and all(r["link"] == "control" for r in queries)
    assert len(queries) == sum(len(GRAPH[m]) for m in summary["edge_sequence"][:-1])
    assert store.check_agreement().ok


# ----------------------------------------------------------------------------- hostile values
INFLATE = """
import torch


class Inflate:
    \"\"\"The upload of one client with every value 3e38: finite, its loss honest, its weighted sum Inf.\"\"\"

    def __init__(self, client):
        self.client = client

    def process(self, message, ctx):
        if ctx.who.endswith(f"upload of client-{self.client}"):
            message.tensors = {k: torch.full_like(v, 3e38) for k, v in message.tensors.items()}
        return message
"""


def test_a_cluster_reply_that_overflows_the_sum_is_left_out_and_the_walk_goes_on(tmp_path, monkeypatch):
    """Finite replies whose data-weighted sum is Inf at the edge: the edge leaves that client out of
    each step (NON_FINITE_AGGREGATE, as HierFAVG's edges and the server do) and the model follows
    the closed form of its cluster without it."""
    from fedhop.common.processors import pipeline
    from fedhop.common.util import plugins

    bad = 4   # in cluster 1 with clients 2 and 3
    (tmp_path / "inflate.py").write_text(INFLATE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(plugins.PLUGIN_PATH_ENV, str(tmp_path))
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    K, lr, rounds = 3, 1.0, 6
    text = fedchs_config(rounds=rounds, K=K, lr=lr) + (f'\n[[processors]]\nname = "inflate:Inflate"\nmethods = ["train"]\n'
                                                        f'direction = "out"\nroles = ["client"]\nclient = {bad}\n')
    try:
        summary, coord = run_inmemory(parse_config(text), tmp_path / "run")
    finally:
        pipeline.unconfigure()
        plugins.unrestricted()
    assert summary["status"] == "completed", summary["error"]
    seq = summary["edge_sequence"]
    assert 1 in seq
    without = [[c for c in group if c != bad] for group in ASSIGN]
    rho = float(np.prod([1 - e for e in etas(lr, K)]))
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), closed_form(seq, CENTERS, SIZES, without, rho),
                               rtol=0, atol=2e-5)
    with sqlite3.connect(tmp_path / "run" / "run.db") as db:
        blamed = db.execute("SELECT round, node FROM events WHERE detail LIKE '%NON_FINITE_AGGREGATE%'").fetchall()
    assert {node for _, node in blamed} == {f"client-{bad}"}
    assert sorted({r for r, _ in blamed}) == [t for t, m in enumerate(seq, start=1) if m == 1]


# ----------------------------------------------------------------------------- faults
def test_unreachable_neighbour_is_skipped_by_the_rule_and_recorded(tmp_path):
    rounds, dead = 10, 3
    data = [sum(SIZES[c] for c in g) for g in ASSIGN]

    def kill_edge(net, procs, coord):
        victim = next(p for p in procs if getattr(p.endpoint, "node_id", "") == f"edge-{dead}")
        victim.endpoint.stop()

    summary, _ = run_inmemory(parse_config(fedchs_config(rounds=rounds, K=1, start=0, eval_every=0)), tmp_path,
                              before_run=kill_edge)
    assert summary["status"] == "completed", summary["error"]
    alive = rule_sequence(GRAPH, data, 0, rounds, dead={dead})
    assert summary["edge_sequence"] == alive
    assert rule_sequence(GRAPH, data, 0, rounds) != alive      # the dead edge would have been visited
    skips = RunStore(tmp_path / "run.db").events("handoff_skipped")
    expected_skips = sum(1 for m in alive[:-1] if dead in GRAPH[m])
    assert len(skips) == expected_skips == summary["handoff_skips"]
    assert all(e["node"] == f"edge-{dead}" and "no answer" in e["detail"] for e in skips)


def test_refused_handoff_goes_to_the_next_candidate(tmp_path):
    """Edge 1 answers the query but refuses the model: edge 0 hands it to the runner-up, 3."""
    from fedhop.common.transport.base import HandlerError

    def refuse(net, procs, coord):
        edge1 = next(p for p in procs if getattr(p.endpoint, "node_id", "") == "edge-1")

        def no(*a, **k):
            raise HandlerError("BUSY", "refusing the hand-off")
        edge1.sequential.take_handoff = no

    summary, _ = run_inmemory(parse_config(fedchs_config(rounds=2, K=1, start=0, eval_every=0)), tmp_path,
                              before_run=refuse)
    assert summary["status"] == "completed", summary["error"]
    # from 0: neighbours 1 (D=16) and 3 (D=15), both unvisited -> 1 first, then 3
    assert summary["edge_sequence"] == [0, 3]
    skips = RunStore(tmp_path / "run.db").events("handoff_skipped")
    assert len(skips) == 1 and skips[0]["node"] == "edge-1" and "hand-off failed" in skips[0]["detail"]


def _hier_config(tmp_path: Path) -> Path:
    centers = RNG.normal(size=(8, 4))
    text = quadratic_config(centers, np.ones_like(centers), [3, 4, 5, 6, 2, 3, 4, 5], rounds=6, local_steps=2,
                            lr=0.2, processes=2, topology='kind = "hierarchical"\nedges = 2')
    path = tmp_path / "hier.toml"
    path.write_text(text)
    return path


def test_killed_hierarchical_edge_loses_its_clients_and_rounds_complete(tmp_path):
    cfg = load_config(_hier_config(tmp_path))
    run = LocalRun(cfg, tmp_path)
    server = run.start([])
    victim = next(c for c in run.children if c.name == "edge-1")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not read_progress(tmp_path / "run.db", 1):
            time.sleep(0.02)
        assert read_progress(tmp_path / "run.db", 1), "round 2 never finished"
        os.kill(victim.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=180)
    finally:
        run.stop_all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 6
    store = RunStore(tmp_path / "run.db")
    failed_edges = store.events("edge_failed")
    assert failed_edges and {e["node"] for e in failed_edges} == {"edge-1"}
    first = min(e["round"] for e in failed_edges)
    lost = store.events("client_failed")
    assert lost and {int(e["node"].split("-")[1]) for e in lost} == {4, 5, 6, 7}   # edge-1's cluster
    for row in store.rounds():
        if row["round"] >= first:
            assert row["participants"] == 4 and row["failures"] == 4, row   # edge-0's clients only
        elif row["round"] < first - 1:
            assert row["participants"] == 8
