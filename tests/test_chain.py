"""The chain topology: WRWGD, one model walking a graph of clients and handed client to client
(topologies/chain/rule.py, topologies/chain/driver.py, topologies/chain/client.py).

Checked against an independent numpy walk on graphs the code was not written for: the
Metropolis-Hastings transition rule, the sequence of visited clients, the importance-weighted
K-step update (the final model), and the bytes per link from the formula: 4d per move on the
client-client link, 4d once on client-server (the final model), no model through the server
on the way."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.memo import forget_process_memos
from fedhop.common.util.rng import numpy_stream
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import resume_local, run_local
from fedhop.topologies.chain.client import walk_of
from fedhop.topologies.chain.rule import WalkRule, client_graph
from tests.helpers import quadratic_config

RNG = np.random.default_rng(33)
N, D = 7, 4
CENTERS = RNG.normal(0, 2, size=(N, D))
CURV = RNG.uniform(0.4, 1.6, size=(N, D))
SIZES = [3, 9, 1, 6, 4, 12, 2]
# a held-out graph: a 7-cycle with two chords, degrees 2..3
GRAPH = [[1, 6], [0, 2, 4], [1, 3], [2, 4, 6], [1, 3, 5], [4, 6], [0, 3, 5]]


def walk_config(rounds=4, hops=5, lr=0.2, K=2, seed=8, start=3, stationary='"data"', objective='"uniform"',
                graph=GRAPH, processes=3, checkpoint_every=0) -> str:
    topology = (f'kind = "chain"\ngraph = {json.dumps(graph) if isinstance(graph, list) else json.dumps(graph)}\n'
                f'start = {start}\nhops_per_round = {hops}\nstationary = {stationary}\nobjective = {objective}')
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=K, lr=lr, processes=processes,
                            seed=seed, topology=topology, name="walk")
    return text.replace("eval_every = 1", f"eval_every = 1\ncheckpoint_every = {checkpoint_every}")


# ----------------------------------------------------------------------------- the independent numpy walk
def mh_matrix(graph, pi):
    n = len(graph)
    P = np.zeros((n, n))
    for i in range(n):
        for j in graph[i]:
            a = (pi[j] / len(graph[j])) / (pi[i] / len(graph[i]))
            P[i, j] = min(1.0, a) / len(graph[i])
        P[i, i] = 1.0 - P[i].sum()
    return P


def numpy_walk(rounds, hops, lr, K, seed, start, pi, p, graph=GRAPH):
    """(visited clients, final model, moves) of WRWGD on the quadratic task, computed here."""
    P = mh_matrix(graph, pi)
    w = np.zeros(D)
    holder, visited, moves = start, [], 0
    for r in range(1, rounds + 1):
        for h in range(hops):
            i = holder
            visited.append(i)
            local = w.copy()
            for _ in range(K):                             # K full-batch gradient steps of f_i
                local = local - lr * CURV[i] * (local - CENTERS[i])
            w = w + (p[i] / pi[i]) * (local - w)           # importance weight p_i / pi_i
            if r == rounds and h == hops - 1:
                break
            u = numpy_stream(seed, "walk", r, h).random()
            order = [i] + sorted(graph[i])
            cum = np.cumsum([P[i, c] for c in order])
            holder = order[min(int(np.searchsorted(cum, u, side="right")), len(order) - 1)]
            moves += holder != i
    return visited, w, moves


def test_metropolis_hastings_rule_has_the_target_law_on_random_graphs():
    for seed, n, max_degree in ((0, 12, 3), (5, 30, 4), (9, 8, 2)):
        graph = client_graph("random", n, max_degree, seed)
        assert max(len(row) for row in graph) <= max_degree
        sizes = np.random.default_rng(seed).integers(1, 50, size=n)
        cfg = parse_config(quadratic_config(np.zeros((n, 2)), np.ones((n, 2)), sizes.tolist(), seed=seed,
                                            topology=f'kind = "chain"\nmax_degree = {max_degree}'))
        rule = WalkRule.from_config(cfg, sizes.tolist())
        assert rule.graph == graph
        pi = sizes / sizes.sum()
        P = rule.P.dense()
        np.testing.assert_allclose(P, mh_matrix(graph, pi), atol=1e-12)
        np.testing.assert_allclose(pi @ P, pi, atol=1e-12)        # stationary law
        np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
        np.testing.assert_allclose(pi[:, None] * P, (pi[:, None] * P).T, atol=1e-12)   # reversible


@pytest.mark.parametrize("stationary, objective", [('"data"', '"uniform"'), ('"uniform"', '"data"'),
                                                   ("[1.0, 2.0, 0.5, 3.0, 1.0, 2.0, 4.0]", '"uniform"')])
def test_walk_and_model_equal_the_numpy_walk(tmp_path, stationary, objective):
    rounds, hops, lr, K, seed, start = 4, 5, 0.2, 2, 8, 3
    cfg = parse_config(walk_config(rounds, hops, lr, K, seed, start, stationary, objective))
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed", summary["error"]
    sizes = np.asarray(SIZES, dtype=float)
    weights = {'"data"': sizes / sizes.sum(), '"uniform"': np.full(N, 1 / N)}
    pi = weights.get(stationary)
    if pi is None:
        raw = np.asarray(json.loads(stationary))
        pi = raw / raw.sum()
    visited, w, moves = numpy_walk(rounds, hops, lr, K, seed, start, pi, weights[objective])
    assert summary["client_walk"] == visited
    assert summary["walk_moves"] == moves
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), w, rtol=0, atol=2e-5)


def test_bytes_per_link_follow_the_formula_and_the_model_moves_peer_to_peer(tmp_path):
    rounds, hops = 3, 6
    cfg = parse_config(walk_config(rounds, hops))
    summary, _ = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed", summary["error"]
    moves = summary["walk_moves"]
    assert moves > 0
    by_link = summary["bytes"]["by_link"]
    assert by_link["client-client"]["tensor_bytes"] == 4 * D * moves          # one model per move
    assert by_link["client-client"]["messages"] == 2 * moves                 # each hand-off and its empty ack
    assert by_link["client-server"]["tensor_bytes"] == 4 * D                  # the final model, once
    store = RunStore(tmp_path / "run.db")
    handoffs = [r for r in store.messages() if r["method"] == "walk_handoff" and r["role"] == "sender"]
    assert all(r["link"] == "client-client" and r["src"] != r["dst"] for r in handoffs)
    assert store.check_agreement().ok


def test_real_processes_give_the_same_walk_model_and_bytes(tmp_path):
    """Separate OS processes over gRPC: the walk, model and bytes equal the in-memory run's."""
    text = walk_config(rounds=3, hops=4, processes=3)
    mem, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    cfg_file = tmp_path / "walk.toml"
    cfg_file.write_text(text)
    assert run_local(str(cfg_file), [], str(tmp_path / "run"), quiet=True, show_table=False) == 0
    real = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert real["client_walk"] == mem["client_walk"] and real["walk_moves"] == mem["walk_moves"]
    model = load_file(str(tmp_path / "run" / "model.safetensors"))["w"]
    assert model.equal(coord.state.params["w"])
    for link in ("client-client", "client-server"):
        assert real["bytes"]["by_link"][link]["tensor_bytes"] == mem["bytes"]["by_link"][link]["tensor_bytes"]
    assert real["ledger_agreement"]["ok"]


def test_resume_from_a_checkpoint_equals_the_uninterrupted_walk(tmp_path):
    text = walk_config(rounds=6, hops=3, checkpoint_every=2)
    cfg_file = tmp_path / "walk.toml"
    cfg_file.write_text(text)
    run_dir = tmp_path / "run"
    assert run_local(str(cfg_file), [], str(run_dir), quiet=True, show_table=False) == 0
    full = json.loads((run_dir / "summary.json").read_text())
    uninterrupted = load_file(str(run_dir / "model.safetensors"))["w"]
    checkpoints = sorted((run_dir / "checkpoints").glob("round-*.safetensors"))
    assert checkpoints[-1].name == "round-000006.safetensors"
    checkpoints[-1].unlink()                       # continue from round 4 with fresh processes
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 0
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["status"] == "completed", resumed.get("error")
    assert resumed["client_walk"] == full["client_walk"]
    assert load_file(str(run_dir / "model.safetensors"))["w"].equal(uninterrupted)


def test_chain_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="algorithm.name"):
        parse_config(walk_config().replace('name = "fedavg"', 'name = "scaffold"'))
    bad_graph = [[1], [0], [3], [2], [5], [4], []]   # not connected
    with pytest.raises(ConfigError, match="topology.graph"):
        parse_config(walk_config(graph=bad_graph))
    with pytest.raises(ConfigError, match="topology.stationary"):
        parse_config(walk_config(stationary="[1.0, 2.0]"))


def test_the_complete_graph_made_on_demand_has_the_bits_of_its_lists():
    """"complete" is made a row at a time (common/topologies/graphs.py `CompleteGraph`,
    topologies/chain/rule.py `CompleteWeights`): its neighbours, transition rows and draws are
    those of the same graph given as adjacency lists, bit for bit, at sizes across numpy's
    summation blocks (8, 128)."""
    from fedhop.common.topologies.graphs import CompleteGraph
    from fedhop.topologies.chain.rule import metropolis_hastings
    for n in (1, 2, 3, 8, 9, 129, 300):
        pi = np.random.default_rng(n).uniform(0.05, 4.0, n)
        pi /= pi.sum()
        lists = [[d for d in range(n) if d != c] for c in range(n)]
        graph = CompleteGraph(n)
        assert [list(row) for row in graph] == lists and len(graph) == n
        assert all(len(graph[c]) == n - 1 and graph[c][-1] == lists[c][-1] for c in range(n) if n > 1)
        assert all((d in graph[c]) == (d in lists[c]) for c in range(n) for d in (-1, 0, n - 1, n))
        given, made = metropolis_hastings(lists, pi), metropolis_hastings(graph, pi)
        assert np.array_equal(made.dense(), given.dense())
        assert all(np.array_equal(made.row_array(c), given.row_array(c)) for c in range(n))
        assert made.entry(n - 1, 0) == given.entry(n - 1, 0) and made.entry(0, 0) == given.entry(0, 0)


def test_a_walk_over_the_complete_graph_of_2500_clients_in_real_processes(tmp_path):
    """"complete" past the 2,000 clients its lists once held it to: a run in 2 client processes,
    its walk and final model against an independent numpy walk whose rows are computed here,
    each visit naming only the next holder's address (`walk_peers`), and the client-client bytes
    4d per move."""
    n, d, rounds, hops, lr, seed = 2_500, 2, 3, 6, 0.3, 4
    rng = np.random.default_rng(11)
    centers, curv = rng.normal(0, 2, size=(n, d)), rng.uniform(0.5, 1.5, size=(n, d))
    sizes = rng.integers(1, 20, size=n)
    topology = f'kind = "chain"\ngraph = "complete"\nstart = 7\nhops_per_round = {hops}'
    text = quadratic_config(centers, curv, sizes.tolist(), rounds=rounds, local_steps=1, lr=lr, processes=2,
                            seed=seed, topology=topology, name="complete")
    cfg_path = tmp_path / "walk.toml"
    cfg_path.write_text(text)
    assert run_local(str(cfg_path), [], out=str(tmp_path / "run"), quiet=True, show_table=False) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed", summary["error"]

    pi, p = sizes / sizes.sum(), np.full(n, 1 / n)   # stationary "data", objective "uniform" (the defaults)
    w, holder, visited, moves = np.zeros(d), 7, [], 0
    for r in range(1, rounds + 1):
        for h in range(hops):
            i = holder
            visited.append(i)
            local = w - lr * curv[i] * (w - centers[i])
            w = w + (p[i] / pi[i]) * (local - w)
            if r == rounds and h == hops - 1:
                break
            others = [c for c in range(n) if c != i]
            row = np.minimum(1.0, (pi[others] / (n - 1)) / (pi[i] / (n - 1))) / (n - 1)
            cum = np.cumsum([1.0 - row.sum(), *row])
            k = min(int(np.searchsorted(cum, numpy_stream(seed, "walk", r, h).random(), side="right")), n - 1)
            holder = i if k == 0 else others[k - 1]
            moves += holder != i
    assert summary["client_walk"] == visited and summary["walk_moves"] == moves > 0
    assert summary["client_graph_edges"] == n * (n - 1) // 2 and "client_graph" not in summary
    model = load_file(str(tmp_path / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(model, w, rtol=0, atol=1e-4)
    assert summary["bytes"]["by_link"]["client-client"]["tensor_bytes"] == 4 * d * moves
    store = RunStore(tmp_path / "run" / "run.db")
    visits = [r for r in store.messages() if r["method"] == "walk_visit" and r["role"] == "sender"]
    assert len(visits) == rounds * hops
    # a visit is a few hundred bytes: the next holder's address, not the 2,499 neighbours' (about 60 kB)
    assert max(r["payload_bytes"] for r in visits) < 400
    assert store.check_agreement().ok


def test_a_random_graph_past_10000_clients_is_drawn_in_the_config_check():
    """"random" past the 10,000 clients it was once held to is drawn in the config check."""
    cfg = parse_config(_chain_at_scale(50_000, "random"))
    graph = client_graph("random", 50_000, cfg.topology.params.max_degree, cfg.run.seed)
    assert len(graph) == 50_000 and max(map(len, graph)) == cfg.topology.params.max_degree


def test_a_random_graph_past_2000_clients_is_drawn_bounded_connected_and_seeded():
    """The seeded "random" graph (common/topologies/randomgraph.py) past the 2,000 clients it was
    once held to: the config check draws it, bounded by max_degree, symmetric and connected, and
    the walk's rule holds the same graph; another seed draws another."""
    from fedhop.common.topologies.graphs import connected
    text = _chain_at_scale(3_000, "random").replace('graph = "random"', 'graph = "random"\nmax_degree = 5')
    cfg = parse_config(text)
    graph = client_graph("random", 3_000, 5, cfg.run.seed)
    assert len(graph) == 3_000 and max(map(len, graph)) == 5 and connected(graph)
    assert all(c in graph[d] for c, row in enumerate(graph) for d in row)
    assert WalkRule.from_config(cfg, np.ones(3_000)).graph is graph   # drawn once in this process
    assert client_graph("random", 3_000, 5, cfg.run.seed + 1) != graph


def _chain_at_scale(n: int, graph: str) -> str:
    from fedhop.deploy.bench.bench_system import _scale_text
    return _scale_text(n, 2, 10, 1, True).replace("[clients]", f'[topology]\nkind = "chain"\ngraph = "{graph}"\n[clients]')


@pytest.fixture(autouse=True)
def _forget_kept_graphs():
    """A graph this process kept (`built_graph`: a ring of 1,000,000 clients) is not carried into
    the next test."""
    yield
    forget_process_memos()


def test_a_built_in_graph_is_built_once_per_process(monkeypatch):
    """The config check, the driver and each client host ask for the walk's graph: a seeded
    "random" graph is drawn once in this process and the same lists shared; another seed or
    max_degree draws its own; forgotten, the same graph is drawn again."""
    from fedhop.common.topologies import graphs
    real, draws = graphs.random_graph, []

    def counted(*args, **kwargs):
        draws.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(graphs, "random_graph", counted)
    text = walk_config(graph="random").replace("[topology]", "[topology]\nmax_degree = 3")
    cfg = parse_config(text)                                  # the config check draws it
    assert len(draws) == 1
    rule = WalkRule.from_config(cfg, SIZES)
    assert WalkRule.from_config(parse_config(text), SIZES).graph is rule.graph and len(draws) == 1
    assert all(len(row) <= 3 for row in rule.graph)
    WalkRule.from_config(parse_config(text.replace("seed = 8", "seed = 9")), SIZES)
    WalkRule.from_config(parse_config(text.replace("max_degree = 3", "max_degree = 4")), SIZES)
    assert len(draws) == 3                                    # each its own
    forget_process_memos()
    again = WalkRule.from_config(cfg, SIZES)
    assert again.graph is not rule.graph and again.graph == rule.graph and len(draws) == 4


def test_a_walk_over_a_ring_of_a_million_clients_builds_with_the_closed_form_law():
    """The transition matrix is kept as its entries on the graph's edges and diagonal
    (common/topologies/edgeweights.py): a ring of 1,000,000 clients builds (its N x N array
    would be 8 TB), and with the check's equal sizes pi is uniform, so each step goes to either
    neighbour with probability 1/2 and never stays (P_ij = (1/2) min(1, 1) = 1/2, P_ii = 0)."""
    from fedhop.topologies.chain.rule import WalkRule
    n = 1_000_000
    rule = WalkRule.from_config(parse_config(_chain_at_scale(n, "ring")), [1] * n)
    for i in (0, 1, 499_999, n - 1):
        assert list(rule.graph[i]) == sorted({(i - 1) % n, (i + 1) % n})
        assert rule.is_candidate(i, i) and rule.is_candidate(i, (i + 1) % n) and not rule.is_candidate(i, (i + 2) % n)
        assert rule.P.row(i) == [0.0, 0.5, 0.5]
    assert rule.P.entry(7, 9) == 0.0 and rule.P.entry(7, 8) == 0.5
    assert rule.P.edge_values.size == 2 * n and rule.P.diagonal.size == n
    moves = [rule.next_client(10, 1, h) for h in range(40)]
    assert set(moves) == {9, 11}   # a fair coin over the two neighbours, seeded


def test_a_handoff_is_taken_only_at_the_hop_where_the_walk_moves_there():
    """walk_handoff from a peer process: the sender must be a graph neighbour and the receiver
    its draw for that hop (WalkRule.next_client, seeded), once per hop; anything else is refused
    with a typed error and leaves the walk's state alone."""
    from fedhop.client.host import ClientHost
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.transport.base import HandlerError
    host = ClientHost(parse_config(walk_config()), "client-proc1", list(range(N)), run_id="")
    rule = walk_of(host).rule
    rnd, sender = 2, 3
    moves = [(hop, rule.next_client(sender, rnd, hop)) for hop in range(40)]
    hop, receiver = next((h, c) for h, c in moves if c != sender)
    other_hop = next(h for h, c in moves if c != receiver)
    model = Payload(tensors={k: v + 1.0 for k, v in walk_of(host).initial.items()}, scalars={"from": sender})

    def handoff(h, frm=sender, dst=receiver):
        payload = Payload(tensors=model.tensors, scalars={"from": frm})
        return walk_of(host).take_handoff("client-proc0", f"client-{dst}", rnd, h, payload)

    with pytest.raises(HandlerError) as exc:
        handoff(other_hop)
    assert exc.value.code == "NOT_NEXT" and walk_of(host).holder is None
    stranger = next(c for c in range(N) if c not in GRAPH[receiver] and c != receiver)
    with pytest.raises(HandlerError) as exc:
        handoff(hop, frm=stranger)
    assert exc.value.code == "NOT_NEIGHBOUR" and walk_of(host).holder is None
    handoff(hop)   # kept aside until the server's visit names it (topologies/chain/client.py `_continued`)
    kept = walk_of(host).pending[(rnd, hop, sender, "client-proc0")]
    assert walk_of(host).holder is None
    assert all(bool((kept[k] == model.tensors[k]).all()) for k in model.tensors)
    with pytest.raises(HandlerError) as exc:
        handoff(hop)
    assert exc.value.code == "DUPLICATE"
