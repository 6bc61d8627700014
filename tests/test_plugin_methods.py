"""A topology's own protocol methods (issue 46, item 2): declared by their owner in its spec,
authorized, served and counted exactly like the core's.

The acceptance test writes a plug-in package into a temporary folder outside the checkout: a
star topology whose server driver calls its own method `sum_probe` (callers: the parent only;
ledger link "control"; no tensors) on every client process each round and checks the answer
(the sum of the process's client ids plus the round); in round 1 it also asks client-proc0 to
call `sum_probe` on client-proc1 with its own credentials, a caller outside the method's table.
`fedhop run` runs it over real processes from that folder (the plug-in admitted because the
config names it).  run.db's messages then hold exactly rounds x processes answered sum_probe
calls on the declared link (request and reply, each recorded by sender and receiver) and the
one refused call, whose error names the method; the run completes with the model FedAvg gives.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.records.runstore import RunStore
from fedhop.common.topologies import TopologySpec
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.router import MethodRouter, Peers
from fedhop.common.wire.codec import make_envelope
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import METHODS, PARENT, PEER, Method, MethodClash, MethodTable, message_link
from tests.helpers import numpy_fedavg_round, quadratic_config

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = Path(sys.executable).parent / "fedhop"
RNG = np.random.default_rng(46)
CENTERS = RNG.normal(0, 2, size=(5, 3))
CURV = RNG.uniform(0.5, 2.0, size=(5, 3))
SIZES = [4, 9, 6, 12, 3]
ROUNDS, PROCESSES, STEPS, LR = 3, 2, 3, 0.2

PLUGIN = '''
"""A star topology with a protocol method of its own: `sum_probe`."""
from fedhop.common.topologies import TopologySpec
from fedhop.common.transport.base import RemoteError
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import PARENT, Method
from fedhop.server.driver import RunFailed
from fedhop.topologies.star.driver import StarDriver

SUM_PROBE = Method("sum_probe", {PARENT}, link="control", request="empty")


class ProbeStar(StarDriver):
    """Each round: sum_probe to every client process (its answer checked), then the star round."""

    def run_round(self, round):
        ctx = self.ctx
        nodes = sorted({h.node_id: h for h in ctx.nodes.client_home.values()}.values(), key=lambda h: h.node_id)
        for i, node in enumerate(nodes):
            control = None
            if round == 1 and i == 0:   # client-proc0 is asked to probe its peer client-proc1 itself
                peer = nodes[1]
                control = pb.Control(walk_peers=[pb.ClientAddress(client_id=min(peer.clients), address=peer.address)])
            reply = ctx.fabric.call(node.address, node.node_id, SUM_PROBE, Payload(control=control), round=round,
                                    timeout=ctx.run.cfg.run.call_timeout)
            want = sum(node.clients) + round
            if reply.scalars.get("sum") != want:
                raise RunFailed(f"sum_probe of {node.node_id}: {reply.scalars} (want sum {want})")
            if control is not None and not str(reply.scalars.get("peer_refused", "")).startswith("NOT_ALLOWED"):
                raise RunFailed(f"the peer's sum_probe was not refused: {reply.scalars}")
            ctx.records.store.add_event("sum_probe", node=node.node_id, round=round, detail=str(reply.scalars["sum"]))
        return super().run_round(round)


def probe_handlers(host):
    def answer(request):
        out = {"sum": sum(host.client_ids) + int(request.envelope.round)}
        peers = request.payload.control.walk_peers if request.payload.control is not None else []
        for peer in peers:   # a call from this process to a peer: a caller outside sum_probe's table
            try:
                host.fabric.call(peer.address, "client-proc1", SUM_PROBE, Payload(), round=request.envelope.round,
                                 timeout=30.0)
                out["peer_refused"] = "obeyed"
            except RemoteError as exc:
                out["peer_refused"] = f"{exc.code}: {exc}"
        return Payload(scalars=out)
    return {SUM_PROBE: answer}


SPEC = TopologySpec(name="probe_star", driver=ProbeStar, client_handlers=(probe_handlers,), methods=(SUM_PROBE,))
'''


def _request(method: str, src: str, dst: str = "client-proc0") -> Request:
    return Request(make_envelope(run_id="r", round=1, src=src, dst=dst, method=method), Payload())


def test_a_plugin_topology_serves_its_own_method_over_real_processes(tmp_path):
    folder = tmp_path / "outside"   # not under the checkout: the plug-in is the user's own package
    assert ROOT not in folder.resolve().parents
    (folder / "probe_plugin").mkdir(parents=True)
    (folder / "probe_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (folder / "c.toml").write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, processes=PROCESSES,
                                                    local_steps=STEPS, lr=LR, name="probe",
                                                    topology='kind = "probe_plugin:SPEC"'))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_ALLOW_PLUGINS")}
    done = subprocess.run([str(FEDHOP), "run", "c.toml", "--out", str(folder / "run")], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((folder / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    store = RunStore(folder / "run" / "run.db", create=False)
    probes = [m for m in store.messages() if m["method"] in ("sum_probe", "sum_probe.reply")]
    served = [m for m in probes if m["src"] == "server" or m["dst"] == "server"]
    # authorized and counted: per round and process a request and its reply, each recorded by both ends
    assert len(served) == ROUNDS * PROCESSES * 2 * 2 and {m["status"] for m in served} == {"ok"}
    assert {m["link"] for m in probes} == {"control"}            # the declared link, not the roles' client-server
    assert {(m["src"], m["dst"]) for m in served if m["method"] == "sum_probe"} == {
        ("server", f"client-proc{p}") for p in range(PROCESSES)}
    # the driver used each answer (it fails the run on a wrong sum): its events hold the sums
    processes = [[0, 1, 2], [3, 4]]   # the star plan: 5 clients over 2 processes
    sums = sorted((e["round"], e["node"], e["detail"]) for e in store.events("sum_probe"))
    assert sums == sorted((r, f"client-proc{p}", str(sum(processes[p]) + r)) for r in range(1, ROUNDS + 1)
                          for p in range(PROCESSES))
    # the peer's call, outside the table (a client process is not client-proc1's parent): refused by name,
    # recorded by both ends (the request and the error reply, each refused where it was received)
    peer = [m for m in probes if m not in served]
    assert {(m["src"], m["dst"], m["method"], m["round"]) for m in peer} == {
        ("client-proc0", "client-proc1", "sum_probe", 1), ("client-proc1", "client-proc0", "sum_probe.reply", 1)}
    refused = [m for m in peer if m["status"] == "rejected"]
    assert len(refused) == 2 and all(m["error"].startswith("NOT_ALLOWED: client-proc1 obeys 'sum_probe' only from "
                                                          "its parent") for m in refused), refused
    assert summary["faults"]["rejections"] == {"NOT_ALLOWED": 2} and summary["faults"]["ledger"]["ok"]
    events = [e for e in store.events("not_allowed") if e["node"] == "client-proc0"]
    assert len(events) == 1 and "sum_probe to client-proc1 refused by client-proc1" in events[0]["detail"]
    # and the run is the star run it wraps: FedAvg over every client each round
    w = np.zeros(3)
    for _ in range(ROUNDS):
        w = numpy_fedavg_round(w, CENTERS, CURV, SIZES, list(range(5)), STEPS, LR, 1.0)
    model = load_file(str(folder / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(model, w, rtol=1e-5, atol=1e-6)


@pytest.fixture
def withdrawn():
    """The owners a test declares for are withdrawn after it (other tests count the table)."""
    owners: list[str] = []
    yield owners
    for owner in owners:
        METHODS.withdraw(owner)


def test_a_declared_method_is_authorized_like_a_built_in_and_an_unknown_one_is_refused_by_name(withdrawn):
    withdrawn += ["topology 'unit_probe_46'", "topology 'short_46'"]
    probe = Method("unit_probe_46", {PARENT}, link="control", request="empty")
    spec = TopologySpec(name="unit_probe_46", driver="x:y", methods=(probe,))
    assert METHODS.get("unit_probe_46") is probe and Method.UNIT_PROBE_46 is probe and METHODS.owner(probe) == \
        "topology 'unit_probe_46'"
    assert message_link("server", "client-proc0", "unit_probe_46") == "control"
    assert message_link("server", "client-proc0", "train") == "client-server"
    router = MethodRouter("client-proc0", Peers("server"))
    router.register_all({"unit_probe_46": lambda request: Payload(scalars={"ran": 1})})   # by its wire string
    assert router.dispatch(_request("unit_probe_46", "server")).scalars == {"ran": 1}
    with pytest.raises(HandlerError) as refused:
        router.dispatch(_request("unit_probe_46", "client-proc1"))
    assert refused.value.code == "NOT_ALLOWED" and "'unit_probe_46'" in refused.value.detail
    for unknown in ("unit_probe_47", "unit_probe_46.reply", "gossip_step"):
        with pytest.raises(HandlerError) as refused:
            router.dispatch(_request(unknown, "server"))
        assert refused.value.code == "UNKNOWN_METHOD" and f"'{unknown}'" in refused.value.detail
    with pytest.raises(ValueError, match="cannot serve 'unit_probe_47': no topology"):
        router.register("unit_probe_47", lambda request: Payload())
    assert spec.methods == (probe,)

    class ShortForm:   # the short form: a driver class whose class attribute declares its methods
        methods = (Method("unit_probe_short_46", {PEER}),)
    assert TopologySpec(name="short_46", driver=ShortForm).methods == ShortForm.methods
    assert METHODS.owner("unit_probe_short_46") == "topology 'short_46'" and Method.UNIT_PROBE_SHORT_46.callers == {PEER}
    assert [m.value for m in METHODS.withdraw("topology 'short_46'")] == ["unit_probe_short_46"]
    assert Method.parse("unit_probe_short_46") is None and "unit_probe_short_46" not in Method


def test_a_clash_is_refused_naming_both_owners_and_declares_nothing():
    table = MethodTable()
    table.declare([Method("probe", {PARENT}), Method("probe_twin", {PARENT})], "topology 'a'")
    table.declare([Method("probe", {PARENT})], "topology 'a2'")    # the same meaning: kept, as declared first
    assert table.owner("probe") == "topology 'a'"
    with pytest.raises(MethodClash) as clash:
        table.declare([Method("other", {PARENT}), Method("probe", {PEER})], "topology 'b'")
    assert "topology 'a'" in str(clash.value) and "topology 'b'" in str(clash.value) and "'probe'" in str(clash.value)
    assert table.get("other") is None and len(table) == 2          # nothing of b's was added
    with pytest.raises(MethodClash, match="Method.PROBE"):
        table.declare([Method("control.probe", {PARENT})], "topology 'c'")   # the same attribute name
    # through a spec, against the built-in table: a plug-in cannot redefine gossip's methods
    before = len(Method)
    with pytest.raises(MethodClash) as clash:
        TopologySpec(name="thief", driver="x:y", methods=(Method("gossip_share", {PARENT}), Method("thief_x", {PARENT})))
    assert "topology 'gossip'" in str(clash.value) and "topology 'thief'" in str(clash.value)
    assert len(Method) == before and Method.parse("thief_x") is None and Method.GOSSIP_SHARE.callers == {PEER}
