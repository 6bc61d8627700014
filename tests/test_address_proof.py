"""Identity and admission (issue 44, item 4; DESIGN.md section 9): a registrant proves it serves
at the address it claims, registrations cannot starve heartbeats, refusals leave few rows.

- B3.2: once a client process is dead, an insider registers a new node id at its address: refused,
  it cannot answer the server's probe there; the real process restarted at that address
  registers again and its clients train in the later rounds.
- 3.4: a second registration of a live node id from that node's own address, by a caller that
  did not send the node's registration, is refused (it cannot prove the address either).
- B5.13 / B5.10: 8 node ids (the victim's among them) x 4 slow Register calls, held open and
  opened again as they are cut, while the server waits for its last client: no process is
  marked dead, and the run completes once the flood stops.
- 4.4: 500 invented node ids refused: a bounded number of `register_refused` rows, the overflow
  counted in one of them.

Real processes on loopback: the server and client processes of tests/attacks.py (a shared run
token, the insider minting any node's) or of `fedhop run` (`LocalRun`, per-node credentials).
"""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import threading
import time

import grpc

from fedhop.common.config import load_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.security.auth import NodeCredentials
from fedhop.common.transport.admission import EVENTS_PER_INTERVAL
from fedhop.common.transport.grpc import REGISTER, GrpcEndpoint, grpc_options
from fedhop.common.util.nodeids import id_spec
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from tests import attacks
from tests.faultkit import CENTERS, CURV, FAST_LIVENESS, SIZES
from tests.helpers import quadratic_config, wait_until

SETUP = 300.0   # seconds processes may take to start on a loaded machine


def _wait(what: str, check, timeout: float = SETUP, proc=None):
    """`wait_until` with this file's start-up allowance, failing at once if `proc` (the server) ends."""
    return wait_until(what, check, [] if proc is None else [proc], timeout)


def _events(db, kind: str) -> list[dict]:
    if not db.exists():
        return []
    store = RunStore(db)
    try:
        return store.events(kind)
    except Exception:   # the server is creating its tables
        return []
    finally:
        store.close()


def _completed(run: attacks.Run) -> RunStore:
    """The run's records once its server has ended: exit 0 and the run recorded "completed"."""
    out = run.finish()
    store = RunStore(run.dir / "run" / "run.db")
    assert out["exit"] == 0 and store.run()["status"] == "completed"
    return store


# ----------------------------------------------------------------------------- B3.2
def test_a_squatter_cannot_take_a_dead_clients_address_and_the_restart_trains(tmp_path):
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.deploy.launch.launcher import LocalRun

    rounds = 25   # the restart (a fresh interpreter) spans 3-6 rounds of ~1 s; the rest show it trains
    cfg_file = tmp_path / "squat.toml"
    cfg_file.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=1000, lr=0.001,
                                         processes=2, name="squat"))
    run = LocalRun(load_config(cfg_file, FAST_LIVENESS), tmp_path / "run", workdir=tmp_path)
    server = run.start([])
    db = run.run_dir / "run.db"
    victim = "client-proc0"
    hosted = {p.node_id: p.clients for p in plan_processes(run.cfg).clients}
    try:
        address = (run.run_dir / "server.address").read_text().strip()
        home = _wait("the victim registered", lambda: next(
            (e["detail"].split(" at ")[1].split(" ")[0] for e in _events(db, "registered") if e["node"] == victim),
            None), proc=server.proc)
        ledger = run.run_dir / "ledger" / f"{victim}.jsonl"
        _wait("a heartbeat of the victim", lambda: ledger.exists() and b'"heartbeat.reply"' in ledger.read_bytes(),
              proc=server.proc)
        _wait("round 1", lambda: RunStore(db).rounds() if db.exists() else None, proc=server.proc)
        child = next(c for c in run.children if c.name == victim)
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        _wait("the victim marked dead", lambda: [e for e in _events(db, "node_dead") if e["node"] == victim],
              timeout=60, proc=server.proc)
        # an insider with its own valid credential claims the dead process's address for a new node id
        creds = NodeCredentials.from_options("client-procS", env_cred=run.authority.issue("client-procS"))
        squatter = GrpcEndpoint("client-procS", Ledger(), credentials=creds)
        try:
            reply = squatter.register(address, pb.RegisterRequest(node_id="client-procS", role="client",
                                                                  address=home), 10.0)
        finally:
            squatter.stop(grace=0.1)
        assert not reply.accepted and reply.message.startswith("ADDRESS_UNPROVEN"), reply.message
        # the real process, restarted on its own address, registers again
        restarted = run.spawn(victim, ["client", "--parent", address, "--clients", id_spec(hosted[victim]),
                                       "--node-id", victim, "--listen", home,
                                       "--ledger-dir", str(run.run_dir / "ledger")] + run.security_args())
        back = _wait("the victim registered again", lambda: [e for e in _events(db, "node_returned")
                                                            if e["node"] == victim], timeout=120, proc=server.proc)
        returned_at = int(back[0]["round"])
        assert returned_at < rounds - 3, f"the victim came back at round {returned_at} of {rounds}"
        assert server.proc.wait(timeout=300) == 0
        assert restarted.proc.wait(timeout=60) == 0
    finally:
        run.stop_all()
    store = RunStore(db)
    assert store.run()["status"] == "completed"
    # every round begun after the return had the victim's clients' results (rounds 1 and 2 of the
    # issue's attack: none of them, the restart refused ADDRESS_TAKEN)
    later = [int(r["round"]) for r in store.rounds() if r["round"] > returned_at + 1]   # the next may be drawn before
    assert later, (returned_at, rounds)
    trained = _trained(db, [f"client-{c}" for c in hosted[victim]])
    assert set(later) <= trained, (returned_at, sorted(trained))
    refused = [e for e in store.events("register_refused") if e["node"] == "client-procS"]
    assert refused and "ADDRESS_UNPROVEN" in refused[0]["detail"], refused


def _trained(db, clients: list[str]) -> set[int]:
    """The rounds in which the server accepted a train reply from every one of `clients`."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT round, COUNT(DISTINCT src) FROM messages WHERE method = 'train.reply' AND "
                            "role = 'receiver' AND status = 'ok' AND src IN (%s) GROUP BY round"
                            % ",".join("?" * len(clients)), clients).fetchall()
    return {int(r) for r, n in rows if n == len(clients)}


# ----------------------------------------------------------------------------- B5.13 / B5.10
def _slow_registers(address: str, callers: list[str], stop: threading.Event) -> dict:
    """Keep one slow Register call per entry of `callers` open (headers sent, never the message),
    opening another as one is cut, until `stop`; counts of how they ended."""
    channel = grpc.insecure_channel(address, options=grpc_options(1 << 20))
    stub = channel.stream_unary(REGISTER, request_serializer=None, response_deserializer=None)
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def idle():
        stop.wait()
        yield from ()

    def hold(node: str) -> None:
        metadata = NodeCredentials(node, attacks.SECRET.encode()).metadata()
        while not stop.is_set():
            try:
                stub(idle(), timeout=120, metadata=metadata)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1
            if code == "RESOURCE_EXHAUSTED":
                stop.wait(0.2)

    threads = [threading.Thread(target=hold, args=(node,), daemon=True) for node in callers]
    for t in threads:
        t.start()
    codes["_threads"] = threads   # type: ignore[assignment]
    codes["_channel"] = channel   # type: ignore[assignment]
    return codes


def test_slow_registers_from_many_ids_do_not_starve_heartbeats(tmp_path):
    """8 node ids x 4 slow Registers (client-proc0's id among them) for 3 heartbeat timeouts
    while both honest processes beat: nobody is marked dead, the victim's heartbeats are
    answered throughout, and the run completes once client 3 joins (on 32 plain worker threads
    the Registers held every thread and both processes were marked dead).  Before the flood, an
    insider's second registration of the live client-proc0 from its own address is refused
    (3.4): client-proc0 keeps its clients."""
    run = attacks.Run(tmp_path, "slow_registers", None)
    try:
        attacks._wait_registered(run, timeout=SETUP)
        for node in attacks.HONEST:
            attacks._wait_heartbeat(run, node, timeout=SETUP)
        # 3.4: the live client-proc0 registered again from its own address by an insider (the run
        # token mints its id) with no clients: refused, it cannot answer the probe there
        again = run.register("client-proc0", [], attacks._home(run, "client-proc0"))
        assert not again.accepted and again.message.startswith("ADDRESS_UNPROVEN"), again.message
        stop = threading.Event()
        callers = [node for node in ["client-proc0", *(f"client-procR{i}" for i in range(7))] for _ in range(4)]
        flood = _slow_registers(run.address, callers, stop)
        ledger = run.dir / "run" / "ledger" / "client-proc0.jsonl"
        answered_before = ledger.read_bytes().count(b'"heartbeat.reply"')
        timeout = run.cfg.security.heartbeat_timeout
        try:   # the flood lasts 3 heartbeat timeouts (the tested span), or until the server ends
            run.server.wait(3 * timeout)
        except subprocess.TimeoutExpired:
            pass
        answered = ledger.read_bytes().count(b'"heartbeat.reply"') - answered_before
        stop.set()
        for t in flood.pop("_threads"):   # type: ignore[union-attr]
            t.join(30)
        flood.pop("_channel").close()   # type: ignore[union-attr]
        assert run.server.poll() is None, "the server ended during the flood"
        run.start_third()
        store = _completed(run)
    except BaseException:
        run.kill_all()
        raise
    assert store.events("node_dead") == [], store.events("node_dead")
    assert _trained(run.dir / "run" / "run.db", ["client-0", "client-1"]) == {int(r["round"]) for r in store.rounds()}
    # the victim's heartbeats were answered through the flood (one a second: heartbeat_interval = 1 s)
    assert answered >= timeout, answered
    # the Registers were cut: refused over the lane's caps, or cancelled with no request in time
    assert flood.get("RESOURCE_EXHAUSTED", 0) > 0 and flood.get("CANCELLED", 0) > 0, flood


# ----------------------------------------------------------------------------- 4.4
def test_invented_node_ids_leave_a_bounded_number_of_rows(tmp_path):
    """500 invented node ids, each refused (a client listed twice): at most EVENTS_PER_INTERVAL
    register_refused rows per interval and one overflow row, whose count with the others' adds
    up to every refusal (there was one row per node id)."""
    run = attacks.Run(tmp_path, "invented_ids", None)
    db = run.dir / "run" / "run.db"
    try:
        attacks._wait_registered(run, timeout=SETUP)
        home = attacks._home(run, "client-proc0")
        sent = 0
        ep = run.endpoint("client-procI")
        try:
            def invented(i: int) -> pb.RegisterReply:
                node = f"client-procI{i}"
                ep.node_id = node
                ep.credentials = NodeCredentials(node, attacks.SECRET.encode())
                return ep.register(run.address, pb.RegisterRequest(
                    node_id=node, role="client", address=home,
                    clients=[pb.LogicalClient(client_id=3), pb.LogicalClient(client_id=3)]), 10.0)
            for i in range(500):
                assert not invented(i).accepted
                sent += 1
            # a refusal once the interval has passed brings the overflow row
            deadline = time.monotonic() + 120
            while not any(e["node"] == "*" for e in _events(db, "register_refused")):
                assert time.monotonic() < deadline, f"no overflow row: {len(_events(db, 'register_refused'))} rows"
                assert not invented(500 + sent).accepted
                sent += 1
                time.sleep(0.5)   # paces the refusals while polling for the row: the interval must pass
        finally:
            ep.stop(grace=0.1)
        run.start_third()
        store = _completed(run)
    except BaseException:
        run.kill_all()
        raise
    rows = store.events("register_refused")
    assert len(rows) <= 2 * (EVENTS_PER_INTERVAL + 1), len(rows)
    counted = sum(int(m) for e in rows if e["node"] == "*" for m in re.findall(r"^(\d+) more", e["detail"]))
    counted += sum(1 + sum(int(m) for m in re.findall(r"\(\+(\d+) more from", e["detail"])) for e in rows
                   if e["node"] != "*")
    assert counted == sent, (counted, sent)


# ----------------------------------------------------------------------------- B5.12
def test_slow_streams_claiming_the_parent_get_one_callers_share(tmp_path):
    """48 Exchange streams held open at client-proc0 (16 worker threads) under the node id
    `server`, which the run token lets any insider mint, through the whole run: without the
    proof of client-proc0's registration key they are one caller's, and all but its share are
    refused at once; the real server's calls, which carry the proof, are served and the run
    completes with client-proc0's clients in every round (when a claimed `server` was exempt,
    the 48 streams held every thread of the process and its clients missed their rounds)."""
    from fedhop.common.transport.admission import CallSlots
    from fedhop.common.transport.grpc import EXCHANGE

    streams = 48
    run = attacks.Run(tmp_path, "parent_streams", None)
    db = run.dir / "run" / "run.db"
    try:
        attacks._wait_registered(run, timeout=SETUP)
        attacks._wait_heartbeat(run, "client-proc0", timeout=SETUP)
        channel = grpc.insecure_channel(attacks._home(run, "client-proc0"), options=grpc_options(1 << 20))
        stub = channel.stream_stream(EXCHANGE, request_serializer=None, response_deserializer=None)
        release = threading.Event()

        def idle():
            release.wait()
            yield from ()
        metadata = NodeCredentials("server", attacks.SECRET.encode()).metadata()
        calls = [stub(idle(), timeout=600, metadata=metadata) for _ in range(streams)]
        try:
            _wait("the streams over the share refused", lambda: sum(c.done() for c in calls) >= streams - 4,
                  timeout=60)
            run.start_third()
            _wait("every round", lambda: len(RunStore(db).rounds()) >= run.cfg.run.rounds if db.exists() else None,
                  timeout=SETUP, proc=run.server)
            held = sum(not c.done() for c in calls)
        finally:
            release.set()
        codes = attacks.call_codes(calls)
        channel.close()
        store = _completed(run)
    except BaseException:
        run.kill_all()
        raise
    share = CallSlots(16).per_peer   # a client process's 16 worker threads
    assert codes.count("RESOURCE_EXHAUSTED") == streams - share and held == share, (codes, held)
    assert _trained(db, ["client-0", "client-1"]) == {int(r["round"]) for r in store.rounds()}
