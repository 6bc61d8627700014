"""`Fabric.send_to_all`: the control fan-outs (shut-downs, state pulls, Fed-CHS queries) sent at once,
each failure its own call's error, every message in the ledger as a one-by-one call records it."""
from __future__ import annotations

import threading

from fedhop.common.transport.base import HandlerError, RemoteError
from fedhop.common.transport.fabric import Fabric, Send
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
from fedhop.topologies.sequential import SEQ_QUERY
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

N = 4   # peers; peer 2 refuses


def _peers(barrier: threading.Barrier | None):
    net = InMemoryNetwork()
    addresses = {}
    for k in range(N):
        def handler(request, k=k):
            if barrier is not None:
                barrier.wait()   # every peer's call must be in flight at once
            if k == 2:
                raise HandlerError("BUSY", f"peer {k} refuses")
            return Payload(scalars={"k": k, "seen": request.payload.scalars.get("x", -1)})
        ep = InMemoryEndpoint(net, f"edge-{k}", Ledger())
        addresses[k] = ep.serve(handler)
    return net, addresses


def test_every_call_is_in_flight_at_once_and_each_failure_is_its_own_error():
    barrier = threading.Barrier(N, timeout=60)   # the refusing peer waits too
    net, addresses = _peers(barrier)
    ledger = Ledger()
    fabric = Fabric(InMemoryEndpoint(net, "server", ledger))
    message = Payload(scalars={"x": 7})
    results, failures = fabric.send_to_all([Send(k, addresses[k], f"edge-{k}", SEQ_QUERY, message)
                                            for k in range(N)], round=3, call_timeout=60.0)
    assert sorted(results) == [k for k in range(N) if k != 2] and list(failures) == [2]
    assert all(results[k].scalars == {"k": k, "seen": 7} for k in results)
    assert failures[2] == str(RemoteError("BUSY", "peer 2 refuses", "edge-2"))
    sent = [r for r in ledger.records() if r.role == "sender"]
    assert sorted(r.dst for r in sent) == [f"edge-{k}" for k in range(N)]
    assert len({r.payload_bytes for r in sent}) == 1   # one message, encoded once, the same bytes to each
    fabric.close()


def test_a_closed_fabric_sends_one_by_one_with_the_same_outcomes():
    net, addresses = _peers(None)
    open_ledger, closed_ledger = Ledger(), Ledger()
    outcomes = []
    for ledger, close_first in ((open_ledger, False), (closed_ledger, True)):
        fabric = Fabric(InMemoryEndpoint(net, "server", ledger))
        if close_first:
            fabric.close()
        results, failures = fabric.send_to_all([Send(k, addresses[k], f"edge-{k}", SEQ_QUERY, Payload())
                                                for k in range(N)], round=1, call_timeout=10.0)
        outcomes.append(({k: p.scalars for k, p in results.items()}, failures))
        fabric.close()
    assert outcomes[0] == outcomes[1] and sorted(outcomes[0][0]) == [0, 1, 3]
    sizes = [sorted((r.dst, r.role, r.payload_bytes) for r in led.records())
             for led in (open_ledger, closed_ledger)]
    assert sizes[0] == sizes[1] and len(sizes[0]) == 2 * N
