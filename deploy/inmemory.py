"""Run a whole experiment in one process over the in-memory transport (unit tests only).

The server and the client processes are the same classes a real run uses; only the endpoint
differs, so the final model and the ledger's byte counts equal those of a gRPC run.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch

from fedhop.client.runtime import ClientProcess
from fedhop.common.config import Config
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.inmemory import InMemoryEndpoint, InMemoryNetwork
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
from fedhop.edge.runtime import EdgeProcess
from fedhop.server.coordinator import Coordinator


def _no_calls(req: Request) -> Payload:
    """The server's Exchange handler: it serves none (as server/__main__.py's)."""
    raise HandlerError("UNKNOWN_METHOD", "the server accepts no Exchange calls in this topology")


def run_inmemory(cfg: Config, run_dir: str | Path,
                 before_run: Callable[[InMemoryNetwork, list, Coordinator], None] | None = None
                 ) -> tuple[dict, Coordinator]:
    """Run `cfg` to completion in this process; return the summary and the coordinator.
    `before_run(network, processes, coordinator)` runs once every process has registered
    (fault tests: stop an edge's endpoint to make it unreachable)."""
    run_dir = Path(run_dir)
    torch.set_num_threads(cfg.run.torch_threads)
    net = InMemoryNetwork()
    ledger = Ledger(run_dir / "ledger" / "server.jsonl", keep_drained=False)
    server_ep = InMemoryEndpoint(net, "server", ledger, chunk_bytes=cfg.transport.chunk_bytes)
    coordinator = Coordinator(cfg, run_dir, server_ep, ledger)
    address = server_ep.serve(_no_calls, register_handler=coordinator.handle_register)
    procs: list = []
    addresses = {"server": address}
    edge_threads = []
    for planned in plan_processes(cfg).processes[1:]:   # the processes a real run starts (common/topologies/plan.py)
        assert planned.parent is not None   # only the server has none
        ep = InMemoryEndpoint(net, planned.node_id, Ledger(run_dir / "ledger" / f"{planned.node_id}.jsonl"),
                              chunk_bytes=cfg.transport.chunk_bytes)
        if planned.kind == "edge":
            edge = EdgeProcess(ep, addresses[planned.parent])
            thread = threading.Thread(target=edge.start, kwargs={"client_timeout": 30.0}, daemon=True)
            thread.start()
            edge_threads.append(thread)
            procs.append(edge)
            addresses[planned.node_id] = edge.address
        else:
            proc = ClientProcess(ep, addresses[planned.parent], list(planned.clients))
            proc.register()
            procs.append(proc)
    for thread in edge_threads:
        thread.join(60.0)
    if before_run is not None:
        before_run(net, procs, coordinator)
    summary = coordinator.run(register_timeout=10.0)
    for proc in procs:
        proc.endpoint.ledger.close()
        proc.endpoint.stop()
    return summary, coordinator
