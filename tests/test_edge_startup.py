"""An edge's start-up (edge/runtime.py): a client process may register with an edge before the
edge has its run from the server.  The registration is held, address probe included, until the
edge knows the run, so the probe names the run as it does when the edge was ready first (the
ledger of a run does not depend on which process started faster: test_engines.py compares the
in-process and process engines' byte for byte, and once saw a 50-byte probe, without the run id,
where the other had 76)."""
from __future__ import annotations

import threading

from fedhop.client.runtime import ClientProcess
from fedhop.common.transport.base import HandlerError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from fedhop.edge.runtime import EdgeProcess
from tests.helpers import quadratic_config

RUN_ID = "held-0123abcd"


def _no_calls(_req):
    raise HandlerError("UNKNOWN_METHOD", "no Exchange calls here")


def test_a_client_arriving_before_its_edge_knows_the_run_is_held_and_probed_under_the_run(tmp_path):
    config = quadratic_config([[1.0, 2.0], [3.0, -1.0]], [[1.0, 1.0], [2.0, 2.0]], [5, 7], processes=1,
                              topology='kind = "hierarchical"\nedges = 1', name="held")
    answer = threading.Event()   # the server answers the edge's first registration only when told

    def server_register(req: pb.RegisterRequest) -> pb.RegisterReply:
        answer.wait(60)
        return pb.RegisterReply(accepted=True, run_id=RUN_ID, config_toml=config, node_id="server")

    server = GrpcEndpoint("server", Ledger())
    edge_ep = GrpcEndpoint("edge-0", Ledger())
    client_ep = GrpcEndpoint("client-proc0", Ledger())
    threads: list[threading.Thread] = []
    try:
        server_address = server.serve(_no_calls, "127.0.0.1:0", register_handler=server_register)
        edge = EdgeProcess(edge_ep, server_address)
        held = threading.Event()
        wait = edge_ep.registration_wait
        assert wait is not None

        def spy(req: pb.RegisterRequest) -> str | None:
            held.set()
            return wait(req)

        edge_ep.registration_wait = spy
        threads.append(threading.Thread(target=edge.start, kwargs={"client_timeout": 60.0}, daemon=True))
        client = ClientProcess(client_ep, edge.address, [0, 1])
        threads.append(threading.Thread(target=client.register, kwargs={"deadline_s": 60.0}, daemon=True))
        for t in threads:
            t.start()
        assert held.wait(60), "the client's registration never reached the edge"
        early = [r for r in edge_ep.ledger.records() if r.method == "probe" and r.dst == "client-proc0"]
        assert early == [], "probed before the edge knew its run"
        answer.set()
        for t in threads:
            t.join(60)
        assert client.host is not None, "the client process did not register"
        probes = [r for ep in (edge_ep, client_ep) for r in ep.ledger.records() if r.method == "probe" and r.dst == "client-proc0"]
        assert sorted(r.role for r in probes) == ["receiver", "sender"], probes
        assert {r.run_id for r in probes} == {RUN_ID}, probes
        sizes = {r.payload_bytes for r in probes}
        expected = pb.ProbeRequest(target="client-proc0", nonce=bytes(16), key_id=bytes(8), run_id=RUN_ID,
                                   parent="edge-0").ByteSize()
        assert sizes == {expected}, (sizes, expected)
    finally:
        for ep in (client_ep, edge_ep, server):
            ep.stop(grace=0.1)
