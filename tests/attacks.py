"""The attack suite of docs/faults.md ("Attacks"): each attack against a real server process,
one command:

    .venv/bin/python -m tests.attacks [--only NAME,...] [--json FILE] [--out DIR]

Each attack runs its own small run (the quadratic problem of tests/test_hostile.py: 4 logical
clients, 3 rounds, token authentication): a server process (`python -m fedhop.server`), two
honest client processes (`python -m fedhop.client`, clients 0-1 and 2) and the attacker, this
process, speaking gRPC built from proto/fedhop.proto.  Where the attacker is a participant it
holds a valid credential for its own node and hosts client 3 (tests/test_hostile.py
`HostileClient`, which computes the honest reply and then breaks it).

Other attackers: a participant that uses its own valid node token (client-proc2's) to command
another client process (`shutdown`, `train`, `state_get`); a second `fedhop.client` process
started under the live node id client-proc0; callers with no or a wrong token; and two faults an
operator meets, the server stopped (SIGSTOP) for longer than the heartbeat timeout and a client
process killed while clients are sampled (`clients.per_round` below the count).

Columns: the server's exit and the run's status (no crash: exit 0, "completed"); the model
(equal to FedAvg over the honest results, float64 reference: not corrupted); honest clients
blamed (run.db events naming client 0, 1 or 2); the typed event the attack left; the server's
peak resident memory (VmHWM, /proc) against the same run without an attack.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms.base import Payload
from fedhop.common.records.runstore import RunStore
from fedhop.common.security.auth import CRED_ENV, NodeCredentials, TokenAuthority
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.grpc import GrpcEndpoint, grpc_options
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from tests.cluster import fedavg_reference
from tests.faultkit import wait_for_dispatch
from tests.helpers import quadratic_config
from tests.test_hostile import CENTERS, CURV, LR, ROUNDS, SIZES, STEPS
from tests.test_meaning import MeaningClient

HOSTILE = 3
SECRET = "attack-suite-cluster-secret"
HONEST = {"client-proc0": "0,1", "client-proc1": "2"}


def _config_text() -> str:
    return quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR, name="attack")


class Run:
    """A server process and the honest client processes; the attacker joins as it likes."""

    def __init__(self, base: Path, name: str, hostile_mode: str | None, settings: tuple[str, ...] = (),
                 per_node: bool = False) -> None:
        # per_node: every process gets its own credential, as `fedhop run` hands them (common/security/auth.py)
        self.authority = TokenAuthority() if per_node else None
        self.dir = base / name
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg_file = self.dir / "exp.toml"
        cfg_file.write_text(_config_text())
        from fedhop.common.config import load_config
        sets = ["run.call_timeout=60.0", "run.round_timeout=90.0", "run.eval_every=0", *settings]
        self.cfg = load_config(cfg_file, sets)
        self.third: subprocess.Popen | None = None   # the process of client 3 where the attacker is not it
        self.note = ""                               # what the attack observed, for the event column
        self.figures: dict = {}                      # what the attack measured (tests/test_bounded_requests.py)
        env = dict(os.environ, FEDHOP_TOKEN=SECRET, PYTHONUNBUFFERED="1")
        port_file = self.dir / "port"
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        py = sys.executable
        self.server = subprocess.Popen(
            [py, "-m", "fedhop.server", "--config", str(cfg_file), "--run-dir", str(self.dir / "run"),
             "--port-file", str(port_file), "--register-timeout", "300", *[a for kv in sets for a in ("--set", kv)]],
            env=self.env_for("server", env), stdout=open(logs / "server.log", "wb"), stderr=subprocess.STDOUT)
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch_rss, daemon=True).start()
        deadline = time.monotonic() + 300
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise RuntimeError(f"server did not start; see {logs / 'server.log'}")
            time.sleep(0.05)
        self.address = port_file.read_text().strip()
        self.clients = [subprocess.Popen(
            [py, "-m", "fedhop.client", "--parent", self.address, "--clients", ids, "--node-id", node,
             "--ledger-dir", str(self.dir / "run" / "ledger")],
            env=self.env_for(node, env), stdout=open(logs / f"{node}.log", "wb"), stderr=subprocess.STDOUT)
            for node, ids in HONEST.items()]
        self.hostile = MeaningClient(self.cfg, hostile_mode) if hostile_mode else None

    def _watch_rss(self) -> None:
        status = Path(f"/proc/{self.server.pid}/status")
        while not self._stop.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.05)

    def env_for(self, node_id: str, env: dict) -> dict:
        """`env` plus, with per-node credentials, this node's own (and no other's)."""
        if self.authority is None:
            return env
        return {**env, CRED_ENV: self.authority.issue(node_id)}

    def endpoint(self, node_id: str, secret: str = SECRET) -> GrpcEndpoint:
        if self.authority is not None and secret == SECRET:   # a participant's own per-node credential
            creds = NodeCredentials.from_options(node_id, env_cred=self.authority.issue(node_id))
            return GrpcEndpoint(node_id, Ledger(), credentials=creds)
        return GrpcEndpoint(node_id, Ledger(), credentials=NodeCredentials(node_id, secret.encode()))

    def register(self, node_id: str, ids, address: str, secret: str = SECRET) -> pb.RegisterReply:
        ep = self.endpoint(node_id, secret)
        try:
            return ep.register(self.address, pb.RegisterRequest(
                node_id=node_id, role="client", address=address,
                clients=[pb.LogicalClient(client_id=c) for c in ids]), 10.0)
        finally:
            ep.stop()

    def start_third(self) -> None:
        """client-proc2, an honest process hosting client 3 (where the attacker does not)."""
        self.third = subprocess.Popen(
            [sys.executable, "-m", "fedhop.client", "--parent", self.address, "--clients", str(HOSTILE),
             "--node-id", "client-proc2", "--ledger-dir", str(self.dir / "run" / "ledger")],
            env=self.env_for("client-proc2", dict(os.environ, FEDHOP_TOKEN=SECRET)),
            stdout=open(self.dir / "logs" / "client-proc2.log", "wb"),
            stderr=subprocess.STDOUT)
        self.clients.append(self.third)

    def join_hostile(self) -> None:
        assert self.hostile is not None
        reply = self.register("client-procH", [HOSTILE], self.hostile.address)
        if not reply.accepted:
            raise RuntimeError(f"hostile registration refused: {reply.message}")

    def finish(self, timeout: float = 300.0) -> dict:
        try:
            code = self.server.wait(timeout)
        except subprocess.TimeoutExpired:
            self.server.kill()
            code = -9
        self._stop.set()
        for c in self.clients:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
        if self.hostile is not None:
            self.hostile.close()
        return {"exit": code}

    def kill_all(self) -> None:
        for p in [self.server, *self.clients]:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


# ----------------------------------------------------------------------------- the attacks
def _participant(mode: str):
    def attack(run: Run) -> None:
        run.join_hostile()
    attack.hostile_mode = mode
    return attack


def attack_takeover(run: Run) -> None:
    """A second process registers under the live node id client-proc0 from another address."""
    _wait_registered(run)
    reply = run.register("client-proc0", [0, 1], "127.0.0.1:9")
    assert not reply.accepted, "takeover accepted"


def attack_out_of_range(run: Run) -> None:
    """A participant claims client 99 of 4 from an address it serves (so it proves the address,
    common/transport/grpc.py): refused for the client id."""
    ep = run.endpoint("client-procX")
    try:
        address = ep.serve(lambda request: None, "127.0.0.1:0")
        reply = ep.register(run.address, pb.RegisterRequest(node_id="client-procX", role="client", address=address,
                                                            clients=[pb.LogicalClient(client_id=99)]), 10.0)
    finally:
        ep.stop(grace=0.1)
    assert not reply.accepted


def attack_wrong_token_flood(run: Run) -> None:
    """2,000 registrations with a wrong token, 16 at a time."""
    def one(i: int) -> None:
        try:
            run.register(f"client-procF{i}", [0], "127.0.0.1:11", secret="not-the-secret")
        except Exception:
            pass
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(2000)))
    lines = sum("refused" in line for line in (run.dir / "logs" / "server.log").read_text(errors="replace").splitlines())
    run.figures["refusal_log_lines"] = lines
    run.note = f"{lines} log lines for 2000 refusals"
    assert lines <= MAX_REFUSAL_LINES, f"{lines} log lines for 2000 refused registrations"


MAX_REFUSAL_LINES = 50      # a flood of refusals: one line per template per 10 s window (common/transport/admission.py)
BIG_REQUEST = 512 << 20     # bytes of tensor data the big request declares and streams
SLOW_STREAMS = 40
SETUP_WAIT = 300.0           # seconds the honest processes may take to start on a loaded machine


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _big_request(run: Run, address: str, pid: int, dst: str, method: str) -> None:
    """An insider (client-procH's valid node token) streams one Exchange request declaring
    BIG_REQUEST bytes of tensor data to `dst` at `address`: it must be refused on its header
    frame, its data unread (the peak memory of process `pid` grows by a fraction of it at most)."""
    channel = grpc.insecure_channel(address, options=grpc_options(128 << 20))
    stub = channel.stream_stream("/fedhop.Fedhop/Exchange", request_serializer=None, response_deserializer=None)
    metadata = NodeCredentials("client-procH", SECRET.encode()).metadata()
    env = pb.Envelope(src="client-procH", dst=dst, method=method, msg_id="big-request", data_bytes=BIG_REQUEST)
    env.tensors.add(name="w", dtype="uint8", shape=[BIG_REQUEST], nbytes=BIG_REQUEST)
    chunk = 4 << 20
    block = pb.Frame(data=bytes(chunk)).SerializeToString()
    sent = [0]

    def frames():
        yield pb.Frame(header=env).SerializeToString()
        for _ in range(BIG_REQUEST // chunk):
            sent[0] += chunk
            yield block
    before = _hwm(pid)
    try:
        reply = pb.Frame.FromString(next(iter(stub(frames(), timeout=120, metadata=metadata))))
        code = reply.header.error.code or "answered"
    except grpc.RpcError as exc:
        code = exc.code().name
    finally:
        channel.close()
    grown = max(0, _hwm(pid) - before)
    run.figures.update(peak_growth=grown, sent_before_reply=sent[0], code=code)
    run.note = f"{code}; {dst}'s peak memory +{grown / 2**20:.0f} MB for a {BIG_REQUEST >> 20} MB {method} request"
    assert grown < BIG_REQUEST // 4, f"{dst}'s peak memory grew {grown >> 20} MB"


def attack_big_request(run: Run) -> None:
    """A 512 MB `train` request to the server, which serves no Exchange calls (`_big_request`)."""
    _wait_registered(run, timeout=SETUP_WAIT)
    _big_request(run, run.address, run.server.pid, "server", "train")


def attack_big_ping_client(run: Run) -> None:
    """A 512 MB `ping` (any participant may ping; it carries no data) to client-proc0 (`_big_request`)."""
    _wait_registered(run, timeout=SETUP_WAIT)
    store = RunStore(run.dir / "run" / "run.db")
    try:
        victim = next(e["detail"].split(" at ")[1].split(" ")[0] for e in store.events("registered")
                      if e["node"] == "client-proc0")
    finally:
        store.close()
    _big_request(run, victim, run.clients[0].pid, "client-proc0", "ping")


def call_codes(calls) -> list[str]:
    """How each of `calls` (server-streaming gRPC calls, already released) ended: "OK", or the
    status code's name ("RESOURCE_EXHAUSTED" for a stream refused over a caller's share)."""
    codes = []
    for c in calls:
        try:
            list(c)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    return codes


def attack_slow_streams(run: Run) -> None:
    """An insider (a valid node token) opens 40 Exchange streams to the server and sends nothing on
    them, from before the last client process registers until round 2 is done (or 3 heartbeat
    timeouts): heartbeats and registrations must still be answered (no node_dead)."""
    _wait_registered(run, timeout=SETUP_WAIT)
    for node in HONEST:   # both honest processes beat: from here on, silence marks them dead
        _wait_heartbeat(run, node, timeout=SETUP_WAIT)
    channel = grpc.insecure_channel(run.address, options=grpc_options(128 << 20))
    stub = channel.stream_stream("/fedhop.Fedhop/Exchange", request_serializer=None, response_deserializer=None)
    metadata = NodeCredentials("client-procH", SECRET.encode()).metadata()
    release = threading.Event()

    def idle():
        release.wait()
        yield from ()
    calls = [stub(idle(), timeout=300, metadata=metadata) for _ in range(SLOW_STREAMS)]
    timeout = run.cfg.security.heartbeat_timeout
    deadline = time.monotonic() + 3 * timeout
    run.start_third()
    db = run.dir / "run" / "run.db"
    while time.monotonic() < deadline and run.server.poll() is None:
        if db.exists():
            store = RunStore(db)
            try:
                if len(store.rounds()) >= 2:
                    break
            finally:
                store.close()
        time.sleep(0.2)
    held = sum(not c.done() for c in calls)
    release.set()
    codes = call_codes(calls)
    channel.close()
    refused = codes.count("RESOURCE_EXHAUSTED")
    run.figures.update(streams_held=held, streams_refused=refused)
    run.note = f"{refused} of {SLOW_STREAMS} streams refused RESOURCE_EXHAUSTED"


attack_slow_streams.forbid = ("node_dead",)


def attack_unauth_big(run: Run) -> None:
    """64 unauthenticated 60 MB calls, 32 at a time (on Call, Exchange and Register)."""
    channel = grpc.insecure_channel(run.address, options=grpc_options(128 << 20))
    body = b"\x0a" + b"\x00" * (60 << 20)
    methods = ["/fedhop.Fedhop/Call", "/fedhop.Fedhop/Register"]

    def one(i: int) -> None:
        try:
            call = channel.unary_unary(methods[i % 2], request_serializer=None, response_deserializer=None)
            call(body, timeout=30)
        except grpc.RpcError:
            pass
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(64)))
    channel.close()


def _peer_command(method: str, dst: str):
    """A participant (client-proc2's valid token) calls `method` of client-proc0 directly."""
    def attack(run: Run) -> None:
        _wait_registered(run)
        store = RunStore(run.dir / "run" / "run.db")
        run_id = store.run()["run_id"]
        victim = next(e["detail"].split(" at ")[1].split(" ")[0] for e in store.events("registered")
                      if e["node"] == "client-proc0")
        ep = run.endpoint("client-proc2")
        ep.run_id = run_id
        try:
            ep.call(victim, dst, method, Payload(), round=1, timeout=10.0)
            raise AssertionError(f"{method} to {dst} obeyed")
        except RemoteError as exc:
            run.note = f"answered {exc.code}"
            assert exc.code == "NOT_ALLOWED", exc
        finally:
            ep.stop(grace=0.1)
    return attack


def attack_takeover_process(run: Run) -> None:
    """A second `fedhop.client` process, with the cluster token, registers as client-proc0
    (clients 0 and 1) while the real client-proc0 is alive; it must be refused and exit."""
    _wait_registered(run)
    second = subprocess.Popen(
        [sys.executable, "-m", "fedhop.client", "--parent", run.address, "--clients", "0,1",
         "--node-id", "client-proc0", "--ledger-dir", str(run.dir / "second-ledger")],
        env=dict(os.environ, FEDHOP_TOKEN=SECRET), stdout=open(run.dir / "logs" / "second-proc0.log", "wb"),
        stderr=subprocess.STDOUT)
    try:
        code = second.wait(120)
    except subprocess.TimeoutExpired:
        second.kill()
        raise AssertionError("the second client-proc0 was not refused (still running after 120 s)")
    run.note = f"second process exit {code}"
    assert code != 0, "the second client-proc0 exited 0"


PAUSE_SECONDS = 12.0


def attack_server_paused(run: Run) -> None:
    """SIGSTOP the server for 12 s (heartbeat timeout 5 s) once round 2 is dispatched, then SIGCONT."""
    run.start_third()
    wait_for_dispatch(run.dir / "run", 2, timeout=120)
    os.kill(run.server.pid, signal.SIGSTOP)
    try:
        con = sqlite3.connect(f"file:{run.dir / 'run' / 'run.db'}?mode=ro", uri=True, timeout=5)
        done = con.execute("SELECT count(*) FROM rounds").fetchone()[0]
        con.close()
        time.sleep(PAUSE_SECONDS)   # the fault itself: the server does not run for 12 s
    finally:
        os.kill(run.server.pid, signal.SIGCONT)
    run.note = f"stopped {PAUSE_SECONDS:g} s after {done} of {run.cfg.run.rounds} rounds"
    assert done < run.cfg.run.rounds


def attack_client_process_killed(run: Run) -> None:
    """kill -9 client-proc0 (clients 0 and 1) once registered; once the server has marked it dead
    client-proc2 joins and the rounds start, each sampling 2 of the 4 clients: only live ones may
    be drawn (a round that drew clients 0 and 1 would get no result and fail the run)."""
    _wait_registered(run)
    _wait_heartbeat(run, "client-proc0")   # a child never heard from is not watched yet: it beats first
    os.kill(run.clients[0].pid, signal.SIGKILL)
    run.clients[0].wait()
    store = RunStore(run.dir / "run" / "run.db")
    deadline = time.monotonic() + 120
    while not any(e["node"] == "client-proc0" for e in store.events("node_dead")):
        if time.monotonic() > deadline:
            raise AssertionError("client-proc0 never marked dead")
        time.sleep(0.1)
    run.start_third()


def _wait_heartbeat(run: Run, node: str, timeout: float = 60.0) -> None:
    """Until `node` has a heartbeat answered by the server (its ledger's `heartbeat.reply`,
    flushed as it is recorded)."""
    path = run.dir / "run" / "ledger" / f"{node}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and b'"method":"heartbeat.reply"' in path.read_bytes():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{node} never had a heartbeat answered")


def _wait_registered(run: Run, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    db = run.dir / "run" / "run.db"
    while time.monotonic() < deadline:
        if db.exists():
            try:
                if len(RunStore(db).events("registered")) >= len(HONEST):
                    return
            except Exception:
                pass
        time.sleep(0.05)
    raise RuntimeError("honest clients never registered")


# ----------------------------------------------------------------------------- identity and code (issue 26)
def _home(run: Run, node: str) -> str:
    """The address `node` registered from (its `registered` event)."""
    store = RunStore(run.dir / "run" / "run.db")
    return next(e["detail"].split(" at ")[1].split(" ")[0] for e in store.events("registered") if e["node"] == node)


def attack_address_hijack(run: Run) -> None:
    """A participant (its own valid credential) registers a new node id with no clients at
    client-proc0's address, to have the server mark that address dead once it goes silent (or,
    under TLS, expect its name there): refused, the address belongs to the live client-proc0."""
    _wait_registered(run, timeout=SETUP_WAIT)
    reply = run.register("client-procA", [], _home(run, "client-proc0"))
    run.note = "refused" if not reply.accepted else "ACCEPTED"
    assert not reply.accepted, "a registration at a live node's address was accepted"


def attack_minted_server_token(run: Run) -> None:
    """A participant holding the run token mints HMAC(run token, "server") and sends client-proc0
    `state_get` and `shutdown` as the server.  The run hands each process its own per-node
    credential, as `fedhop run` does: the minted token proves nothing."""
    _wait_registered(run, timeout=SETUP_WAIT)
    minted = GrpcEndpoint("server", Ledger(), credentials=NodeCredentials("server", SECRET.encode()))
    minted.run_id = RunStore(run.dir / "run" / "run.db").run()["run_id"]
    victim, codes = _home(run, "client-proc0"), []
    try:
        for method in ("state_get", "shutdown"):
            try:
                minted.call(victim, "client-proc0", method, Payload(), round=1, timeout=10.0)
                codes.append(f"{method} OBEYED")
            except (CallFailed, RemoteError) as exc:
                codes.append(f"{method} {exc.code}")
    finally:
        minted.stop(grace=0.1)
    run.note = ", ".join(codes)
    assert all(c.endswith("UNAUTHENTICATED") for c in codes), run.note


attack_minted_server_token.per_node = True

WALK_SETTINGS = ("topology.kind=chain", "topology.graph=ring", "topology.start=0", "topology.hops_per_round=4")


def _walk_reference(cfg) -> np.ndarray:
    """The walk's final model on the quadratic task, computed here (tests/test_chain.py `numpy_walk`;
    the draws from fedhop's WalkRule)."""
    from fedhop.common.topologies.graphs import topology_params
    from fedhop.topologies.chain.rule import WalkRule
    rule, hops = WalkRule.from_config(cfg, SIZES), topology_params(cfg).hops_per_round
    w, holder = np.zeros(CENTERS.shape[1]), topology_params(cfg).start
    for r in range(1, cfg.run.rounds + 1):
        for h in range(hops):
            i, local = holder, w.copy()
            for _ in range(STEPS):
                local = local - LR * CURV[i] * (local - CENTERS[i])
            w = w + rule.scale(i) * (local - w)
            holder = rule.next_client(i, r, h)
    return w


def attack_forged_walk_handoff(run: Run) -> None:
    """A chain (WRWGD) run; before the walk starts, a participant (its own valid credential, hosting
    no client) hands client-proc0's clients 0 and 1 a model of its own (every weight 50) for
    every hop at which the walk could move there from client 3 or 2 (hosted by other
    processes).  The model must be the walk's own."""
    _wait_registered(run, timeout=SETUP_WAIT)
    from fedhop.common.topologies.graphs import topology_params
    from fedhop.topologies.chain.rule import WalkRule
    rule, hops = WalkRule.from_config(run.cfg, SIZES), topology_params(run.cfg).hops_per_round
    ep = run.endpoint("client-procH")
    ep.run_id = RunStore(run.dir / "run" / "run.db").run()["run_id"]
    victim, taken, refused = _home(run, "client-proc0"), 0, {}
    forged = {"w": torch.full((CENTERS.shape[1],), 50.0)}
    try:
        for r in range(1, run.cfg.run.rounds + 1):
            for h in range(hops):
                for sender, receiver in ((3, 0), (2, 1)):
                    if rule.next_client(sender, r, h) != receiver:
                        continue
                    try:
                        ep.call(victim, f"client-{receiver}", "walk_handoff",
                                Payload(tensors=forged, scalars={"from": sender}), round=r, step=h, timeout=10.0)
                        taken += 1
                    except (CallFailed, RemoteError) as exc:
                        refused[exc.code] = refused.get(exc.code, 0) + 1
    finally:
        ep.stop(grace=0.1)
    run.note = f"{taken} forged hand-offs kept aside, {sum(refused.values())} refused {refused or ''}".strip()
    assert taken + sum(refused.values()) > 0, "no hop to forge"


attack_forged_walk_handoff.settings = WALK_SETTINGS
attack_forged_walk_handoff.reference = _walk_reference
attack_forged_walk_handoff.left_out = lambda rounds: {}

EVIL_PLUGIN = """import os, pathlib
pathlib.Path(os.environ["FEDHOP_ATTACK_MARK"]).write_text("imported")
"""
PLUGIN_CONFIG = """[run]\nname = "evil"\n[data]\ndataset = "digits"\n[model]\nfactory = "evilpkg:make_net"
[clients]\ncount = 2\n"""


def attack_plugin_from_parent(run: Run) -> None:
    """A hostile parent (this process, serving Register) answers a `fedhop.client` process's
    registration with a config whose model.factory names a module on the client's plug-in search
    path, whose import writes a file: the client must refuse the config (exit 2) and import
    nothing (common/util/plugins.py `restrict`).  The honest run goes on beside it."""
    folder = run.dir / "plugins" / "evilpkg"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(EVIL_PLUGIN)
    mark = run.dir / "imported"
    parent = GrpcEndpoint("server", Ledger())
    address = parent.serve(lambda request: None, "127.0.0.1:0", register_handler=lambda req: pb.RegisterReply(
        accepted=True, run_id="evil-1", config_toml=PLUGIN_CONFIG, node_id="server"))
    env = {k: v for k, v in os.environ.items() if k not in ("FEDHOP_TOKEN", "FEDHOP_ALLOW_PLUGINS", CRED_ENV)}
    env.update(FEDHOP_PLUGIN_PATH=str(run.dir / "plugins"), FEDHOP_ATTACK_MARK=str(mark))
    try:
        proc = subprocess.run([sys.executable, "-m", "fedhop.client", "--parent", address, "--clients", "0-1",
                               "--node-id", "client-procV"], env=env, capture_output=True, text=True, timeout=300)
    finally:
        parent.stop(grace=0.1)
    said = "PLUGIN_NOT_ALLOWED" if "PLUGIN_NOT_ALLOWED" in proc.stdout + proc.stderr else "no refusal"
    run.note = f"client exit {proc.returncode}, {said}, {'IMPORTED' if mark.exists() else 'nothing imported'}"
    assert proc.returncode == 2 and not mark.exists(), run.note


# name -> (attack, hostile mode or None, the event(s) it must leave as "kind:text in detail"); an attack
# may carry `settings` (config overrides) and `left_out` ({round: clients}, None: every round's
# clients from the config)
attack_client_process_killed.settings = ("run.rounds=8", "clients.per_round=2")
attack_client_process_killed.left_out = lambda rounds: {r: {0, 1} for r in range(1, rounds + 1)}
attack_server_paused.settings = ("run.rounds=6",)
attack_server_paused.forbid = ("node_dead",)   # no child declared dead for the server's own pause

ATTACKS = {
    "none": (None, None, None),
    "num_results_text": (_participant("num_results_text"), "num_results_text", "rejected_payload:BAD_SCALAR"),
    "compute_seconds_text": (_participant("compute_text"), "compute_text", "rejected_payload:BAD_SCALAR"),
    "weight_1e300": (_participant("weight_1e300"), "weight_1e300", "rejected_payload:BAD_WEIGHT"),
    "overflowing_values": (_participant("overflowing_values"), "overflowing_values",
                           "rejected_payload:NON_FINITE_AGGREGATE"),
    "reply_200MB_declared": (_participant("oversized"), "oversized", "rejected_payload:TOO_LARGE"),
    "reply_1TiB_declared": (_participant("huge"), "huge", "rejected_payload:TOO_LARGE"),
    "nan_tensor": (_participant("nan"), "nan", "rejected_payload:NON_FINITE"),
    "wrong_shape": (_participant("wrong_shape"), "wrong_shape", "rejected_payload:BAD_SHAPE"),
    "size_lie": (_participant("size_lie"), "size_lie", "rejected_payload:SIZE_MISMATCH"),
    "bad_checksum": (_participant("bad_checksum"), "bad_checksum", "rejected_payload:CHECKSUM_MISMATCH"),
    "garbage_frame": (_participant("garbage"), "garbage", "rejected_payload:MALFORMED_FRAME"),
    "replayed_reply": (_participant("replay"), "replay", "rejected_payload:STALE_ROUND"),
    "impersonated_sender": (_participant("impersonate"), "impersonate", "rejected_payload:WRONG_SENDER"),
    "node_id_takeover": (attack_takeover, None, "register_refused:NODE_TAKEN"),
    "client_id_out_of_range": (attack_out_of_range, None, "register_refused:out of range"),
    "wrong_token_x2000": (attack_wrong_token_flood, None, "auth_refused:"),
    "unauth_60MB_x64": (attack_unauth_big, None, "auth_refused:no node credential"),
    "peer_shutdown": (_peer_command("shutdown", "client-proc0"), None, "not_allowed:shutdown to client-proc0"),
    "peer_train_oracle": (_peer_command("train", "client-0"), None, "not_allowed:train to client-0"),
    "peer_state_get": (_peer_command("state_get", "client-proc0"), None, "not_allowed:state_get to client-proc0"),
    "node_id_takeover_process": (attack_takeover_process, None, "register_refused:NODE_TAKEN"),
    "server_paused_12s": (attack_server_paused, None, "monitor_paused:"),
    "big_request_512MB": (attack_big_request, None, "request_refused:refused on its header"),
    "big_ping_to_client_512MB": (attack_big_ping_client, None, None),
    "slow_streams_x40": (attack_slow_streams, None, "call_refused:"),
    "address_hijack": (attack_address_hijack, None, "register_refused:ADDRESS_TAKEN"),
    "minted_server_token": (attack_minted_server_token, None, None),
    "forged_walk_handoff": (attack_forged_walk_handoff, None, None),
    "plugin_from_parent_config": (attack_plugin_from_parent, None, None),
    "client_process_killed_sampled": (attack_client_process_killed, None,
                                      ("node_dead:", "sampling_excluded:clients of dead nodes")),
}


def run_attack(base: Path, name: str) -> dict:
    attack, mode, want = ATTACKS[name]
    try:
        run = Run(base, name, mode, getattr(attack, "settings", ()), per_node=getattr(attack, "per_node", False))
    except RuntimeError as exc:   # a run that could not start is a row, not the end of the suite
        return {"attack": name, "server_exit": None, "status": "-", "model_ok": False, "honest_blamed": "-",
                "event": "-", "peak_rss_mb": 0.0, "events_total": 0, "error": str(exc)}
    error = ""
    try:
        if attack is not None:
            attack(run)
        if mode is None and run.third is None:   # the hostile process is not part of the run: client 3 must
            run.start_third()                       # come from somewhere
        out = run.finish()
    except Exception as exc:   # an attack that could not be delivered is reported, not hidden
        error = f"{type(exc).__name__}: {exc}"
        run.kill_all()
        out = {"exit": run.server.returncode}
    return _row(name, run, out, mode, want, error, getattr(attack, "left_out", None), getattr(attack, "forbid", ()),
                getattr(attack, "reference", None))


def _row(name: str, run: Run, out: dict, mode: str | None, want, error: str, left_out_rule=None,
         forbid: tuple[str, ...] = (), reference=None) -> dict:
    run_dir = run.dir / "run"
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    store = RunStore(run_dir / "run.db")
    events = store.events()
    honest_blamed = sorted({e["node"] for e in events if e["node"] in ("client-0", "client-1", "client-2")
                            and e["kind"] in ("rejected_payload", "client_failed")})
    rounds = run.cfg.run.rounds
    left_out = {r: {HOSTILE} for r in range(1, rounds + 1)} if mode else {}
    if mode == "replay":   # the replay is the honest reply in round 1
        left_out = {r: {HOSTILE} for r in range(2, rounds + 1)}
    if left_out_rule is not None:
        left_out = left_out_rule(rounds)
    model_ok = False
    if (run_dir / "model.safetensors").exists():
        got = load_file(str(run_dir / "model.safetensors"))["w"].double().numpy()
        ref = reference(run.cfg) if reference is not None else fedavg_reference(CENTERS, CURV, SIZES, rounds, STEPS,
                                                                                LR, left_out)
        model_ok = bool(np.all(np.isfinite(got)) and np.allclose(got, ref, rtol=1e-4, atol=1e-5))
    shown = []
    for one in ((want,) if isinstance(want, str) else want or ()):
        kind, _, text = one.partition(":")
        hits = [e for e in events if e["kind"] == kind and text in (e["detail"] or "")]
        folded = sum(int(n) for e in hits for n in re.findall(r"\(\+(\d+) more from ", e["detail"] or ""))
        count = f"x{len(hits)}" + (f" for {len(hits) + folded} refusals" if folded else "")
        shown.append(f"{kind} {text} {count}".replace("  ", " ") if hits else f"MISSING {one}")
    for kind in forbid:
        n = sum(e["kind"] == kind for e in events)
        shown.append(f"UNEXPECTED {kind} x{n}" if n else f"no {kind}")
    event = "; ".join(shown) or ("- (the baseline: no attack)" if name == "none" else "-")
    if run.note:
        event += f" ({run.note})"
    return {"attack": name, "server_exit": out.get("exit"), "status": summary.get("status", "-"),
            "model_ok": model_ok, "honest_blamed": ",".join(honest_blamed) or "none", "event": event,
            "peak_rss_mb": round(run.peak / 2**20, 1), "events_total": len(events), "error": error,
            "figures": run.figures}


def markdown(rows: list[dict]) -> str:
    head = ("| attack | server exit / status | model = honest FedAvg | honest clients blamed | typed event "
            "| server peak RSS | run.db events |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['attack']} | {r['server_exit']} / {r['status']} | {'yes' if r['model_ok'] else 'NO'} "
                     f"| {r['honest_blamed']} | {r['event']} | {r['peak_rss_mb']} MB | {r['events_total']} |"
                     + (f" {r['error']}" if r["error"] else ""))
    return "\n".join(lines)


def ok(row: dict) -> bool:
    return (row["server_exit"] == 0 and row["status"] == "completed" and row["model_ok"]
            and row["honest_blamed"] == "none" and "MISSING" not in row["event"]
            and "UNEXPECTED" not in row["event"] and not row["error"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.attacks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated attack names (default: all)")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        print(f"unknown attack {unknown[0]!r} (known: {', '.join(ATTACKS)})", file=sys.stderr)
        return 2
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedhop-attacks-"))
    rows = []
    for name in names:
        row = run_attack(base, name)
        rows.append(row)
        print(f"{name}: {'ok' if ok(row) else 'FAILED'} ({row['event']}, {row['peak_rss_mb']} MB)", flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
