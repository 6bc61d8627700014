"""A plug-in transport (issue 46, item 1): a package laid out as a transport folder, outside the
checkout, named by `transport.kind = "package:TRANSPORT"`, with a protocol method of its own.

The package's `TRANSPORT` is the gRPC endpoint and fan-out worlds with its own STAR_ROUND data
plane: before each round's dispatch it calls its method `census` (callers: the parent only;
ledger link "control"; no tensors) on every client process that hosts a sampled client and
checks the answer (the number of clients the process hosts plus the round), and its client
handler serves `census` on the transport's `handlers`.  `fedhop run` runs it over real
processes from that folder (the plug-in admitted because the config names it).  run.db then
holds exactly one answered census per round and process on the declared link, recorded by both
ends; a caller outside the method's table is refused by name; and the model is the star run's
FedAvg.  A kind that is no transport, or a plug-in that is not a `Transport`, is one line (exit 2).
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
from fedhop.common.transport import factory
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.router import MethodRouter, Peers
from fedhop.common.wire.codec import make_envelope
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import METHODS, message_link
from tests.helpers import numpy_fedavg_round, quadratic_config

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = Path(sys.executable).parent / "fedhop"
RNG = np.random.default_rng(461)
CENTERS = RNG.normal(0, 2, size=(5, 3))
CURV = RNG.uniform(0.5, 2.0, size=(5, 3))
SIZES = [4, 9, 6, 12, 3]
ROUNDS, PROCESSES, STEPS, LR = 3, 2, 3, 0.2

PLUGIN_INIT = '''
"""A gRPC transport whose star round first takes a census of the client processes."""
from fedhop.common.transport.entry import FANOUT_PLANES, STAR_ROUND, Transport
from fedhop.common.wire.methods import PARENT, Method

CENSUS = Method("census", {PARENT}, link="control", request="empty")

TRANSPORT = Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.groups:FANOUT_WORLDS",
                      planes={**FANOUT_PLANES, STAR_ROUND: "census_transport.planes:CensusFanout"},
                      handlers={"client": ("census_transport.planes:client_handlers",)}, methods=(CENSUS,))
'''

PLUGIN_PLANES = '''
"""The transport's star plane and its client side."""
from fedhop.common.wire.message import Payload
from fedhop.server.driver import RunFailed
from fedhop.server.sampled import ClientFanout

from census_transport import CENSUS


class CensusFanout(ClientFanout):
    def dispatch(self, round, sampled, message, arrivals):
        ctx, home = self.ctx, self.ctx.nodes.client_home
        homes = {home[cid].node_id: home[cid] for cid in sampled}
        for node_id in sorted(homes):
            node = homes[node_id]
            reply = ctx.fabric.call(node.address, node_id, CENSUS, Payload(), round=round,
                                    timeout=ctx.run.cfg.run.call_timeout)
            if reply.scalars.get("count") != len(node.clients) + round:
                raise RunFailed(f"census of {node_id}: {reply.scalars}")
            ctx.records.store.add_event("census", node=node_id, round=round, detail=str(reply.scalars["count"]))
        return super().dispatch(round, sampled, message, arrivals)


def client_handlers(host):
    return {CENSUS: lambda request: Payload(scalars={"count": len(host.client_ids) + int(request.envelope.round)})}
'''


def write_plugin(folder: Path) -> None:
    (folder / "census_transport").mkdir(parents=True)
    (folder / "census_transport" / "__init__.py").write_text(textwrap.dedent(PLUGIN_INIT))
    (folder / "census_transport" / "planes.py").write_text(textwrap.dedent(PLUGIN_PLANES))


def run_fedhop(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_ALLOW_PLUGINS")}
    return subprocess.run([str(FEDHOP), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_a_plugin_transport_runs_its_own_plane_and_method_over_real_processes(tmp_path):
    folder = tmp_path / "outside"   # not under the checkout: the plug-in is the user's own package
    assert ROOT not in folder.resolve().parents
    write_plugin(folder)
    config = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, processes=PROCESSES, local_steps=STEPS, lr=LR,
                              name="census")
    (folder / "c.toml").write_text(config.replace('kind = "grpc"', 'kind = "census_transport:TRANSPORT"'))
    done = run_fedhop(folder, "run", "c.toml", "--out", "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((folder / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    store = RunStore(folder / "run" / "run.db", create=False)
    census = [m for m in store.messages() if m["method"] in ("census", "census.reply")]
    # authorized and counted: per round and process a request and its reply, each recorded by both ends
    assert len(census) == ROUNDS * PROCESSES * 2 * 2 and {m["status"] for m in census} == {"ok"}
    assert {m["link"] for m in census} == {"control"}   # the declared link
    assert {(m["src"], m["dst"]) for m in census if m["method"] == "census"} == {
        ("server", f"client-proc{p}") for p in range(PROCESSES)}
    processes = [[0, 1, 2], [3, 4]]   # the star plan: 5 clients over 2 processes
    counts = sorted((e["round"], e["node"], e["detail"]) for e in store.events("census"))
    assert counts == sorted((r, f"client-proc{p}", str(len(processes[p]) + r)) for r in range(1, ROUNDS + 1)
                            for p in range(PROCESSES))
    assert summary["faults"]["ledger"]["ok"]
    # the plane wraps the star round: FedAvg over every client each round
    w = np.zeros(3)
    for _ in range(ROUNDS):
        w = numpy_fedavg_round(w, CENTERS, CURV, SIZES, list(range(5)), STEPS, LR, 1.0)
    model = load_file(str(folder / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(model, w, rtol=1e-5, atol=1e-6)


def test_the_plugins_method_is_authorized_from_its_table_and_refused_to_others(tmp_path, monkeypatch):
    write_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = "census_transport:TRANSPORT"
    try:
        entry = factory.transport(kind)   # loaded through the plug-in loader, its method declared
        census = METHODS.get("census")
        assert census is not None and census in entry.methods and METHODS.owner(census) == f"transport '{kind}'"
        assert message_link("server", "client-proc0", "census") == "control"
        host = type("Host", (), {"client_ids": [3, 4]})()
        router = MethodRouter("client-proc1", Peers("server"))
        for handlers in factory.handler_fns(kind, "client"):
            router.register_all(handlers(host))

        def request(src: str) -> Request:
            return Request(make_envelope(run_id="r", round=2, src=src, dst="client-proc1", method="census"), Payload())

        assert router.dispatch(request("server")).scalars == {"count": 4}
        with pytest.raises(HandlerError) as refused:
            router.dispatch(request("client-proc0"))
        assert refused.value.code == "NOT_ALLOWED" and "'census'" in refused.value.detail
    finally:
        factory.TRANSPORTS.pop(kind, None)
        METHODS.withdraw(f"transport '{kind}'")
        sys.modules.pop("census_transport", None)
        sys.modules.pop("census_transport.planes", None)


@pytest.mark.parametrize("kind,message", [
    ("carrier-pigeon", "'transport.kind': unknown transport 'carrier-pigeon' (allowed: grpc, torch, inmemory"),
    ("grpcc", "unknown transport 'grpcc' (did you mean 'grpc'?)"),
    ("census_transport:CENSUS", "'census_transport:CENSUS' is not a fedhop.common.transport.entry.Transport"),
    ("no_such_module:TRANSPORT", "cannot import 'no_such_module:TRANSPORT'"),
])
def test_a_kind_that_is_no_transport_is_one_line_exit_2(tmp_path, kind, message):
    write_plugin(tmp_path)
    config = quadratic_config(CENTERS, CURV, SIZES, rounds=1, processes=1)
    (tmp_path / "c.toml").write_text(config.replace('kind = "grpc"', f'kind = "{kind}"'))
    done = run_fedhop(tmp_path, "run", "c.toml", "--out", "run")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "transport.kind" in lines[0] and message in lines[0], done.stderr
    assert not (tmp_path / "run" / "run.db").exists()
