"""The gossip topology: D-PSGD, clients mixing their models with their graph neighbours' with
Metropolis-Hastings weights each round (topologies/gossip/rule.py, topologies/gossip/driver.py, topologies/gossip/client.py).

Checked against an independent numpy D-PSGD on the quadratic task (closed-form gradients) on a
held-out graph the code was not written for: every client's model after every round, the
consensus distance per round, the server's model (the clients' mean), and the bytes per link
from the formula: 2 x 4d x |E| tensor bytes a round on client-client (every edge both ways),
n x 4d on client-server in evaluation rounds only, none from the server."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.memo import forget_process_memos
from fedhop.deploy.cli.cli import main as fedhop
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import LocalRun
from fedhop.topologies.gossip.client import gossip_of
from fedhop.topologies.gossip.rule import GossipRule, built_rule, mh_weights, random_regular_graph
from tests.helpers import quadratic_config

RNG = np.random.default_rng(27)
N, D = 7, 3
CENTERS = RNG.normal(0, 2, size=(N, D))
CURV = RNG.uniform(0.4, 1.6, size=(N, D))
SIZES = [4, 2, 7, 3, 5, 1, 6]
# a held-out graph: a path 0-1-...-6 with chords 0-3, 2-5, 1-6 (degrees 1..3, not regular)
EDGES = [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [0, 3], [2, 5], [1, 6]]


def gossip_config(rounds=4, K=2, lr=0.15, edges=EDGES, processes=2, eval_every=1, extra="") -> str:
    topology = f'kind = "gossip"\ngossip_edges = {json.dumps(edges)}\n{extra}'
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=K, lr=lr, processes=processes,
                            topology=topology, name="gossip")
    return text.replace("eval_every = 1", f"eval_every = {eval_every}")


# ----------------------------------------------------------------------------- the independent numpy D-PSGD
def numpy_weights(edges, n):
    nbrs = [set() for _ in range(n)]
    for i, j in edges:
        nbrs[i].add(j)
        nbrs[j].add(i)
    W = np.zeros((n, n))
    for i, j in edges:
        W[i, j] = W[j, i] = 1.0 / (1 + max(len(nbrs[i]), len(nbrs[j])))
    W[np.diag_indices(n)] = 1.0 - W.sum(axis=1)
    return W


def numpy_dpsgd(rounds, K, lr, edges=EDGES):
    """Each round's client models (n x d) and consensus distance: K full-batch gradient steps of
    f_i(x) = 1/2 sum curv_i (x - c_i)^2 from x_i, then X <- W X^{1/2}."""
    W = numpy_weights(edges, N)
    X = np.zeros((N, D))
    models, distances = [], []
    for _ in range(rounds):
        half = X.copy()
        for _ in range(K):
            half = half - lr * CURV * (half - CENTERS)
        X = W @ half
        models.append(X.copy())
        distances.append(float(((X - X.mean(axis=0)) ** 2).sum(axis=1).mean()))
    return models, distances


# ----------------------------------------------------------------------------- graphs
def test_random_regular_graphs_are_reproducible_and_regular_and_weights_are_mh():
    for n, d, seed in ((10, 3, 0), (12, 4, 5), (9, 2, 7), (16, 5, 3)):
        graph = random_regular_graph(n, d, seed)
        assert graph == random_regular_graph(n, d, seed)                  # a function of the seed
        assert all(len(row) == d and i not in row and len(set(row)) == d for i, row in enumerate(graph))
        assert all(i in graph[j] for i, row in enumerate(graph) for j in row)   # undirected
        edges = [[i, j] for i, row in enumerate(graph) for j in row if i < j]
        assert len(edges) == n * d // 2
        W = mh_weights(graph).dense()
        np.testing.assert_allclose(W, numpy_weights(edges, n), atol=1e-15)
        np.testing.assert_allclose(W, W.T, atol=0)
        np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12)        # doubly stochastic
        assert np.linalg.eigvalsh(W)[-2] < 1 - 1e-9                        # connected: one eigenvalue 1
    assert len({json.dumps(random_regular_graph(12, 3, s)) for s in range(6)}) > 1
    cfg = parse_config(quadratic_config(np.zeros((12, 2)), np.ones((12, 2)), [1] * 12, seed=4,
                                        topology='kind = "gossip"\ngossip_degree = 3'))
    assert GossipRule.from_config(cfg).graph == random_regular_graph(12, 3, 4)   # seeded from run.seed


@pytest.mark.parametrize("extra, key, why", [
    ("gossip_degree = 3", "topology.gossip_degree", "odd"),                     # 7 * 3 odd
    ("gossip_degree = 8", "topology.gossip_degree", "< clients.count"),
])
def test_impossible_regular_graphs_are_refused(extra, key, why):
    text = quadratic_config(CENTERS, CURV, SIZES, topology=f'kind = "gossip"\n{extra}')
    with pytest.raises(ConfigError, match=key) as exc:
        parse_config(text)
    assert why in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("edges, why", [
    ([[0, 1], [1, 2], [3, 4], [4, 5], [5, 6]], "not connected"),
    (EDGES + [[2, 7]], "out of range"),
    (EDGES + [[4, 4]], "self-loop"),
    ([[0, 1, 2]], "not a pair"),
])
def test_bad_explicit_graphs_are_refused(edges, why):
    with pytest.raises(ConfigError, match="topology.gossip_edges") as exc:
        parse_config(gossip_config(edges=edges))
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_what_gossip_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="algorithm.name"):
        parse_config(gossip_config().replace('name = "fedavg"', 'name = "scaffold"'))
    with pytest.raises(ConfigError, match="run.checkpoint_every"):
        parse_config(gossip_config().replace("eval_every = 1", "eval_every = 1\ncheckpoint_every = 2"))
    with pytest.raises(ConfigError, match="gossip_degree"):
        parse_config(gossip_config(extra="gossip_degree = 2"))    # both keys


# ----------------------------------------------------------------------------- runs
def test_every_client_model_each_round_equals_numpy_dpsgd_and_bytes_follow_the_formula(tmp_path):
    rounds, K, lr = 4, 2, 0.15
    cfg = parse_config(gossip_config(rounds, K, lr, processes=3))
    seen: dict[int, dict[int, np.ndarray]] = {}

    def watch(net, procs, coordinator):
        coordinator.round_listeners.append(lambda result: seen.__setitem__(
            result.round, {c: m["w"].double().numpy().copy() for c, m in coordinator.driver.models.items()}))

    summary, coord = run_inmemory(cfg, tmp_path, before_run=watch)
    assert summary["status"] == "completed", summary["error"]
    models, distances = numpy_dpsgd(rounds, K, lr)
    assert sorted(seen) == list(range(1, rounds + 1))
    for r in range(1, rounds + 1):
        got = np.stack([seen[r][c] for c in range(N)])
        np.testing.assert_allclose(got, models[r - 1], rtol=0, atol=2e-5)
    recorded = [row["metrics"]["consensus_distance"] for row in RunStore(tmp_path / "run.db").rounds()]
    np.testing.assert_allclose(recorded, distances, rtol=1e-4, atol=1e-9)
    assert distances[-1] > 0                                         # the clients have not agreed yet
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), models[-1].mean(axis=0), atol=2e-5)
    by_link = summary["bytes"]["by_link"]
    E, model = len(EDGES), 4 * D
    assert by_link["client-client"]["tensor_bytes"] == rounds * 2 * model * E    # every edge both ways
    assert by_link["client-client"]["messages"] == rounds * 2 * (2 * E)          # each share and its ack
    assert by_link["client-server"]["tensor_bytes"] == rounds * N * model        # the models up, eval rounds
    store = RunStore(tmp_path / "run.db")
    down = [r for r in store.messages() if r["src"] == "server" and r["role"] == "sender"]
    assert down and all(r["tensor_bytes"] == 0 for r in down)                    # no model from the server
    shares = [r for r in store.messages() if r["method"] == "gossip_share" and r["role"] == "sender"]
    assert len(shares) == rounds * 2 * E and all(r["link"] == "client-client" for r in shares)
    assert store.check_agreement().ok


@pytest.mark.parametrize("processes", [1, 2])
def test_shares_in_bundles_or_one_call_each_give_the_same_models_and_tensor_bytes(tmp_path, processes):
    """A process sends its clients' shares SHARE_WINDOW clients at a time, bundled per peer process
    (`transport.batch`, the default) or one call each: the mixes, and so every model and the
    bytes of every link's tensors, are the same.  A ring of 600 clients: windows of 256 in each
    process.  In bundles their messages share the calls' gRPC framing (common/transport/base.py
    `batch_framing`, recorded in memory as gRPC's calls would carry them): fewer framed bytes."""
    from fedhop.topologies.gossip.client import SHARE_WINDOW
    n, rounds = 600, 2
    assert n // processes > SHARE_WINDOW
    centers = np.random.default_rng(3).normal(0, 1, size=(n, 2))
    text = quadratic_config(centers, np.ones((n, 2)), [1] * n, rounds=rounds, local_steps=1, lr=0.1,
                            processes=processes, topology='kind = "gossip"', name="gossip-ring")
    outcomes = []
    for batch in (True, False):
        out = tmp_path / f"batch-{batch}"
        summary, coord = run_inmemory(parse_config(text.replace('kind = "grpc"', f'kind = "grpc"\nbatch = {str(batch).lower()}')), out)
        assert summary["status"] == "completed", summary["error"]
        store = RunStore(out / "run.db")
        shares = [r for r in store.messages() if r["method"] == "gossip_share" and r["role"] == "sender"]
        assert len(shares) == rounds * 2 * n                              # every ring edge both ways
        outcomes.append((coord.state.params["w"].numpy().copy(),
                         summary["bytes"]["by_link"]["client-client"]["tensor_bytes"],
                         sum(r["framed_bytes"] for r in shares)))
    (bundled, tensor_bundled, framed_bundled), (alone, tensor_alone, framed_alone) = outcomes
    assert np.array_equal(bundled, alone)
    assert tensor_bundled == tensor_alone == rounds * 2 * n * 4 * 2
    assert framed_bundled < framed_alone


def test_models_go_up_only_in_evaluation_rounds(tmp_path):
    rounds = 5
    summary, _ = run_inmemory(parse_config(gossip_config(rounds=rounds, eval_every=2)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    evaluated = [2, 4, 5]                                            # every 2nd and the last
    assert summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] == len(evaluated) * N * 4 * D
    rows = RunStore(tmp_path / "run.db").rounds()
    assert [row["round"] for row in rows if "consensus_distance" in row["metrics"]] == evaluated


def test_fedhop_run_from_outside_the_repo_in_real_processes(tmp_path):
    """`fedhop run --set topology.kind=gossip` from a user's folder: 2 client processes over gRPC,
    the clients split between them; the final model, consensus distances and bytes as computed here."""
    rounds, K, lr = 3, 2, 0.15
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=K, lr=lr, processes=2, name="g")
    (tmp_path / "quad.toml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "quad.toml", "--out", "runs/g", "--quiet",
                           "--set", "topology.kind=gossip", "--set", f"topology.gossip_edges={json.dumps(EDGES)}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "g"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == "gossip"
    assert summary["ledger_agreement"]["ok"]
    models, distances = numpy_dpsgd(rounds, K, lr)
    np.testing.assert_allclose(load_file(str(run / "model.safetensors"))["w"].double().numpy(),
                               models[-1].mean(axis=0), atol=2e-5)
    store = RunStore(run / "run.db")
    np.testing.assert_allclose([row["metrics"]["consensus_distance"] for row in store.rounds()], distances,
                               rtol=1e-4, atol=1e-9)
    assert summary["bytes"]["by_link"]["client-client"]["tensor_bytes"] == rounds * 2 * 4 * D * len(EDGES)
    procs = {r["src"] for r in store.messages() if r["method"] == "gossip_share" and r["role"] == "sender"}
    assert procs == {"client-proc0", "client-proc1"}                  # both processes sent shares



def test_a_bad_gossip_graph_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "quad.toml").write_text(quadratic_config(CENTERS, CURV, SIZES, name="g"))
    monkeypatch.chdir(tmp_path)
    assert fedhop(["run", "quad.toml", "--out", "runs/bad", "--set", "topology.kind=gossip",
                   "--set", "topology.gossip_degree=3"]) == 2                # 7 clients x degree 3 is odd
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "topology.gossip_degree" in err and "odd" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_share_is_taken_only_from_a_neighbour_hosted_by_the_calling_process_once_per_round():
    """gossip_share from a peer process: the sending client a graph neighbour of the receiving one,
    hosted by the calling process as the server's gossip_step named it, in the current round, once;
    anything else is refused with a typed error and leaves the inbox alone."""
    from fedhop.client.host import ClientHost
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.transport.base import HandlerError
    host = ClientHost(parse_config(gossip_config()), "client-proc0", [0, 1, 2], run_id="")
    gossip = gossip_of(host)
    receiver = 2                                           # neighbours 1, 3, 5 in EDGES
    gossip.step("client-2", 1, Payload(scalars={"host:1": "client-proc0", "host:3": "client-proc1",
                                                "host:5": "client-proc2"}))
    model = {k: v + 1.0 for k, v in gossip.models[0].items()}

    def share(frm, src, rnd=1):
        return gossip.take_share(src, f"client-{receiver}", rnd, Payload(tensors=model, scalars={"from": frm}))

    for frm, src, code in ((4, "client-proc1", "NOT_NEIGHBOUR"), (3, "client-proc2", "WRONG_SENDER"),
                           (3, "client-proc1", "WRONG_ROUND")):
        with pytest.raises(HandlerError) as exc:
            share(frm, src, rnd=2 if code == "WRONG_ROUND" else 1)
        assert exc.value.code == code and not gossip.inbox
    share(3, "client-proc1")
    assert gossip.inbox[(1, receiver, 3)]["w"].equal(model["w"])
    with pytest.raises(HandlerError) as exc:
        share(3, "client-proc1")
    assert exc.value.code == "DUPLICATE"
    with pytest.raises(HandlerError) as exc:               # neighbours 1 and 5 have not shared yet
        gossip.mix("client-2", 1, Payload())
    assert exc.value.code == "MISSING_SHARE" and "[1, 5]" in str(exc.value)


def test_shares_left_from_an_earlier_round_are_dropped_when_the_next_round_steps():
    """A round that ended before its mix (a failed peer) leaves shares in the inbox; the next
    round's first gossip_step drops them, and a later step of the same round keeps the round's own."""
    from fedhop.client.host import ClientHost
    from fedhop.common.algorithms.base import Payload
    host = ClientHost(parse_config(gossip_config()), "client-proc0", [0, 1, 2], run_id="")
    gossip = gossip_of(host)
    hosts = {"host:1": "client-proc0", "host:3": "client-proc1", "host:5": "client-proc2"}
    gossip.step("client-2", 1, Payload(scalars=hosts))
    model = {k: v + 1.0 for k, v in gossip.models[0].items()}
    gossip.take_share("client-proc1", "client-2", 1, Payload(tensors=model, scalars={"from": 3}))
    gossip.step("client-2", 2, Payload(scalars=hosts))
    assert gossip.inbox == {}                              # round 1's share dropped at round 2's step
    gossip.take_share("client-proc1", "client-2", 2, Payload(tensors=model, scalars={"from": 3}))
    gossip.step("client-0", 2, Payload(scalars={"host:1": "client-proc0", "host:3": "client-proc1"}))
    assert list(gossip.inbox) == [(2, 2, 3)]               # the round's own share kept


def test_where_neighbours_live_is_told_in_the_first_round_only(tmp_path):
    """Each client's gossip_step names its neighbours' processes, and each process's gossip_send
    its clients' neighbours' addresses, in the first round; later rounds send one shared empty
    message for each (the client processes keep what they were told), and the models are
    numpy's D-PSGD all the same."""
    rounds, K, lr = 3, 2, 0.15
    summary, _ = run_inmemory(parse_config(gossip_config(rounds, K, lr, processes=3)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    sent = [r for r in RunStore(tmp_path / "run.db").messages() if r["src"] == "server" and r["role"] == "sender"]

    def payload_bytes(method: str, round: int) -> list[int]:
        return [r["payload_bytes"] for r in sent if r["method"] == method and r["round"] == round]

    degree = {c: sum(c in e for e in EDGES) for c in range(N)}
    first_steps = sorted(payload_bytes("gossip_step", 1))
    assert len(first_steps) == N and len(set(first_steps)) > 1      # sized by each client's degree
    assert first_steps[0] > 0 and degree[min(degree, key=degree.get)] < max(degree.values())
    for r in range(2, rounds + 1):
        assert payload_bytes("gossip_step", r) == [payload_bytes("gossip_step", r)[0]] * N
        assert payload_bytes("gossip_step", r)[0] < first_steps[0]
        later_sends = payload_bytes("gossip_send", r)                 # the same empty message to each process
        assert len(later_sends) == 3 and len(set(later_sends)) == 1
        assert all(b > later_sends[0] for b in payload_bytes("gossip_send", 1))
    models, _ = numpy_dpsgd(rounds, K, lr)
    final = load_file(str(tmp_path / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(final, models[-1].mean(axis=0), atol=2e-5)


def test_a_process_registered_again_and_its_clients_neighbours_are_told_again():
    """The driver tells a client where its neighbours live when its own home or a neighbour's
    changed since it was last told: every client at first, none while nothing registers again,
    and after one process registers again its clients and their graph neighbours."""
    from fedhop.server.driver import ChildNode
    from fedhop.topologies.gossip.driver import GossipDriver
    driver = GossipDriver.__new__(GossipDriver)
    driver.rule = GossipRule.from_config(parse_config(gossip_config(processes=3)))
    driver.told = {}
    procs = [ChildNode(f"client-proc{k}", "client", f"a{k}", [c for c in range(N) if c % 3 == k]) for k in range(3)]
    home = {c: procs[c % 3] for c in range(N)}
    assert driver._untold(home) == set(range(N))
    driver.told = dict(home)
    assert driver._untold(home) == set()
    again = ChildNode("client-proc1", "client", "a1-new", procs[1].clients)
    moved = {**home, **{c: again for c in again.clients}}           # clients 1 and 4
    nbrs = {j for i, j in EDGES if i in again.clients} | {i for i, j in EDGES if j in again.clients}
    assert driver._untold(moved) == set(again.clients) | nbrs


def test_a_step_without_hosts_is_taken_only_for_neighbours_named_before():
    """A gossip_step may leave out the neighbours' processes the server named in an earlier
    round; a neighbour never named is refused (BAD_STEP), and shares are checked against what
    was named."""
    from fedhop.client.host import ClientHost
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.transport.base import HandlerError
    host = ClientHost(parse_config(gossip_config()), "client-proc0", [0, 1, 2], run_id="")
    gossip = gossip_of(host)
    with pytest.raises(HandlerError) as exc:
        gossip.step("client-2", 1, Payload())
    assert exc.value.code == "BAD_STEP" and "[1, 3, 5]" in str(exc.value) and 2 not in gossip.half
    gossip.step("client-2", 1, Payload(scalars={"host:1": "client-proc0", "host:3": "client-proc1",
                                                "host:5": "client-proc2"}))
    gossip.step("client-2", 2, Payload())                            # told in round 1
    model = {k: v + 1.0 for k, v in gossip.models[0].items()}
    with pytest.raises(HandlerError) as exc:
        gossip.take_share("client-proc2", "client-2", 2, Payload(tensors=model, scalars={"from": 3}))
    assert exc.value.code == "WRONG_SENDER"
    gossip.take_share("client-proc1", "client-2", 2, Payload(tensors=model, scalars={"from": 3}))
    assert list(gossip.inbox) == [(2, 2, 3)]


def test_an_unreachable_client_process_fails_the_run_with_its_reason(tmp_path):
    """Every client mixes with its neighbours, so a client process that cannot be reached fails
    the round and the run (the reason names the step and the client), no partial mix."""
    cfg = parse_config(gossip_config(rounds=3, processes=2))
    summary, _ = run_inmemory(cfg, tmp_path, before_run=lambda net, procs, coord: procs[1].endpoint.stop())
    assert summary["status"] == "failed"
    assert "gossip_step failed at client-" in summary["error"] and "gossip needs every client" in summary["error"]
    assert summary["rounds_completed"] == 0
    assert RunStore(tmp_path / "run.db").events("client_failed")


def test_a_round_past_its_deadline_names_the_key_that_sets_it(tmp_path, monkeypatch):
    """A gossip phase that outlasts `run.round_timeout` fails the run with a reason naming the key
    a user raises for a large graph (a client's local steps here end only once the server's
    wait for them has ended, the deadline 0.2 s)."""
    import threading

    from fedhop.topologies.gossip.client import GossipHost
    from fedhop.topologies.gossip.driver import GossipDriver
    step, fan_out = GossipHost.step, GossipDriver._fan_out
    waited = threading.Event()

    def late_step(self, dst, round, message):
        assert waited.wait(120), "the server's wait never ended"
        return step(self, dst, round, message)

    def noted_fan_out(self, round, sends, what):
        try:
            return fan_out(self, round, sends, what)
        finally:
            waited.set()

    monkeypatch.setattr(GossipHost, "step", late_step)
    monkeypatch.setattr(GossipDriver, "_fan_out", noted_fan_out)
    text = gossip_config(rounds=2).replace("round_timeout = 60.0", "round_timeout = 0.2")
    assert "round_timeout = 0.2" in text
    summary, _ = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0
    assert "gossip_step failed at client-" in summary["error"]
    assert "no result within run.round_timeout=0.2s" in summary["error"], summary["error"]


def _gossip_at_scale(n: int, topology: str) -> str:
    from fedhop.deploy.bench.bench_system import _scale_text
    return _scale_text(n, 2, 10, 1, True).replace("[clients]", f'[topology]\nkind = "gossip"\n{topology}\n[clients]')


def _one_pairing_by_lists(n: int, d: int, rng) -> tuple[set[tuple[int, int]] | None, int]:
    """One draw of the pairing model in passes as `_pair_stubs`' docstring states it, on lists and
    sets: its edges (None where a switch found no edge), and how many switches it made."""
    edges: set[tuple[int, int]] = set()
    stubs = [v for v in range(n) for _ in range(d)]
    switches = 0
    while stubs:
        order = [stubs[k] for k in rng.permutation(len(stubs))]
        left, joined_any = [], False
        for a, b in zip(order[0::2], order[1::2]):
            pair = (min(a, b), max(a, b))
            if a != b and pair not in edges:     # a pair met earlier in the pass is in `edges` or refused as this one
                edges.add(pair)
                joined_any = True
            else:
                left += [a, b]
        stubs = sorted(left)
        nodes = sorted(set(stubs))
        if joined_any or any((x, y) not in edges for i, x in enumerate(nodes) for y in nodes[i + 1:]):
            continue
        u, v, listed = stubs[0], stubs[1], sorted(edges)
        for _ in range(10_000):
            k = int(rng.integers(2 * len(listed)))
            x, y = listed[k // 2] if k % 2 == 0 else listed[k // 2][::-1]
            if x not in (u, v) and y not in (u, v) and (min(u, x), max(u, x)) not in edges \
                    and (min(v, y), max(v, y)) not in edges:
                edges -= {listed[k // 2]}
                edges |= {(min(u, x), max(u, x)), (min(v, y), max(v, y))}
                stubs, switches = stubs[2:], switches + 1
                break
        else:
            return None, switches
    return edges, switches


def _pairing_in_passes_by_lists(n: int, d: int, seed: int) -> tuple[list[list[int]], int, int]:
    """random_regular_graph's rule as its docstrings state it, on plain lists and sets: the graph,
    how many draws were started again, and how many switches were made."""
    from fedhop.common.topologies.graphs import connected
    from fedhop.common.util.rng import numpy_stream
    rng = numpy_stream(seed, "topology/gossip_graph")
    if d == 2:
        order = [int(v) for v in rng.permutation(n)]
        cycle: list[set[int]] = [set() for _ in range(n)]
        for a, b in zip(order, order[1:] + order[:1]):
            cycle[a].add(b)
            cycle[b].add(a)
        return [sorted(row) for row in cycle], 0, 0
    dense = 2 * d > n - 1     # drawn as the complement of an (n - 1 - d)-regular graph
    switches = 0
    for restarts in range(1000):
        edges, switched = _one_pairing_by_lists(n, n - 1 - d if dense else d, rng)
        switches += switched
        if edges is None:
            continue
        if dense:
            edges = {(a, b) for a in range(n) for b in range(a + 1, n)} - edges
        adj: list[list[int]] = [[] for _ in range(n)]
        for a, b in sorted(edges):
            adj[a].append(b)
            adj[b].append(a)
        graph = [sorted(row) for row in adj]
        if dense or connected(graph):
            return graph, restarts, switches
    raise AssertionError("no graph")


def test_random_regular_graphs_are_the_pairing_in_passes_drawn_from_the_stream():
    """random_regular_graph (numpy arrays, a pass at a time) makes the same draws from the same
    stream as its rule written out on lists, switches and restarts included, so the same graph."""
    switches = restarts = dense = 0
    for n in range(3, 26):
        for d in sorted({*range(2, min(n, 8)), *range(max(2, n - 3), n)}):   # sparse, and dense (complements)
            if n * d % 2 == 0:
                dense += 2 * d > n - 1
                for seed in range(3):
                    expected, again, switched = _pairing_in_passes_by_lists(n, d, seed)
                    assert random_regular_graph(n, d, seed) == expected, (n, d, seed)
                    restarts += again
                    switches += switched
    for seed in range(3_000):      # two K4s: 35 of the 19,355 labelled cubic graphs on 8 nodes are disconnected
        expected, again, _ = _pairing_in_passes_by_lists(8, 3, seed)
        assert random_regular_graph(8, 3, seed) == expected, seed
        restarts += again
    assert switches > 50 and restarts > 3 and dense > 50    # all happen: the test sees their draws
    for n, d, seed in ((2_500, 4, 1), (3_000, 7, 2), (1_001, 2, 3)):
        assert random_regular_graph(n, d, seed) == _pairing_in_passes_by_lists(n, d, seed)[0]


def test_random_regular_graphs_are_close_to_uniform():
    """The 70 labelled 3-regular graphs on 6 nodes each come out of 7,000 draws about as often
    (expected 100 each; a draw biased by the pass order or the switch would favour some)."""
    from collections import Counter

    from fedhop.common.util.rng import numpy_stream
    from fedhop.topologies.gossip.rule import _pair_stubs
    rng = numpy_stream(11, "uniformity")
    counts = Counter(graph.tobytes() for graph in (_pair_stubs(6, 3, rng) for _ in range(7_000)) if graph is not None)
    assert len(counts) == 70 and sum(counts.values()) == 7_000
    assert 55 <= min(counts.values()) and max(counts.values()) <= 150, sorted(counts.values())


def test_dense_regular_graphs_are_complements_close_to_uniform_and_quick():
    """Where d > (n - 1) / 2 the graph is the complement of an (n - 1 - d)-regular pairing: the 70
    labelled cubic graphs on 6 nodes (complements of the 2-regular ones) each come out of 7,000
    seeds about as often, and near-complete graphs of thousands of clients are drawn at once
    (pairing their own stubs took more than five minutes at d = n - 2 and 1,000 clients)."""
    from collections import Counter
    counts = Counter(json.dumps(random_regular_graph(6, 3, seed)) for seed in range(7_000))
    assert len(counts) == 70
    assert 55 <= min(counts.values()) and max(counts.values()) <= 150, sorted(counts.values())
    from fedhop.common.topologies.graphs import connected
    for n, d in ((1_000, 998), (1_000, 990), (3_000, 2_999), (2_000, 1_000)):
        adj = np.array(random_regular_graph(n, d, 5))
        assert adj.shape == (n, d) and (np.diff(adj, axis=1) > 0).all()               # d distinct neighbours each
        nodes = np.repeat(np.arange(n), d)
        assert (adj.ravel() != nodes).all()                                              # no self-loop
        assert np.array_equal(np.sort(nodes * n + adj.ravel()), np.sort(adj.ravel() * n + nodes))   # symmetric
        assert connected(adj.tolist())
    missing = [sorted(set(range(1_000)) - {i, *row}) for i, row in enumerate(random_regular_graph(1_000, 998, 5))]
    assert all(len(m) == 1 and missing[m[0]] == [i] for i, m in enumerate(missing))   # the complement: a perfect matching


def test_a_random_regular_graph_of_tens_of_thousands_of_clients_builds_in_the_config_check():
    """The config check builds the graph (it refuses one it cannot draw): 40,000 clients of
    degree 3, each with 3 distinct other neighbours, symmetric and connected."""
    n = 40_000
    graph = GossipRule.from_config(parse_config(_gossip_at_scale(n, "gossip_degree = 3"))).graph
    assert len(graph) == n and all(len(set(row)) == 3 and i not in row for i, row in enumerate(graph))
    assert all(i in graph[j] for i, row in enumerate(graph) for j in row)
    from fedhop.common.topologies.graphs import connected
    assert connected(graph)


@pytest.fixture(autouse=True)
def _forget_kept_rules():
    """A rule this process kept (`built_rule`: a ring of 1,000,000 clients is hundreds of MB) is
    not carried into the next test."""
    yield
    forget_process_memos()


def test_a_seeded_graph_is_drawn_once_per_process_and_the_launcher_forgets_it(tmp_path, monkeypatch):
    """The config check, the driver and each client host ask for the rule of a gossip_degree
    graph: this process draws the graph once and shares the rule (common/util/memo.py); another
    seed draws its own; forgotten, the same graph is drawn again; and a launcher whose children
    have started keeps none (the children forked after its check start with it built)."""
    import fedhop.topologies.gossip.rule as rule_module
    real, draws = rule_module._pair_stubs, []

    def counted(n, d, rng):
        draws.append((n, d))
        return real(n, d, rng)

    monkeypatch.setattr(rule_module, "_pair_stubs", counted)
    text = quadratic_config(np.zeros((12, 2)), np.ones((12, 2)), [1] * 12, seed=4, processes=2,
                            topology='kind = "gossip"\ngossip_degree = 3')
    cfg = parse_config(text)                              # the config check draws it
    drawn = len(draws)
    assert drawn >= 1 and built_rule.cache_info().currsize == 1
    rule = GossipRule.from_config(cfg)
    assert GossipRule.from_config(parse_config(text)) is rule and len(draws) == drawn   # no second draw
    other = GossipRule.from_config(parse_config(text.replace("seed = 4", "seed = 5")))
    assert other is not rule and len(draws) > drawn       # its own draw
    forget_process_memos()
    again = GossipRule.from_config(cfg)
    assert again is not rule and again.graph == rule.graph and again.W.dense().tolist() == rule.W.dense().tolist()
    run = LocalRun(cfg, tmp_path / "run")
    run.run_dir.mkdir(parents=True)
    try:
        run.start([])
        assert built_rule.cache_info().currsize == 0      # the launcher runs no rounds: nothing kept
    finally:
        run.stop_all()


def test_the_mixing_weights_of_a_ring_of_a_million_clients_build_in_closed_form():
    """The mixing matrix is kept as its entries on the graph's edges and diagonal
    (common/topologies/edgeweights.py): a ring of 1,000,000 clients builds (its N x N array
    would be 8 TB; a million clients raised a MemoryError traceback when it was dense), every
    degree is 2, so W_ij = 1 / (1 + 2) and W_ii = 1 - (W_ij + W_ij), in float64."""
    n = 1_000_000
    rule = GossipRule.from_config(parse_config(_gossip_at_scale(n, "")))
    third = 1.0 / 3.0
    for i in (0, 2, 500_000, n - 1):
        assert rule.graph[i] == sorted({(i - 1) % n, (i + 1) % n})
        assert rule.W.row(i) == [1.0 - (third + third), third, third]
    assert rule.edge_count == n
