"""Issue 46, item 6: asynchronous federated learning (FedBuff, FedAsync: topologies/asynchronous/)
over real processes (`fedhop run`), against an independent numpy replay of the order run.db
recorded.

The task is the float64 quadratic, full batch: client i's local SGD from w is the closed form
w <- w - lr C_i (w - A_i), `local_steps` times, so the model each update produces follows from
the recorded (client, version sent) alone.  The replay keeps every server version, recomputes
each update's staleness and weight from the paper's functions (written out below, not imported)
and applies FedBuff's buffered mean or FedAsync's mixing step; the run's final model must match
to 1e-10.  The device slowdowns are listed per client, so the simulated finish time of every
update (dispatch time + local_steps * step_seconds * slowdown) is checked from the config too.
"""
from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.deploy.cli.cli import main as fedhop
from tests.helpers import quadratic_config

RNG = np.random.default_rng(46)
N, D = 6, 4
CENTERS = RNG.normal(0, 2, size=(N, D))
CURV = RNG.uniform(0.5, 2.0, size=(N, D))
SIZES = [3, 5, 2, 4, 6, 1]
SLOWDOWN = [1.0, 3.0, 1.0, 7.0, 2.0, 1.5]   # clients 3 and 1 are the stragglers
LOCAL_STEPS, LR, STEP_SECONDS = 3, 0.1, 0.01
ROUNDS = 6


def config(mode: str, staleness: str, *, seed: int = 0, clock: str = "virtual", extra: str = "") -> str:
    """The keys the mode and staleness function read, and no other (one they do not read is refused):
    FedBuff K = 2 (behind edges both modes' clients per edge call), eta_g = 0.8; FedAsync alpha =
    0.6; a = 0.5 (polynomial, hinge), b = 1 (hinge)."""
    keys = (("buffer_size = 2\n" if mode == "fedbuff" or "edges" in extra else "")
            + ("server_lr = 0.8\n" if mode == "fedbuff" else "mixing = 0.6\n")
            + ("staleness_a = 0.5\n" if staleness != "constant" else "")
            + ("staleness_b = 1\n" if staleness == "hinge" else ""))
    topology = (f'kind = "asynchronous"\nmode = "{mode}"\nconcurrency = 3\n{keys}staleness = "{staleness}"\n'
                f'clock = "{clock}"\n{extra}')
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=LOCAL_STEPS, lr=LR, seed=seed,
                            topology=topology, name=f"async-{mode}")
    return (text.replace("[data]\n", '[data]\ndtype = "float64"\n')
                .replace("[clients]\n", f"[clients]\nslowdown = {{dist = \"per_client\", values = {SLOWDOWN}}}\n"
                                        f"step_seconds = {STEP_SECONDS}\n"))


_RUNS: dict[tuple, Path] = {}


def run(tmp_path_factory, mode: str, staleness: str, **kw) -> Path:
    """The run directory of a completed `fedhop run` of `config(...)` (each config run once per session)."""
    key = (mode, staleness, tuple(sorted(kw.items())))
    if key not in _RUNS:
        base = tmp_path_factory.mktemp(f"async-{mode}-{staleness}")
        (base / "exp.toml").write_text(config(mode, staleness, **kw))
        assert fedhop(["run", str(base / "exp.toml"), "--out", str(base / "run"), "--quiet"]) == 0
        _RUNS[key] = base / "run"
    return _RUNS[key]


def rows(run_dir: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{run_dir / 'run.db'}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def updates(run_dir: Path) -> list[dict]:
    cols = ("arrival", "dispatch", "client", "sent_version", "applied_version", "staleness", "weight",
            "sim_dispatch", "sim_arrival", "status")
    return [dict(zip(cols, r)) for r in rows(run_dir, f"SELECT {', '.join(cols)} FROM async_updates ORDER BY dispatch")]


def final_model(run_dir: Path) -> np.ndarray:
    return load_file(str(run_dir / "model.safetensors"))["w"].double().numpy()


# ----------------------------------------------------------------------------- the independent replay
def s(kind: str, st: int, a: float = 0.5, b: int = 1) -> float:
    """Xie et al. 2019's staleness functions, written here from the paper."""
    return {"constant": 1.0, "polynomial": (st + 1.0) ** -a,
            "hinge": 1.0 if st <= b else 1.0 / (a * (st - b) + 1.0)}[kind]


def local(w: np.ndarray, i: int) -> np.ndarray:
    for _ in range(LOCAL_STEPS):
        w = w - LR * CURV[i] * (w - CENTERS[i])
    return w


def replay(ups: list[dict], mode: str, staleness: str) -> np.ndarray:
    """The model the recorded order gives under the paper's rule (FedBuff K = 2, eta_g = 0.8;
    FedAsync alpha = 0.6); asserts the recorded staleness and weights on the way."""
    applied = sorted((u for u in ups if u["status"] == "applied"), key=lambda u: u["arrival"])
    versions = [np.zeros(D)]
    w = versions[0]
    if mode == "fedbuff":
        for v in range(1, ROUNDS + 1):
            group = [u for u in applied if u["applied_version"] == v]
            assert len(group) == 2
            total = np.zeros(D)
            for u in group:
                st = v - 1 - u["sent_version"]
                assert u["staleness"] == st and u["weight"] == pytest.approx(s(staleness, st), abs=1e-15)
                x0 = versions[u["sent_version"]]
                total = total + s(staleness, st) * (local(x0, u["client"]) - x0)
            w = w + 0.8 * total / 2
            versions.append(w)
    else:
        assert [u["applied_version"] for u in applied] == list(range(1, ROUNDS + 1))
        for u in applied:
            st = len(versions) - 1 - u["sent_version"]
            assert u["staleness"] == st
            a_t = 0.6 * s(staleness, st)
            w = (1 - a_t) * w + a_t * local(versions[u["sent_version"]], u["client"])
            versions.append(w)
    return w


CASES = [(m, k) for m in ("fedbuff", "fedasync") for k in ("constant", "polynomial", "hinge")]


@pytest.mark.parametrize("mode,staleness", CASES)
def test_the_model_is_the_papers_rule_over_the_recorded_order(tmp_path_factory, mode, staleness):
    run_dir = run(tmp_path_factory, mode, staleness)
    ups = updates(run_dir)
    want = replay(ups, mode, staleness)
    np.testing.assert_allclose(final_model(run_dir), want, rtol=0, atol=1e-10)
    assert np.linalg.norm(want) > 0.5   # it moved: the comparison is not vacuous
    # staleness happened (the stragglers' updates are applied late) and the rounds table shows it
    assert max(u["staleness"] for u in ups if u["status"] == "applied") >= 1
    metrics = rows(run_dir, "SELECT MAX(json_extract(metrics_json, '$.staleness_max')), COUNT(*) FROM rounds")[0]
    assert metrics[0] >= 1 and metrics[1] == ROUNDS


@pytest.mark.parametrize("mode,staleness", [("fedbuff", "polynomial"), ("fedasync", "hinge")])
def test_the_virtual_clock_orders_updates_by_simulated_finish_time(tmp_path_factory, mode, staleness):
    """Each update's simulated finish is its dispatch time plus its client's compute time (the
    per-client slowdowns of the config), arrivals come in that order, and each replacement is
    dispatched at the simulated time of the arrival that freed its slot (or at 0: the first 3)."""
    ups = updates(run(tmp_path_factory, mode, staleness))
    for u in ups:
        assert u["sim_arrival"] - u["sim_dispatch"] == pytest.approx(LOCAL_STEPS * STEP_SECONDS * SLOWDOWN[u["client"]],
                                                                     rel=1e-12)
    taken = sorted((u for u in ups if u["arrival"] is not None), key=lambda u: u["arrival"])
    times = [u["sim_arrival"] for u in taken]
    assert times == sorted(times)
    starts = sorted(u["sim_dispatch"] for u in ups)
    assert starts[:3] == [0.0, 0.0, 0.0] and set(starts[3:]) <= set(times)
    assert len({u["client"] for u in ups[:3]}) == 3   # three different clients in flight


@pytest.mark.parametrize("mode,staleness", [("fedbuff", "constant"), ("fedasync", "polynomial")])
def test_bytes_are_dispatches_and_uploads_times_the_model(tmp_path_factory, mode, staleness):
    """The server's ledger: every dispatch is one train request of the model's bytes (d float64),
    every upload one reply of a delta of the same size, nothing else of either kind."""
    run_dir = run(tmp_path_factory, mode, staleness)
    ups = updates(run_dir)
    dispatches = len(ups)
    uploads = sum(u["status"] in ("applied", "unused") for u in ups)
    assert uploads == dispatches   # no failures here: every call in flight at the end was waited for
    model = 8 * D
    sent = rows(run_dir, "SELECT COUNT(*), SUM(tensor_bytes) FROM messages WHERE method = 'train' AND role = 'sender' "
                         "AND src = 'server'")[0]
    back = rows(run_dir, "SELECT COUNT(*), SUM(tensor_bytes) FROM messages WHERE method = 'train.reply' AND "
                         "role = 'receiver' AND dst = 'server'")[0]
    assert sent == (dispatches, dispatches * model)
    assert back == (uploads, uploads * model)
    # the clients' side of the same messages agrees
    got = rows(run_dir, "SELECT COUNT(*), SUM(tensor_bytes) FROM messages WHERE method = 'train' AND role = 'receiver'")[0]
    assert got == (dispatches, dispatches * model)
    assert dispatches > ROUNDS * (2 if mode == "fedbuff" else 1)   # the calls still in flight at the end count too


def test_the_seed_decides_the_order_on_the_virtual_clock(tmp_path_factory):
    a = run(tmp_path_factory, "fedbuff", "polynomial")
    b = run(tmp_path_factory, "fedbuff", "polynomial", clock="virtual", seed=0)   # the same config, run again
    c = run(tmp_path_factory, "fedbuff", "polynomial", seed=1)
    order = lambda r: [(u["client"], u["sent_version"], u["applied_version"]) for u in updates(r)]
    assert order(a) == order(b)
    assert final_model(a).tobytes() == final_model(b).tobytes()
    assert order(a) != order(c)
    assert final_model(a).tobytes() != final_model(c).tobytes()


def test_real_time_order_replays_too(tmp_path_factory):
    """On real time the order is whatever arrived first; the recorded order still gives the model."""
    run_dir = run(tmp_path_factory, "fedasync", "hinge", clock="real")
    np.testing.assert_allclose(final_model(run_dir), replay(updates(run_dir), "fedasync", "hinge"), rtol=0, atol=1e-10)


BAD = [('mode = "fedsync"', "topology.mode"),
       ("buffer_size = 0", "topology.buffer_size"),
       ('staleness = "linear"', "topology.staleness"),
       ("mixing = 1.5", "topology.mixing"),
       ("concurrency = 9", "topology.concurrency")]


@pytest.mark.parametrize("line,key", BAD)
def test_a_bad_param_is_one_line_and_exit_2(tmp_path, capsys, line, key):
    text = config("fedbuff", "constant").replace('kind = "asynchronous"\n', f'kind = "asynchronous"\n{line}\n')
    name = line.split(" =")[0]
    text = "\n".join(x for x in text.splitlines() if not (x.startswith(f"{name} =") and x != line))
    (tmp_path / "c.toml").write_text(text)
    assert fedhop(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err


INERT = [("fedasync", "constant", "server_lr = 0.7", "topology.server_lr"),
         ("fedasync", "hinge", "buffer_size = 3", "topology.buffer_size"),
         ("fedbuff", "polynomial", "mixing = 0.3", "topology.mixing"),
         ("fedbuff", "constant", "staleness_a = 0.9", "topology.staleness_a"),
         ("fedasync", "polynomial", "staleness_b = 2", "topology.staleness_b"),
         ("fedbuff", "constant", 'assignment = "shuffled"', "topology.assignment")]


@pytest.mark.parametrize("mode,staleness,line,key", INERT)
def test_a_key_the_mode_does_not_read_is_refused(tmp_path, capsys, mode, staleness, line, key):
    """A key set to other than its default that the mode, the staleness function or the missing
    edges never read is one line naming it, exit 2: the user believed it changed the run.  The
    same value where it is read runs (`config` sets each key only where it is read)."""
    text = config(mode, staleness).replace('kind = "asynchronous"\n', f'kind = "asynchronous"\n{line}\n')
    (tmp_path / "c.toml").write_text(text)
    assert fedhop(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and ("does not use it" in err or "no clusters" in err), err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err


@pytest.mark.parametrize("old,new,key", [('name = "fedavg"', 'name = "scaffold"', "algorithm.name"),
                                         ('kind = "asynchronous"', 'kind = "asynchronous"\nedges = 7', "topology.edges"),
                                         ('kind = "grpc"', 'kind = "torch"', "transport.kind"),
                                         ("server_lr = 1.0", "server_lr = 0.5", "algorithm.server_lr")])
def test_what_the_async_rule_cannot_use_is_refused_naming_the_key(tmp_path, capsys, old, new, key):
    text = config("fedasync", "constant")
    assert old in text
    (tmp_path / "c.toml").write_text(text.replace(old, new, 1))
    assert fedhop(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("line,key", [("deadline_seconds = 1.0", "clients.deadline_seconds"),
                                      ("overcommit = 1.5", "clients.overcommit"),
                                      ("straggler_fraction = 0.5", "clients.straggler_fraction")])
def test_synchronous_round_keys_are_refused(tmp_path, capsys, line, key):
    (tmp_path / "c.toml").write_text(config("fedbuff", "constant").replace("[clients]\n", f"[clients]\n{line}\n"))
    assert fedhop(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_in_memory_gives_the_grpc_runs_order_and_model(tmp_path_factory, tmp_path):
    """The same config through the in-memory transport (one process): on the virtual clock the
    order and the model are the gRPC run's, bit for bit (the transport decides nothing)."""
    import torch

    from fedhop.common.config import parse_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    grpc_run = run(tmp_path_factory, "fedbuff", "polynomial")
    summary, coord = run_inmemory(parse_config(config("fedbuff", "polynomial")), tmp_path)
    assert summary["status"] == "completed" and summary["asynchronous"]["server_versions"] == ROUNDS
    order = lambda r: [(u["client"], u["sent_version"], u["applied_version"], u["status"]) for u in updates(r)]
    assert order(tmp_path) == order(grpc_run)
    assert torch.equal(coord.state.params["w"], load_file(str(grpc_run / "model.safetensors"))["w"])


def test_a_replys_reported_steps_do_not_move_its_place_in_the_order(tmp_path_factory, tmp_path, monkeypatch):
    """A straggler (client 1, slowdown 3) reports `local_steps = 0` as if it had done no work:
    on the virtual clock it is still timed by its planned steps, so the order, the simulated times
    and the model are those of the honest gRPC run (timed by the report it would have finished
    at its dispatch and been taken first, with the least staleness)."""
    import torch

    from fedhop.common.algorithms.fedavg import FedAvg
    from fedhop.common.config import parse_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    original = FedAvg.client_update

    def understated(self, ctx, message):
        reply = original(self, ctx, message)
        if ctx.client_id == 1:
            assert reply.scalars["local_steps"] == LOCAL_STEPS
            reply.scalars["local_steps"] = 0
        return reply

    monkeypatch.setattr(FedAvg, "client_update", understated)
    grpc_run = run(tmp_path_factory, "fedasync", "hinge")
    summary, coord = run_inmemory(parse_config(config("fedasync", "hinge")), tmp_path)
    assert summary["status"] == "completed"
    order = lambda r: [(u["client"], u["sent_version"], u["applied_version"], u["sim_dispatch"], u["sim_arrival"],
                        u["status"]) for u in updates(r)]
    assert 1 in [u["client"] for u in updates(tmp_path) if u["status"] == "applied"]
    assert order(tmp_path) == order(grpc_run)
    assert torch.equal(coord.state.params["w"], load_file(str(grpc_run / "model.safetensors"))["w"])


def test_a_refused_reply_is_recorded_failed_and_left_out(tmp_path, monkeypatch):
    """Client 1 replies NaN: the reply chain refuses it, the dispatch is recorded "failed" with
    the reason and a client_failed event, a replacement goes out, and the model is still the
    paper's rule over the applied updates (in memory, where the client side can be patched)."""
    from fedhop.common.algorithms.fedavg import FedAvg
    from fedhop.common.config import parse_config
    from fedhop.common.records.runstore import RunStore
    from fedhop.deploy.launch.inmemory import run_inmemory
    original = FedAvg.client_update

    def poisoned(self, ctx, message):
        reply = original(self, ctx, message)
        if ctx.client_id == 1:
            reply.tensors["w"] = reply.tensors["w"] * float("nan")
        return reply

    monkeypatch.setattr(FedAvg, "client_update", poisoned)
    summary, coord = run_inmemory(parse_config(config("fedasync", "hinge")), tmp_path)
    assert summary["status"] == "completed"
    ups = updates(tmp_path)
    failed = [u for u in ups if u["status"] == "failed"]
    assert failed and {u["client"] for u in failed} == {1}
    for u in failed:   # it ends at the earliest its reply could have come: its planned compute (no links)
        assert u["sim_arrival"] - u["sim_dispatch"] == pytest.approx(LOCAL_STEPS * STEP_SECONDS * SLOWDOWN[1],
                                                                     rel=1e-12)
    assert all(u["client"] != 1 for u in ups if u["status"] == "applied")
    assert len(RunStore(tmp_path / "run.db").events("client_failed")) == len(failed)
    np.testing.assert_allclose(coord.state.params["w"].numpy(), replay(ups, "fedasync", "hinge"), rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- behind edges
EDGE_RUNS: dict[tuple, Path] = {}
CLUSTERS = [[0, 1, 2], [3, 4, 5]]   # topology.assignment = "blocks" with 2 edges


def edge_config(mode: str, staleness: str, *, seed: int = 0, clock: str = "virtual", transport: str = "grpc") -> str:
    text = config(mode, staleness, seed=seed, clock=clock, extra="edges = 2\n")
    text = text.replace("concurrency = 3\n", "concurrency = 0\n")   # 0: every edge
    return text.replace('kind = "grpc"', f'kind = "{transport}"')


def edge_run(tmp_path_factory, mode: str, staleness: str, **kw) -> Path:
    key = (mode, staleness, tuple(sorted(kw.items())))
    if key not in EDGE_RUNS:
        base = tmp_path_factory.mktemp(f"async-edges-{mode}-{staleness}")
        (base / "exp.toml").write_text(edge_config(mode, staleness, **kw))
        here = os.getcwd()
        os.chdir(base)   # relative paths from the run's own folder, as a user runs it
        try:
            assert fedhop(["run", "exp.toml", "--out", "run", "--quiet"]) == 0
        finally:
            os.chdir(here)
        EDGE_RUNS[key] = base / "run"
    return EDGE_RUNS[key]


def edge_updates(run_dir: Path) -> list[dict]:
    cols = ("arrival", "dispatch", "client", "node", "clients", "sent_version", "applied_version", "staleness",
            "weight", "sim_dispatch", "sim_arrival", "status")
    out = [dict(zip(cols, r)) for r in rows(run_dir, f"SELECT {', '.join(cols)} FROM async_updates ORDER BY dispatch")]
    for u in out:
        u["clients"] = json.loads(u["clients"])
    return out


def edge_replay(ups: list[dict], mode: str, staleness: str) -> np.ndarray:
    """Each applied edge flush is one server update: the sample-weighted mean delta of the clients
    it trained from the version it was sent, scaled by eta_g s (FedBuff) or mixed in (FedAsync)."""
    applied = sorted((u for u in ups if u["status"] == "applied"), key=lambda u: u["arrival"])
    assert [u["applied_version"] for u in applied] == list(range(1, ROUNDS + 1))
    versions = [np.zeros(D)]
    w = versions[0]
    for u in applied:
        st = len(versions) - 1 - u["sent_version"]
        assert u["staleness"] == st and u["weight"] == pytest.approx(s(staleness, st), abs=1e-15)
        x0 = versions[u["sent_version"]]
        n = np.array([SIZES[c] for c in u["clients"]], dtype=float)
        delta = sum(n_i * (local(x0, c) - x0) for n_i, c in zip(n, u["clients"])) / n.sum()
        if mode == "fedbuff":
            w = w + 0.8 * s(staleness, st) * delta
        else:
            a_t = 0.6 * s(staleness, st)
            w = (1 - a_t) * w + a_t * (x0 + delta)
        versions.append(w)
    return w


@pytest.mark.parametrize("mode,staleness", [("fedbuff", "polynomial"), ("fedasync", "hinge"), ("fedbuff", "constant")])
def test_behind_edges_each_flush_is_one_update_of_the_papers_rule(tmp_path_factory, mode, staleness):
    """Behind 2 edges the buffer lives at the edge: every dispatch is one edge call that trains
    buffer_size = 2 of its cluster's clients; the server's model is the replay's over the
    recorded order, the clients are the edge's own, and the virtual clock times a call by its
    slowest client."""
    run_dir = edge_run(tmp_path_factory, mode, staleness)
    ups = edge_updates(run_dir)
    want = edge_replay(ups, mode, staleness)
    np.testing.assert_allclose(final_model(run_dir), want, rtol=0, atol=1e-10)
    assert np.linalg.norm(want) > 0.5
    assert max(u["staleness"] for u in ups if u["status"] == "applied") >= 1
    for u in ups:
        assert u["client"] is None and u["node"] in ("edge-0", "edge-1") and len(u["clients"]) == 2
        assert set(u["clients"]) <= set(CLUSTERS[int(u["node"][-1])])
        slowest = max(LOCAL_STEPS * STEP_SECONDS * SLOWDOWN[c] for c in u["clients"])
        assert u["sim_arrival"] - u["sim_dispatch"] == pytest.approx(slowest, rel=1e-12)
    taken = sorted((u for u in ups if u["arrival"] is not None), key=lambda u: u["arrival"])
    assert [u["sim_arrival"] for u in taken] == sorted(u["sim_arrival"] for u in taken)
    assert len({tuple(u["clients"]) for u in ups if u["node"] == "edge-0"}) > 1   # the draw changes per call


@pytest.mark.parametrize("mode,staleness", [("fedbuff", "polynomial"), ("fedasync", "hinge")])
def test_behind_edges_bytes_are_dispatches_and_uploads_on_both_links(tmp_path_factory, mode, staleness):
    """edge-server: one edge_round request and one reply of the model's bytes per edge call;
    client-edge: one train request and reply per client an edge call trained."""
    run_dir = edge_run(tmp_path_factory, mode, staleness)
    ups = edge_updates(run_dir)
    calls, trained = len(ups), sum(len(u["clients"]) for u in ups)
    model = 8 * D
    q = "SELECT COUNT(*), SUM(tensor_bytes) FROM messages WHERE method = '{m}' AND role = '{r}' AND {side}"
    assert rows(run_dir, q.format(m="edge_round", r="sender", side="src = 'server'"))[0] == (calls, calls * model)
    assert rows(run_dir, q.format(m="edge_round.reply", r="receiver", side="dst = 'server'"))[0] == (calls, calls * model)
    assert rows(run_dir, q.format(m="train", r="receiver", side="1"))[0] == (trained, trained * model)
    assert rows(run_dir, q.format(m="train.reply", r="sender", side="1"))[0] == (trained, trained * model)
    assert calls > ROUNDS   # the call still in flight at the end counts too


def test_behind_edges_the_seed_decides_the_order_and_the_draws(tmp_path_factory):
    a = edge_run(tmp_path_factory, "fedbuff", "polynomial")
    c = edge_run(tmp_path_factory, "fedbuff", "polynomial", seed=3)
    order = lambda r: [(u["node"], tuple(u["clients"]), u["sent_version"], u["applied_version"]) for u in edge_updates(r)]
    assert order(a) != order(c)
    np.testing.assert_allclose(final_model(c), edge_replay(edge_updates(c), "fedbuff", "polynomial"), rtol=0, atol=1e-10)


def test_behind_edges_in_memory_gives_the_grpc_runs_order_and_model(tmp_path_factory, tmp_path):
    import torch

    from fedhop.common.config import parse_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    grpc_run = edge_run(tmp_path_factory, "fedasync", "hinge")
    summary, coord = run_inmemory(parse_config(edge_config("fedasync", "hinge", transport="inmemory")), tmp_path)
    assert summary["status"] == "completed"
    order = lambda r: [(u["node"], tuple(u["clients"]), u["sent_version"], u["status"]) for u in edge_updates(r)]
    assert order(tmp_path) == order(grpc_run)
    assert torch.equal(coord.state.params["w"], load_file(str(grpc_run / "model.safetensors"))["w"])


@pytest.mark.parametrize("old,new,key", [("buffer_size = 2\n", "buffer_size = 4\n", "topology.buffer_size"),
                                         ("concurrency = 0\n", "concurrency = 3\n", "topology.concurrency")])
def test_behind_edges_bad_sizes_are_one_line_and_exit_2(tmp_path, capsys, old, new, key):
    """Clusters of 3 cannot give an edge call 4 clients; 2 edges cannot hold 3 calls."""
    text = edge_config("fedbuff", "constant")
    assert old in text
    (tmp_path / "c.toml").write_text(text.replace(old, new, 1))
    assert fedhop(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_behind_edges_the_live_page_draws_the_edges_with_their_bytes(tmp_path_factory):
    """The live page's graph (deploy/tools/dashboard.py) draws an edge per cluster, each
    edge-server link with the server's framed bytes to and from that edge in the ledger."""
    from fedhop.deploy.tools.dashboard import snapshot
    run_dir = edge_run(tmp_path_factory, "fedbuff", "polynomial")
    graph = snapshot(run_dir)["graph"]
    assert [n["id"] for n in graph["nodes"] if n["tier"] == 1] == ["edge-0", "edge-1"]
    for link in (lk for lk in graph["links"] if lk["link"] == "edge-server"):
        edge = link["b"]
        want = dict(rows(run_dir, "SELECT direction, SUM(framed_bytes) FROM messages WHERE recorder = 'server' AND "
                                  f"link = 'edge-server' AND (src = '{edge}' OR dst = '{edge}') GROUP BY direction"))
        assert link["bytes"] == want and want["down"] > 0


def test_a_dispatch_draws_its_idle_client_without_walking_every_client():
    """A dispatch draws the n-th idle client (stream ("async", "dispatch", seq)); `nth_idle` finds
    it from the busy indices alone, the same index as the idle list it used to build from every
    registered client (a 1,000,000-client run spent a third of the server's time there)."""
    from fedhop.topologies.asynchronous.driver import nth_idle

    rng = np.random.default_rng(5)
    for _ in range(500):
        size = int(rng.integers(1, 80))
        busy = sorted(int(b) for b in rng.choice(size, int(rng.integers(0, size)), replace=False))
        idle = [i for i in range(size) if i not in busy]
        assert [nth_idle(n, busy) for n in range(len(idle))] == idle, (size, busy)
    busy = list(range(0, 2_000_000, 2_000))   # 1,000 busy clients, every 2,000th from the first
    assert nth_idle(0, busy) == 1 and nth_idle(1_998, busy) == 1_999 and nth_idle(1_999, busy) == 2_001
    assert nth_idle(999_999, busy) == 1_000_500   # 501 busy at or below it: 0, 2,000, ..., 1,000,000


def test_the_next_update_is_chosen_from_each_call_ending_once_waiting_only_for_calls_that_could_come_first():
    """On the virtual clock the next update is the flight with the smallest (simulated finish,
    dispatch number) among all calls in flight.  `next_arrival` takes each call's end once from
    the driver's queue, keeps the ended flights in a heap and waits for a call still in the air
    only while that call could finish before the best ended one (its `earliest`, known at
    dispatch, at or below its finish).  Checked against the rule written out (the minimum over
    every flight, ended or not), with ties, calls ending in any order and flights dispatched
    between choices: the choice is the rule's, a wait happens exactly when an unended call's
    (earliest, seq) comes before the best ended flight, and each flight is settled once."""
    import heapq
    import queue
    from concurrent.futures import Future
    from types import SimpleNamespace

    from fedhop.topologies.asynchronous.driver import AsyncDriver, Flight

    rng = np.random.default_rng(11)
    driver = AsyncDriver.__new__(AsyncDriver)
    driver.params = SimpleNamespace(clock="virtual")
    driver.in_flight, driver.busy, driver.done = {}, [], queue.Queue()
    driver.unsettled, driver.settled_order, driver.unsettled_order, driver.sim_now = set(), [], [], 0.0
    driver.outbox = []   # the flights below are "sent" by hand
    driver.targets = [f"client-{i}" for i in range(400)]
    driver.position = {node: i for i, node in enumerate(driver.targets)}
    settled: list[int] = []
    driver.settle = lambda f: settled.append(f.seq)   # each flight's finish is set below
    in_air: list[Flight] = []   # dispatched, their calls not ended
    waits = 0

    def end(f: Flight) -> None:
        in_air.remove(f)
        f.future.set_result(None)
        driver.done.put(f.seq)

    def ended_while_waiting() -> int:   # the driver blocks: some call in the air ends
        nonlocal waits
        waits += 1
        assert driver.done.empty() and in_air
        end(in_air[int(rng.integers(len(in_air)))])
        return AsyncDriver._ended(driver)

    driver._ended = ended_while_waiting
    seq = 0

    def fly(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            seq += 1
            position = int(rng.choice([i for i in range(400) if i not in driver.busy]))
            earliest = driver.sim_now + float(rng.integers(0, 2))
            f = Flight(seq, position, 0, 1, {}, 0, driver.sim_now, Future(), node=driver.targets[position],
                       sim_finish=earliest + float(rng.integers(0, 6)), earliest=earliest)   # few values: ties
            driver.in_flight[seq] = f
            driver.busy = sorted(driver.busy + [position])
            driver.unsettled.add(seq)
            heapq.heappush(driver.unsettled_order, (f.earliest, seq))
            in_air.append(f)
        for f in rng.permutation(list(in_air)):   # some calls end now, in any order
            if rng.random() < 0.15:
                end(f)

    fly(60)
    taken, waited = [], 0
    for _ in range(300):
        expected = min(driver.in_flight.values(), key=lambda g: (g.sim_finish, g.seq))
        ended = [g for g in driver.in_flight.values() if g not in in_air]
        best_ended = min(((g.sim_finish, g.seq) for g in ended), default=(np.inf, np.inf))
        must_wait = any((g.earliest, g.seq) < best_ended for g in in_air)
        before = waits
        f = driver.next_arrival()
        assert f is expected and f.seq not in driver.in_flight
        assert (waits > before) == must_wait
        waited += must_wait
        assert all((g.earliest, g.seq) > (f.sim_finish, f.seq) for g in in_air)
        assert driver.busy == sorted(driver.position[g.node] for g in driver.in_flight.values())
        assert driver.sim_now == max(g.sim_finish for g in taken + [f])
        taken.append(f)
        fly(int(rng.integers(0, 3)))
    assert 10 < waited < 290   # both cases were met
    assert sorted(settled) == sorted(set(range(1, seq + 1)) - driver.unsettled)   # once each


def test_an_edge_calls_draw_is_the_pools_without_building_it():
    """Behind edges a dispatch draws `buffer_size` clients among those of the edge's cluster not
    reported dead (all of them when every one is): `draw_clients` gives the clients of
    `rng.choice(len(pool), k, replace=False)` over that pool without building it (250,000 ids
    a dispatch at 1,000,000 clients behind 4 edges), checked against the pool built."""
    from fedhop.topologies.asynchronous.driver import draw_clients

    rng = np.random.default_rng(8)
    for trial in range(400):
        cluster = sorted(int(c) for c in rng.choice(5_000, int(rng.integers(1, 60)), replace=False))
        gone = {c for c in cluster if rng.random() < rng.choice([0.0, 0.3, 1.0])} | {int(rng.integers(5_000, 6_000))}
        k = int(rng.integers(1, 70))
        pool = [c for c in cluster if c not in gone] or list(cluster)
        want = sorted(pool[int(i)] for i in np.random.default_rng(trial).choice(len(pool), size=min(k, len(pool)),
                                                                               replace=False))
        assert draw_clients(cluster, gone, k, np.random.default_rng(trial)) == want, (cluster, gone, k)


def test_dispatches_sent_in_batches_give_the_one_by_one_runs_order_and_model(tmp_path):
    """On the virtual clock dispatches are held and sent together (concurrency / 8 at a time,
    `transport.batch`: one call per client process, each request with its own step), and sent
    before the server waits for a call.  The order does not depend on when a call goes out, so
    48 clients with lognormal slowdowns in 2 processes, 24 in flight, give the same rows, times
    and model bit for bit with `transport.batch = false` (one call per dispatch); the same
    request messages and payload bytes, and fewer framed bytes (a batch's later messages share
    their call's framing), which shows the batches happened."""
    rng = np.random.default_rng(3)
    n = 48
    centers, curv = rng.normal(0, 2, size=(n, D)), rng.uniform(0.5, 2.0, size=(n, D))
    topology = ('kind = "asynchronous"\nmode = "fedbuff"\nconcurrency = 24\nbuffer_size = 6\nserver_lr = 0.8\n'
                'staleness = "constant"\n')
    text = quadratic_config(centers, curv, [int(x) for x in rng.integers(1, 7, n)], rounds=6,
                            local_steps=LOCAL_STEPS, lr=LR, seed=4, topology=topology, name="async-batch")
    text = (text.replace("[data]\n", '[data]\ndtype = "float64"\n')
                .replace("[clients]\n", '[clients]\nslowdown = {dist = "lognormal", median = 2.0, sigma = 0.5}\n'))

    def played(batch: bool) -> tuple[list[tuple], np.ndarray, dict]:
        out = tmp_path / f"batch-{batch}"
        (tmp_path / f"{out.name}.toml").write_text(text.replace('kind = "grpc"', f'kind = "grpc"\nbatch = {str(batch).lower()}'))
        assert fedhop(["run", str(tmp_path / f"{out.name}.toml"), "--out", str(out), "--quiet"]) == 0
        ups = [(u["client"], u["sent_version"], u["applied_version"], u["sim_dispatch"], u["sim_arrival"],
                u["status"], u["weight"]) for u in updates(out)]
        sent = rows(out, "SELECT dst, step, tensor_bytes, payload_bytes, framed_bytes FROM messages "
                         "WHERE recorder = 'server' AND role = 'sender' AND method = 'train'")
        return ups, final_model(out), {"messages": sorted(r[:4] for r in sent),
                                       "payload": sum(r[3] for r in sent), "framed": sum(r[4] for r in sent)}

    plain, batched = played(False), played(True)
    assert batched[0] == plain[0] and len({u[0] for u in plain[0]}) > 10
    assert batched[1].tobytes() == plain[1].tobytes()
    assert batched[2]["messages"] == plain[2]["messages"] and len(plain[2]["messages"]) == len(plain[0])
    assert len({m[1] for m in plain[2]["messages"]}) == len(plain[0])   # each dispatch its own step
    assert batched[2]["payload"] == plain[2]["payload"] and batched[2]["framed"] < plain[2]["framed"]


def test_the_dispatches_of_one_model_version_share_one_copy_of_it(tmp_path, monkeypatch):
    """Each dispatch keeps the model version it sent (the rule reads it at the update); the
    dispatches of one version and round share one copy and one message (FedBuff: a buffer's
    worth), so the server holds a copy per version in flight, not per call, and the fabric
    encodes a group's message once.  The model is still the paper's rule over the recorded order."""
    from fedhop.common.config import parse_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    from fedhop.topologies.asynchronous.driver import AsyncDriver
    original = AsyncDriver.version_message
    made: dict[tuple[int, int], set[int]] = {}

    def watched(self, round):
        sent, plain, spec = original(self, round)
        made.setdefault((self.version, round), set()).add(id(sent))
        return sent, plain, spec

    monkeypatch.setattr(AsyncDriver, "version_message", watched)
    summary, coord = run_inmemory(parse_config(config("fedbuff", "constant")), tmp_path)
    ups = updates(tmp_path)
    assert summary["status"] == "completed" and len(ups) > len(made) > 1
    assert all(len(ids) == 1 for ids in made.values())
    np.testing.assert_allclose(coord.state.params["w"].numpy(), replay(ups, "fedbuff", "constant"), rtol=0, atol=1e-10)
