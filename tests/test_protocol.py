"""The typed protocol (common/wire/methods.py, common/transport/router.py): every method of every
role is obeyed only from its allowed callers, unknown methods are refused, each method keeps
its ledger link; and over real gRPC with node tokens, a participant with a valid credential
cannot shut down, train or read another client process (NOT_ALLOWED, an event in run.db) and
the run completes with the honest model."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.client.host import ClientHost
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import parse_config
from fedhop.common.security.auth import NodeCredentials, write_cluster
from fedhop.common.transport.base import HandlerError, RemoteError, Request
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.transport.router import MethodRouter
from fedhop.common.wire.codec import make_envelope
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.methods import Method, message_link
from fedhop.edge.aggregator import EdgeAggregator
from fedhop.topologies.sequential.edge import SequentialEdge
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork
from tests.cluster import Cluster, fedavg_reference
from tests.helpers import quadratic_config
from tests.test_fedchs import fedchs_config

RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(4, 3))
CURV = RNG.uniform(0.5, 2.0, size=(4, 3))
SIZES = [3, 5, 7, 9]
ROUNDS, STEPS, LR = 2, 2, 0.1
RUN = "run-under-test"

CLIENT_METHODS = {"train", "ping", "shutdown", "state_get", "state_set"}
CLIENT_TORCH_METHODS = {"torch_init", "torch_round", "torch_reduce"}          # only in a torch run
WALK_METHODS = {"walk_visit", "walk_handoff"}                                  # only in a chain run
GOSSIP_METHODS = {"gossip_step", "gossip_send", "gossip_share", "gossip_mix"}  # only in a gossip run
PEER_METHODS = ("walk_handoff", "gossip_share")   # client process to client process
EDGE_METHODS = {"edge_round", "shutdown", "state_get", "state_set"}
EDGE_TORCH_METHODS = {"torch_procs", "torch_init", "torch_edge_round", "torch_edge_reduce"}   # only in a torch run
SEQ_METHODS = {"seq_round", "seq_handoff", "seq_final", "control.seq_query", "control.seq_restore"}
CALLERS = ["server", "edge-0", "edge-1", "edge-2", "edge-3", "client-proc1", "client-7"]


def _client(parent: str, kind: str = "star", transport: str = "grpc") -> ClientHost:
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR,
                                        topology=f'kind = "{kind}"'), [f"transport.kind={transport}"])
    return ClientHost(cfg, "client-proc0", [0, 1], RUN, Ledger(), parent=parent)


def _edge(sequential: bool, transport: str = "grpc"):
    if sequential:   # tests/test_fedchs.py's graph: edge-2's only neighbour is edge-1
        text = fedchs_config()
    else:
        text = quadratic_config(CENTERS, CURV, SIZES, topology='kind = "hierarchical"\nedges = 4')
    cfg = parse_config(text, [f"transport.kind={transport}"])
    agg = EdgeAggregator(cfg, InMemoryEndpoint(InMemoryNetwork(), "edge-2", Ledger()), RUN, "", parent="server")
    if sequential:
        SequentialEdge(agg)
    return agg


# role -> (builder, methods served, allowed(method, caller)), written out here, not read from common/wire/methods.py
ROLES = {
    "client of the server": (lambda: _client("server"), CLIENT_METHODS,
                             lambda m, c: (c == "server" and m not in PEER_METHODS) or m == "ping"
                             or (m in PEER_METHODS and c.startswith("client-"))),
    "client of edge-1": (lambda: _client("edge-1"), CLIENT_METHODS,
                         lambda m, c: (c == "edge-1" and m not in PEER_METHODS) or m == "ping"
                         or (m in PEER_METHODS and c.startswith("client-"))),
    "client of the server, chain": (lambda: _client("server", "chain"), CLIENT_METHODS | WALK_METHODS,
                                    lambda m, c: (c == "server" and m not in PEER_METHODS) or m == "ping"
                                    or (m in PEER_METHODS and c.startswith("client-"))),
    "client of the server, gossip": (lambda: _client("server", "gossip"), CLIENT_METHODS | GOSSIP_METHODS,
                                     lambda m, c: (c == "server" and m not in PEER_METHODS) or m == "ping"
                                     or (m in PEER_METHODS and c.startswith("client-"))),
    "client of the server, torch": (lambda: _client("server", transport="torch"), CLIENT_METHODS | CLIENT_TORCH_METHODS,
                                    lambda m, c: (c == "server" and m not in PEER_METHODS) or m == "ping"),
    "edge, hierarchical": (lambda: _edge(False), EDGE_METHODS, lambda m, c: c == "server"),
    "edge, hierarchical, torch": (lambda: _edge(False, "torch"), EDGE_METHODS | EDGE_TORCH_METHODS,
                                  lambda m, c: c == "server"),
    "edge-2, sequential": (lambda: _edge(True), EDGE_METHODS | SEQ_METHODS,
                           lambda m, c: (c == "server" and m != "seq_handoff")
                           or (c == "edge-1" and m in ("seq_handoff", "control.seq_query"))),
}


def _request(method: str, src: str, dst: str = "client-0") -> Request:
    return Request(make_envelope(run_id=RUN, round=1, src=src, dst=dst, method=method), Payload())


@pytest.mark.parametrize("role", list(ROLES))
def test_every_method_of_every_role_is_obeyed_only_from_its_allowed_callers(role):
    build, served, rule = ROLES[role]
    node = build()
    assert {str(m) for m in node.router.methods} == served
    # the allowed calls reach their handler (stubbed here: a real shutdown or train has effects)
    stub = MethodRouter(node.router.owner, node.router.peers)
    stub.register_all({m: (lambda request: Payload(scalars={"ran": True})) for m in node.router.methods})
    table = {}
    for method in sorted(served):
        for caller in CALLERS:
            try:
                table[method, caller] = stub.dispatch(_request(method, caller)).scalars == {"ran": True}
            except HandlerError as exc:
                assert exc.code == "NOT_ALLOWED", exc
                table[method, caller] = False
                # the role itself refuses it before any handler runs, with the same typed error
                with pytest.raises(HandlerError) as refused:
                    node.handle(_request(method, caller))
                assert refused.value.code == "NOT_ALLOWED" and caller in refused.value.detail
    assert table == {(m, c): rule(m, c) for m in sorted(served) for c in CALLERS}


@pytest.mark.parametrize("role", list(ROLES))
def test_unknown_and_unserved_methods_are_refused_typed(role):
    node = ROLES[role][0]()
    parent = node.router.peers.parent
    for method in ("evaluate", "handoff", "control.anything", "train.reply", "register", "heartbeat",
                   *(str(m) for m in Method if m.rpc == "Exchange" and m not in node.router.methods)):
        with pytest.raises(HandlerError) as refused:
            node.handle(_request(method, parent))
        assert refused.value.code == "UNKNOWN_METHOD", method


def test_each_method_keeps_its_ledger_link():
    """The link rule is a property of the method: the Fed-CHS query and restore are `control`,
    every other method is the link between the two nodes' roles (as before the enum)."""
    pairs = [("server", "client-3", "client-server"), ("edge-1", "client-3", "client-edge"),
             ("server", "edge-1", "edge-server"), ("edge-0", "edge-1", "edge-edge")]
    for m in Method:
        for src, dst, by_roles in pairs:
            assert message_link(src, dst, m) == ("control" if m.value.startswith("control.") or m.rpc != "Exchange"
                                                 else by_roles)
    assert {m.value for m in Method if m.link == "control"} == {"control.seq_query", "control.seq_restore",
                                                                "register", "heartbeat"}
    assert len({m.value for m in Method}) == len(Method) == 29   # 27 Exchange methods, Register, Heartbeat


@pytest.mark.parametrize("identity", ["token", "mtls"])
def test_a_participant_cannot_command_another_client_process_over_grpc(tmp_path, identity):
    """client-proc1's valid credential (its node token, or its certificate under mutual TLS),
    used by a hostile process, to call client-proc0's shutdown, train and state_get: each
    refused NOT_ALLOWED (the interceptor proves the caller is client-proc1; client-proc0 obeys
    only the server), each a `not_allowed` event in run.db; the run completes and its model is
    the FedAvg of every client."""
    if identity == "token":
        secret = b"cluster-secret-for-the-protocol-test"

        def creds(node):
            return NodeCredentials(node, secret=secret)
    else:
        certs = tmp_path / "certs"
        write_cluster(certs, ["server", "client-proc0", "client-proc1"])

        def creds(node):
            return NodeCredentials.from_options(node, str(certs), mtls=True)
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR,
                                        name="notallowed"), ["run.min_results=1"])
    cluster = Cluster(cfg, tmp_path / "run", creds=creds)
    hostile = GrpcEndpoint("client-proc1", Ledger(), credentials=creds("client-proc1"))
    hostile.run_id = cluster.coord.run_id
    codes = {}
    try:
        victim = cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3])
        for method, dst in (("shutdown", "client-proc0"), ("train", "client-0"), ("state_get", "client-proc0")):
            with pytest.raises(RemoteError) as refused:
                hostile.call(victim.address, dst, method, Payload(), round=1, timeout=10.0)
            codes[method] = refused.value.code
        summary = cluster.run()
    finally:
        hostile.stop(grace=0.1)
        cluster.close()
    assert codes == {"shutdown": "NOT_ALLOWED", "train": "NOT_ALLOWED", "state_get": "NOT_ALLOWED"}
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    events = cluster.store().events("not_allowed")
    assert sorted(e["detail"].split("; ")[1].split(" to ")[0] for e in events) == ["shutdown", "state_get", "train"]
    assert {e["node"] for e in events} == {"client-proc1"}
    assert summary["faults"]["rejections"] == {"NOT_ALLOWED": 3}
    assert summary["faults"]["ledger"]["ok"], summary["faults"]["ledger"]
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(),
                               fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {}), rtol=1e-5, atol=1e-6)


def test_control_data_travels_typed_in_the_envelope_and_is_counted():
    """The codec carries `Payload.control` in the envelope (also when one encoding is sent under
    many headers); its bytes are in payload_bytes; empty control data is no field at all."""
    import torch

    from fedhop.common.transport.control import failures_control, failures_of
    from fedhop.common.wire import fedhop_pb2 as pb
    from fedhop.common.wire.codec import decode_frames, encode
    tensors = {"w": torch.arange(5, dtype=torch.float32)}
    control = failures_control({4: "timeout at edge-1", 2: "NON_FINITE: w"}, pb.Control(clients=[2, 4, 9]))
    plain = encode(Payload(tensors=dict(tensors)), pb.Envelope())
    typed = encode(Payload(tensors=dict(tensors), control=control), pb.Envelope())
    back = decode_frames(typed.frames).payload
    assert list(back.control.clients) == [2, 4, 9] and failures_of(back) == {2: "NON_FINITE: w", 4: "timeout at edge-1"}
    assert torch.equal(back.tensors["w"], tensors["w"]) and back.scalars == {}
    # the header grows by the serialized Control (field 14: one tag byte and a length varint)
    assert typed.payload_bytes - plain.payload_bytes == control.ByteSize() + 2
    empty = encode(Payload(tensors=dict(tensors), control=pb.Control()), pb.Envelope())
    assert empty.payload_bytes == plain.payload_bytes and decode_frames(empty.frames).payload.control is None
    header = make_envelope(run_id=RUN, round=1, src="server", dst="edge-1", method="edge_round")
    resent = decode_frames(typed.with_header(header).frames).payload
    assert resent.control == control


def test_the_proto_comment_lists_exactly_the_methods_that_exist():
    """proto/fedhop.proto's Envelope.method comment names every Exchange method of
    common/wire/methods.py and nothing else (register and heartbeat are their own RPCs)."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "proto" / "fedhop.proto").read_text()
    block = text[text.index("// One of common/wire/methods.py's methods:"):text.index("string method = 6;")]
    listed = set(re.findall(r"\b(?:control\.)?[a-z]+(?:_[a-z]+)+\b|\b(?:train|ping|shutdown)\b",
                            block.split("; a reply's")[0].split(":", 1)[1].split("(register")[0]))
    exchanged = {m.value for m in Method} - {"register", "heartbeat"}
    assert listed == exchanged, (sorted(listed - exchanged), sorted(exchanged - listed))
