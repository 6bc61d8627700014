"""Identity bound to everything it claims (issue 26, item 3; DESIGN.md section 9).

- an address is owned by one live node: a registration at a live node's address is refused
  (ADDRESS_TAKEN), so it cannot redirect that node's `mark_dead` or its TLS name;
- per-node credentials (what `fedhop run` hands each process): a participant holding the run
  token, or its own credential, cannot mint the server's identity, and a token issued for one
  callee is refused by another;
- a walk hand-off is used only when the server's visit names it: its sender, hop and the
  process hosting the sender (topologies/chain/client.py).

The process tests start a real run (server and two client processes, common/topologies/plan.py) through
the launcher's `LocalRun`, as `fedhop run` does, and attack it from this process.
"""
from __future__ import annotations

import time

import pytest

from fedhop.common.algorithms.base import Payload
from fedhop.common.config import load_config, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.security.auth import NodeCredentials, SignedIdentity, TokenAuthority
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.transport.liveness import LivenessMonitor
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.methods import Method
from fedhop.topologies.chain.client import walk_of
from tests.helpers import quadratic_config
from tests.test_hostile import CENTERS, CURV, SIZES


# ----------------------------------------------------------------------------- addresses (unit)
class _Endpoint:
    node_id = "server"

    def __init__(self) -> None:
        self.marked: list[str] = []

    def mark_dead(self, address: str, reason: str) -> int:
        self.marked.append(address)
        return 0


def _req(node: str, address: str, clients=()) -> pb.RegisterRequest:
    return pb.RegisterRequest(node_id=node, role="client", address=address,
                              clients=[pb.LogicalClient(client_id=c) for c in clients])


def test_an_address_belongs_to_its_live_node_until_that_node_is_dead():
    now = [0.0]
    ep = _Endpoint()
    mon = LivenessMonitor(ep, interval=1.0, timeout=5.0, clock=lambda: now[0])
    victim = _req("client-proc0", "127.0.0.1:5000", [0, 1])
    assert mon.check_registration(victim) is None
    mon.registered(victim)
    mon.beat(pb.HeartbeatRequest(node_id="client-proc0"))
    hijack = _req("client-procX", "127.0.0.1:5000")
    refusal = mon.check_registration(hijack)
    assert refusal is not None and refusal.startswith("ADDRESS_TAKEN") and "client-proc0" in refusal
    assert mon.check_registration(_req("client-proc0", "127.0.0.1:5000", [0, 1])) is None   # itself, again
    assert mon.check_registration(_req("client-procX", "127.0.0.1:5001")) is None            # its own address
    # the victim beats on; whatever registered elsewhere and went silent, its address is never marked dead
    mon.registered(_req("client-procY", "127.0.0.1:5001"))
    for _ in range(80):
        now[0] += 1.0
        mon.beat(pb.HeartbeatRequest(node_id="client-proc0"))
        mon.check()
    assert mon.dead_nodes() == {"client-procY"} and ep.marked == ["127.0.0.1:5001"]
    # once the owner is dead, a new process may take the address over
    for _ in range(10):
        now[0] += 1.0
        mon.check()
    assert "client-proc0" in mon.dead_nodes() and mon.check_registration(hijack) is None


# ----------------------------------------------------------------------------- tokens (unit)
def test_a_per_node_token_proves_one_node_to_one_callee():
    issuer = TokenAuthority()
    client = SignedIdentity.parse(issuer.issue("client-proc0"))
    server = SignedIdentity.parse(issuer.issue("server"))
    token = client.token("server")
    assert server.verify("client-proc0", token, {"server"}, scoped=False) is None
    assert "not issued" in server.verify("server", token, {"server"}, scoped=False)       # claimed as another node
    assert "for 'client-3'" in server.verify("client-proc0", client.token("client-3"), {"server"}, scoped=False)
    assert "for 'register'" in server.verify("client-proc0", client.token("register"), {"server"}, scoped=False)
    assert server.verify("client-proc0", client.token("register"), {"server"}, scoped=True) is None
    foreign = SignedIdentity.parse(TokenAuthority().issue("server"))                     # another issuer
    assert "not issued" in client.verify("server", foreign.token("client-proc0"), {"client-proc0"}, scoped=False)
    late = client.token("server", now=time.time() - 3600)
    assert "expired" in server.verify("client-proc0", late, {"server"}, scoped=False)


# ----------------------------------------------------------------------------- a real run
def _started(run) -> tuple[RunStore, dict[str, str]]:
    """Start `run` (a LocalRun), wait until every client registered; its run.db and each node's address."""
    from fedhop.deploy.launch.launcher import registration_complete
    server = run.start([])
    deadline = time.monotonic() + 240
    while not registration_complete(run.run_dir / "run.db"):
        assert server.proc.poll() is None and time.monotonic() < deadline, \
            (server.log.read_text()[-2000:] if server.log.exists() else "no log")
        time.sleep(0.1)
    store = RunStore(run.run_dir / "run.db")
    return store, {e["node"]: e["detail"].split(" at ")[1].split(" ")[0] for e in store.events("registered")}


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A run started as `fedhop run` starts it (per-node credentials), kept going while attacked."""
    from fedhop.deploy.launch.launcher import LocalRun
    base = tmp_path_factory.mktemp("identity")
    cfg_file = base / "exp.toml"
    cfg_file.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=100000, local_steps=1, name="identity"))
    cfg = load_config(cfg_file, ["run.eval_every=0"])
    run = LocalRun(cfg, (base / "run").resolve(), workdir=base)
    try:
        store, homes = _started(run)
        yield run, store, homes
    finally:
        run.stop_all(grace=5.0)


def _endpoint(creds: NodeCredentials, run_id: str) -> GrpcEndpoint:
    ep = GrpcEndpoint(creds.node_id, Ledger(), credentials=creds)
    ep.run_id = run_id
    return ep


def _call(creds: NodeCredentials, run_id: str, address: str, dst: str, method: Method):
    ep = _endpoint(creds, run_id)
    try:
        return ep.call(address, dst, method, Payload(), round=1, timeout=20.0)
    finally:
        ep.stop(grace=0.1)


def test_a_participant_cannot_mint_or_replay_the_servers_identity(live_run):
    run, store, homes = live_run
    run_id = store.run()["run_id"]
    victim = homes["client-proc0"]
    participant = SignedIdentity.parse(run.authority.issue("client-proc9"))   # a participant's own credential
    attempts = {
        # HMAC(run token, "server"): what every holder of the run token could mint
        "minted from the run token": NodeCredentials("server", secret=run.token.encode()),
        # its own key and certificate, claiming to be the server
        "own credential as the server": NodeCredentials("server", signed=participant),
    }
    for what, creds in attempts.items():
        for method in (Method.STATE_GET, Method.SHUTDOWN):
            with pytest.raises(CallFailed) as exc:
                _call(creds, run_id, victim, "client-proc0", method)
            assert exc.value.code == "UNAUTHENTICATED", (what, method, exc.value)
    # a token the server really signed, but for another callee (as client-proc1 would hold it)
    real_server = SignedIdentity.parse(run.authority.issue("server"))
    replayed = real_server.token("client-proc1")

    class Replay(NodeCredentials):
        def metadata(self, audience: str = ""):
            return (("fedhop-node", "server"), ("fedhop-auth", replayed))

    with pytest.raises(CallFailed) as exc:
        _call(Replay("server", signed=real_server), run_id, victim, "client-proc0", Method.STATE_GET)
    assert exc.value.code == "UNAUTHENTICATED" and "client-proc1" in exc.value.detail
    # the same call with the server's token for this callee is obeyed: the refusals above are the
    # credential's, not the method's
    state = _call(NodeCredentials("server", signed=real_server), run_id, victim, "client-proc0", Method.STATE_GET)
    assert isinstance(state, Payload)
    # a participant speaking as itself is authenticated, and then refused by the method's rule
    with pytest.raises(RemoteError) as exc2:
        _call(NodeCredentials("client-proc9", signed=participant), run_id, victim, "client-proc0", Method.SHUTDOWN)
    assert exc2.value.code == "NOT_ALLOWED"
    assert run.children[1].proc.poll() is None and run.children[0].proc.poll() is None   # nothing shut down


def test_a_registration_at_a_live_nodes_address_is_refused_with_an_event(live_run):
    run, store, homes = live_run
    victim = homes["client-proc0"]
    creds = NodeCredentials.from_options("client-procA", env_cred=run.authority.issue("client-procA"))
    ep = _endpoint(creds, "")
    try:
        reply = ep.register(run.run_dir.joinpath("server.address").read_text().strip(),
                            _req("client-procA", victim), 10.0)
    finally:
        ep.stop(grace=0.1)
    assert not reply.accepted and reply.message.startswith("ADDRESS_TAKEN"), reply.message
    deadline = time.monotonic() + 30
    while not [e for e in store.events("register_refused") if "ADDRESS_TAKEN" in (e["detail"] or "")]:
        assert time.monotonic() < deadline, store.events("register_refused")
        time.sleep(0.1)
    before = len(store.rounds())
    deadline = time.monotonic() + 60   # the victim still trains: rounds go on
    while len(store.rounds()) <= before:
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ----------------------------------------------------------------------------- walk hand-offs (unit)
def test_a_forged_walk_handoff_is_never_the_walks_model():
    """A participant process hands a model in for a hop where the walk moves from one of its
    neighbours' clients: it is kept aside, never displaces the real hand-off (DUPLICATE is per
    process), and the server's visit, which names the real sender's process, uses the real one."""
    from fedhop.client.host import ClientHost
    from fedhop.common.transport.base import HandlerError
    from tests.test_chain import GRAPH, N, walk_config
    host = ClientHost(parse_config(walk_config()), "client-proc1", list(range(N)), run_id="")
    rule = walk_of(host).rule
    rnd, sender = 2, 3
    hop, receiver = next((h, c) for h in range(40) if (c := rule.next_client(sender, rnd, h)) != sender)
    assert receiver in GRAPH[sender]
    real = {k: v + 1.0 for k, v in walk_of(host).initial.items()}
    forged = {k: v - 7.0 for k, v in walk_of(host).initial.items()}

    def handoff(src: str, tensors, h=hop):
        return walk_of(host).take_handoff(src, f"client-{receiver}", rnd, h, Payload(tensors=tensors,
                                                                               scalars={"from": sender}))
    handoff("client-procX", forged)   # first, from a process that does not host client `sender`
    handoff("client-proc0", real)     # the real hand-off is still taken
    with pytest.raises(HandlerError) as exc:
        handoff("client-procX", forged)
    assert exc.value.code == "DUPLICATE"
    visit = Payload(scalars={"from": sender, "from_round": rnd, "from_hop": hop, "from_node": "client-proc0",
                             "final": True})
    walk_of(host).visit(f"client-{receiver}", rnd, hop + 1, visit)
    # the model trained at the visit started from the real hand-off: the forged one was dropped
    assert not walk_of(host).pending
    assert walk_of(host).handoffs == {(rnd, hop, sender, "client-proc0")}
    # now the server has named client-proc0 as the host of `sender`: a hand-off of it from another
    # process is refused at once, and one for a hop before the latest visit is stale
    later = next(h for h in range(hop + 2, 400) if rule.next_client(sender, rnd, h) == receiver)
    with pytest.raises(HandlerError) as exc:
        handoff("client-procX", forged, later)
    assert exc.value.code == "WRONG_SENDER"
    with pytest.raises(HandlerError) as exc:
        handoff("client-proc0", real, hop)
    assert exc.value.code in ("STALE_HOP", "DUPLICATE")


def test_a_visit_naming_another_process_does_not_take_a_forged_handoff():
    from fedhop.client.host import ClientHost
    from fedhop.common.transport.base import HandlerError
    from tests.test_chain import N, walk_config
    host = ClientHost(parse_config(walk_config()), "client-proc1", list(range(N)), run_id="")
    rule = walk_of(host).rule
    rnd, sender = 3, 1
    hop, receiver = next((h, c) for h in range(40) if (c := rule.next_client(sender, rnd, h)) != sender)
    walk_of(host).take_handoff("client-procX", f"client-{receiver}", rnd, hop,
                           Payload(tensors=dict(walk_of(host).initial), scalars={"from": sender}))
    visit = Payload(scalars={"from": sender, "from_round": rnd, "from_hop": hop, "from_node": "client-proc0"})
    with pytest.raises(HandlerError) as exc:
        walk_of(host).visit(f"client-{receiver}", rnd, hop + 1, visit)
    assert exc.value.code == "NOT_HOLDER" and not walk_of(host).pending


# ----------------------------------------------------------------------------- credentials from a folder
def test_processes_given_a_certs_folder_use_their_own_cred_and_the_shared_secret_mints_nothing(tmp_path):
    """Deployments that start each process themselves (compose, Kubernetes, hosts, role.py) give it
    a `fedhop certs` folder: the process signs with its own NODE.cred (issuer.key stays behind), so
    the folder's cluster.secret and the run token, which every process of such a deployment holds,
    mint no other node's identity (issue 26, item 3)."""
    from fedhop.common.security.auth import SECRET_FILE, load_tls, write_cluster
    from fedhop.deploy.launch.compose import node_folders
    from fedhop.deploy.launch.launcher import LocalRun
    certs = tmp_path / "certs"
    write_cluster(certs, ["server", "client-proc0", "client-proc1"])
    issuer = TokenAuthority.from_bytes((certs / "issuer.key").read_bytes())
    for node in ("server", "client-proc0", "client-proc1"):
        signed = SignedIdentity.parse((certs / f"{node}.cred").read_text())
        assert signed.node_id == node and signed.issuer == issuer.public
        assert (certs / f"{node}.cred").stat().st_mode & 0o077 == 0
    # `fedhop compose` gives each node's folder its own credential and nothing that mints one
    folders = node_folders(certs, ["server", "client-proc0", "client-proc1"], tmp_path / "nodes")
    assert sorted(p.name for p in folders["client-proc1"].iterdir()) == [
        "ca.pem", "client-proc1.cred", "client-proc1.key", "client-proc1.pem"]

    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=100000, local_steps=1, name="credfiles")
                        + f'\n[security]\ncerts_dir = "{certs}"\n')
    cfg = load_config(cfg_file, ["run.eval_every=0"])

    class FromFolder(LocalRun):      # no FEDHOP_NODE_CRED in the environment: each reads DIR/NODE.cred
        def credential(self, name: str) -> str:
            return ""

    run = FromFolder(cfg, (tmp_path / "run").resolve(), workdir=tmp_path)
    try:
        store, homes = _started(run)
        run_id = store.run()["run_id"]
        victim = homes["client-proc0"]
        tls = load_tls(certs, "client-proc1")       # a participant's own TLS files
        participant = SignedIdentity.parse((certs / "client-proc1.cred").read_text())
        attempts = {
            "minted from cluster.secret": NodeCredentials("server", secret=(certs / SECRET_FILE).read_bytes().strip(),
                                                          tls=tls),
            "minted from the run token": NodeCredentials("server", secret=run.token.encode(), tls=tls),
            "own credential as the server": NodeCredentials("server", tls=tls, signed=participant),
        }
        for what, creds in attempts.items():
            with pytest.raises(CallFailed) as exc:
                _call(creds, run_id, victim, "client-proc0", Method.STATE_GET)
            assert exc.value.code == "UNAUTHENTICATED", (what, exc.value)
        # the server's own credential from the folder is obeyed: the refusals are the credentials'
        real = NodeCredentials("server", tls=tls, signed=SignedIdentity.parse((certs / "server.cred").read_text()))
        assert isinstance(_call(real, run_id, victim, "client-proc0", Method.STATE_GET), Payload)
        assert all(c.proc.poll() is None for c in run.children)
    finally:
        run.stop_all(grace=5.0)
