"""The fabric's group round (common/transport/groups.py) over gRPC (real loopback sockets) and the
in-memory transport: `FanoutGroup` at the root, client/group_worker.py over `FanoutMember` at
each member.  The reduced
partial is checked against an independent numpy computation of the members' weighted sums and
max fields; failures stay per member; a member that does not serve the round fails the round.
(The torch.distributed implementation runs in tests/test_torch_transport.py and test_torch_hier.py.)
(That no role imports the torch.distributed transport: tests/test_layers.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhop.client.group_worker import GroupWorker
from fedhop.common.algorithms.base import Payload, reduce_payloads
from fedhop.common.transport.fabric import Fabric
from fedhop.common.transport.groups import CLIENT_PROCESSES, CLUSTER, STEP_KEY, FanoutGroup, GroupFailed, Member, worlds
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.methods import Method
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

OPS = {"top": "max"}
FAILING = 5   # this client's local work raises


class _Algorithm:
    reply_reduce = OPS

    def aggregate(self, replies):
        return reduce_payloads([p for _, p in replies], OPS)


def _train(cid: int, round: int, message: Payload, step: int) -> Payload:
    if cid == FAILING:
        raise ValueError(f"client {cid} diverged")
    w = message.tensors["w"]
    return Payload(tensors={"w": w + cid * message.scalars["lr"], "top": torch.tensor([float(cid + step)])},
                   scalars={"weight": float(cid + 1)})


@pytest.fixture(params=["grpc", "inmemory"])
def transport(request):
    """How to make an endpoint of the transport under test."""
    if request.param == "grpc":
        return request.param, GrpcEndpoint
    network = InMemoryNetwork()
    return request.param, lambda node, ledger: InMemoryEndpoint(network, node, ledger)


@pytest.fixture()
def members(transport):
    kind, make_endpoint = transport
    endpoints, out = [], []
    for k in range(3):
        node = f"client-proc{k}"
        ledger = Ledger()
        host = SimpleNamespace(node_id=node, ledger=ledger, run_id="", train=_train, algorithm=_Algorithm(),
                               cfg=SimpleNamespace(transport=SimpleNamespace(kind=kind)))
        worker = GroupWorker(host)
        worker.init(Payload(scalars={"rank": k + 1}))
        routes = {Method.TORCH_ROUND.value: lambda r, w=worker: w.round(int(r.envelope.round), r.payload)}
        if k == 2:   # serves no round: its member's calls fail
            routes = {}
        endpoint = make_endpoint(node, ledger)
        address = endpoint.serve(lambda r, routes=routes: routes[r.envelope.method](r), "127.0.0.1:0")
        endpoints.append(endpoint)
        out.append(Member(node, address))
    yield out
    for endpoint in endpoints:
        endpoint.stop()


def _root(transport):
    endpoint = transport[1]("server", Ledger())
    return endpoint, Fabric(endpoint)


def test_a_fanout_group_round_reduces_the_members_partials_by_op(transport, members):
    endpoint, fabric = _root(transport)
    try:
        group = worlds(transport[0]).star(fabric, members[:2], SimpleNamespace(kind=transport[0]), Ledger(), "")
        assert isinstance(group, FanoutGroup)
        w = torch.linspace(-1.0, 1.0, 7)
        clients = {"client-proc0": [1, 2], "client-proc1": [3, FAILING, 8]}
        result = group.round(4, Payload(tensors={"w": w}, scalars={"lr": 0.5}), clients, ops=OPS, timeout=20,
                             reduce_timeout=20, where="round 4")
    finally:
        fabric.close()
        endpoint.stop()
    ok = [1, 2, 3, 8]
    weights = np.array([c + 1.0 for c in ok])
    expected_w = sum(n * (w.numpy().astype(np.float64) + c * 0.5) for n, c in zip(weights, ok))
    np.testing.assert_allclose(result.partial.tensors["w"].numpy(), expected_w, rtol=1e-6)
    assert float(result.partial.tensors["top"]) == max(ok)                         # a max field, not a sum
    assert result.partial.scalars["weight"] == pytest.approx(weights.sum())
    assert result.partial.scalars["num_results"] == len(ok)
    assert list(result.failures["client-proc1"]) == [FAILING] and not result.failures["client-proc0"]
    assert "diverged" in result.failures["client-proc1"][FAILING]
    assert list(result.all_failures(prefix=True).values())[0].startswith("at client-proc1: ")


def test_a_cluster_group_round_carries_its_step(transport, members):
    endpoint, fabric = _root(transport)
    try:
        cluster = FanoutGroup(fabric, members[:1], CLUSTER)
        assert cluster._round_payload(Payload(scalars={"lr": 1.0}), [1], 3, tensors=False).scalars[STEP_KEY] == 3
        result = cluster.round(2, Payload(tensors={"w": torch.zeros(2)}, scalars={"lr": 1.0}), {"client-proc0": [4]},
                               ops=OPS, timeout=20, reduce_timeout=20, where="edge-0: round 2 edge iteration 3", step=3)
    finally:
        fabric.close()
        endpoint.stop()
    assert float(result.partial.tensors["top"]) == 4 + 3                           # the member trained at step 3
    assert torch.equal(result.partial.tensors["w"], torch.full((2,), 5.0 * 4))     # weight 5, w + 4


def test_a_member_that_does_not_finish_fails_the_round_and_is_named(transport, members):
    endpoint, fabric = _root(transport)
    try:
        group = FanoutGroup(fabric, members, CLIENT_PROCESSES)
        with pytest.raises(GroupFailed, match=r"round 1: client processes \['client-proc2'\] did not finish"):
            group.round(1, Payload(tensors={"w": torch.zeros(3)}, scalars={"lr": 1.0}),
                        {"client-proc0": [1], "client-proc1": [2], "client-proc2": [3]}, ops=OPS, timeout=20,
                        reduce_timeout=20, where="round 1")
    finally:
        fabric.close()
        endpoint.stop()

