"""A peer's hand-off (walk) or share (gossip) names its sending client in `scalars["from"]`: only
an int is a client id.  A float equal to a neighbour's id (3.0) is refused as NOT_NEIGHBOUR, as
any other non-neighbour is, and leaves the receiver's state alone (the walk used to fail with a
TypeError indexing its graph with it; the gossip inbox took it as client 3)."""
from __future__ import annotations

import pytest

from fedhop.client.host import ClientHost
from fedhop.common.config import parse_config
from fedhop.common.transport.base import HandlerError
from fedhop.common.wire.message import Payload
from fedhop.topologies.chain.client import walk_of
from fedhop.topologies.gossip.client import gossip_of
from tests.test_chain import walk_config
from tests.test_gossip import gossip_config


def test_a_walk_handoff_from_a_float_client_id_is_refused():
    host = ClientHost(parse_config(walk_config()), "client-proc1", list(range(7)), run_id="")
    rule = walk_of(host).rule
    rnd, sender = 2, 3
    hop, receiver = next((h, c) for h in range(40) if (c := rule.next_client(sender, rnd, h)) != sender)
    model = {k: v + 1.0 for k, v in walk_of(host).initial.items()}
    with pytest.raises(HandlerError) as exc:
        walk_of(host).take_handoff("client-proc0", f"client-{receiver}", rnd, hop,
                               Payload(tensors=model, scalars={"from": float(sender)}))
    assert exc.value.code == "NOT_NEIGHBOUR" and not walk_of(host).pending
    walk_of(host).take_handoff("client-proc0", f"client-{receiver}", rnd, hop, Payload(tensors=model, scalars={"from": sender}))
    assert list(walk_of(host).pending) == [(rnd, hop, sender, "client-proc0")]   # the int id is taken


def test_a_gossip_share_from_a_float_client_id_is_refused():
    host = ClientHost(parse_config(gossip_config()), "client-proc0", [0, 1, 2], run_id="")
    gossip = gossip_of(host)
    receiver = 2                                           # neighbours 1, 3, 5 in the test graph
    gossip.step("client-2", 1, Payload(scalars={"host:1": "client-proc0", "host:3": "client-proc1",
                                                "host:5": "client-proc2"}))
    model = {k: v + 1.0 for k, v in gossip.models[0].items()}
    with pytest.raises(HandlerError) as exc:
        gossip.take_share("client-proc1", f"client-{receiver}", 1, Payload(tensors=model, scalars={"from": 3.0}))
    assert exc.value.code == "NOT_NEIGHBOUR" and not gossip.inbox
    gossip.take_share("client-proc1", f"client-{receiver}", 1, Payload(tensors=model, scalars={"from": 3}))
    assert list(gossip.inbox) == [(1, receiver, 3)]
