"""The in-process engine (`[run] engine = "inprocess"`, `fedhop run --engine inprocess`): every
role of a run inside this one process.

The processes of the config's process plan (common/topologies/plan.py) are built from the classes
a process run starts (server/coordinator.py `Coordinator`, edge/runtime.py `EdgeProcess`,
client/runtime.py `ClientProcess`), each on an `InMemoryEndpoint` (transports/inmemory/endpoint.py)
instead of a gRPC one.  A call runs the callee's handler in the caller's thread on the frames
the codec produced, and both ends record gRPC's framing for it, so the run folder holds what a
process run's holds (config.toml, run.db, summary.json, model.safetensors, ledger/*.jsonl,
checkpoints) with the same model bit for bit and the same bytes for every message except the
heartbeats, which the in-memory transport does not send, and fields that name an address
(docs/run-folder.md, "The in-process engine").

What a role process sets up besides its endpoint and is kept here: the server's live byte view
(common/transport/livebytes.py), fed at each round's end from every process's own counter
instead of from heartbeats, and the server's checkpoints and resume (server/resilience.py).
Left out: heartbeats (a role here dies only with the whole run, a worker process apart from it:
its client processes' calls then fail as a dead process's do, and the server stops sampling
their clients, deploy/launch/workers.py `WorkerLiveness`), TLS and node credentials (no
sockets), child refusal reports (a child's refusal is an exception here).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from fedhop.client.runtime import ClientProcess
from fedhop.common.config import Config, config_to_toml
from fedhop.common.tasks import build_task
from fedhop.common.topologies import spec_for
from fedhop.common.topologies.plan import PlannedProcess, plan_processes
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.livebytes import LinkCounter, ServerLive
from fedhop.common.transport.placement import process_device
from fedhop.common.util.procexit import freeze_heap
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
from fedhop.deploy.launch.engine import INPROCESS
from fedhop.deploy.launch.workers import (
    CLIENT_PEERS,
    SharedTask,
    Worker,
    WorkerClientProcess,
    WorkerEndpoint,
    WorkerLiveness,
    can_fork,
    close_all,
    start_workers,
    worker_count,
)
from fedhop.edge.runtime import EdgeProcess
from fedhop.server.coordinator import Coordinator
from fedhop.server.resilience import Checkpointer, resume
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

EDGE_WAIT = 120.0      # seconds an edge waits for its clients' registrations, as an edge process does
LOG_NAME = "inprocess.log"   # the run's one log (a process run has one per process)


def _no_calls(req: Request) -> Payload:
    """The server's Exchange handler: it serves none (as server/__main__.py's)."""
    raise HandlerError("UNKNOWN_METHOD", "the server accepts no Exchange calls in this topology")


@dataclass
class Role:
    """One planned process of the run: its object (a ClientProcess or an EdgeProcess), its
    endpoint and its live byte counter."""

    planned: PlannedProcess
    process: ClientProcess | EdgeProcess
    endpoint: InMemoryEndpoint
    counter: LinkCounter


@dataclass
class InProcessRun:
    """A run's roles, built and registered in this process (`build`), ready for `run`."""

    cfg: Config
    run_dir: Path
    network: InMemoryNetwork
    coordinator: Coordinator
    live: ServerLive
    checkpointer: Checkpointer
    roles: list[Role] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)   # run.workers: where the client processes train (workers.py)

    def report_live(self, round: int | None = None) -> None:
        """Every process's own byte totals into the server's live view, then the server's: what
        heartbeats carry up in a process run, exact here at each round's end."""
        for role in self.roles:
            self.live.report(role.counter.entries())
        self.live.flush(round)

    def run(self, register_timeout: float = 60.0) -> dict:
        """Play the rounds (Coordinator.run: its stop signals, records and summary) and close
        every endpoint; returns the summary."""
        try:
            summary = self.coordinator.run(register_timeout=register_timeout)
            self.report_live()   # the last figures: the live view now equals the final table
        finally:
            self.close()
        return summary

    def close(self) -> None:
        """Take every endpoint off the network (a call still under way fails fast) and close the
        children's ledgers and senders; the server's run.db is closed last."""
        for role in self.roles:
            role.endpoint.stop()
            role.endpoint.ledger.close()
            host = getattr(role.process, "host", None)
            if host is not None and host.fabric is not None:
                host.fabric.close()
        close_all(self.workers)
        self.coordinator.endpoint.stop()
        self.coordinator.store.close()


def _ledger(run_dir: Path, node_id: str, hold: bool = False) -> tuple[Ledger, LinkCounter]:
    """A process's ledger file under ledger/, watched by its live byte counter; only the server's
    holds its records until each round drains them into run.db."""
    ledger = Ledger(run_dir / "ledger" / f"{node_id}.jsonl", keep_drained=not hold, hold=hold)
    counter = LinkCounter(node_id)
    ledger.observers.append(counter.observe)
    return ledger, counter


def _start_edge(edge: EdgeProcess, errors: list[BaseException]) -> threading.Thread:
    """An edge's start-up (it waits for its clients' registrations) in a thread of its own, as an
    edge process does it beside its clients; an error is kept for `build` to raise."""
    def start() -> None:
        try:
            edge.start(client_timeout=EDGE_WAIT)
        except BaseException as exc:  # noqa: BLE001 - raised again by `build`, in the main thread
            errors.append(exc)

    thread = threading.Thread(target=start, name=f"fedhop {edge.endpoint.node_id}", daemon=True)
    thread.start()
    return thread


def build(cfg: Config, run_dir: str | Path, devices: dict[str, str] | None = None,
          resume_run: bool = False) -> InProcessRun:
    """The server, then every edge and client process of the plan, registered; with `resume_run`,
    the server continues from the newest checkpoint in `run_dir` (server/resilience.py).
    `devices`: node id -> device, as the launcher's device plan gives it (default: the config's
    keys).  cfg.run.engine is set to "inprocess": config.toml and summary.json say how it ran."""
    cfg.run.engine = INPROCESS
    devices = devices or {}
    run_dir = Path(run_dir)
    # the workers first: forked where this process may (no thread of the run yet; its only torch
    # computation the task's data, built with one thread and shared with them), else started as
    # fresh interpreters (workers.py `ExecProcess`), which import while the server is set up
    planned = plan_processes(cfg).processes[1:]
    on_gpu = any(d.startswith("cuda") for d in (*devices.values(), cfg.clients.device, cfg.run.device))
    forkable = not on_gpu and can_fork()
    count = worker_count(cfg, sum(p.kind != "edge" for p in planned), forkable)
    fork = count > 0 and forkable
    shared = None
    if fork and cfg.run.torch_threads == 1:   # the data built once, before the fork (workers.py `SharedTask`)
        torch.set_num_threads(1)
        shared = SharedTask(config_to_toml(cfg), build_task(cfg))
        fork = can_fork()   # unless building it started a thread (a plug-in's loader pool): then spawn
    workers = start_workers(count, fork, shared)
    try:
        torch.set_num_threads(cfg.run.torch_threads)
        net = InMemoryNetwork()
        ledger, counter = _ledger(run_dir, "server", hold=True)
        server_ep = InMemoryEndpoint(net, "server", ledger, chunk_bytes=cfg.transport.chunk_bytes)
        server_ep.use_checksum(cfg.security.checksum)   # as server/__main__.py sets it
        device = process_device(devices.get("server", ""), cfg.run.device, "run.device")
        coordinator = Coordinator(cfg, run_dir, server_ep, ledger, device=device,
                                  task=shared.task if shared is not None and device.type == "cpu" else None)
    except BaseException:
        close_all(workers)
        raise
    live = ServerLive(coordinator.store, counter)
    checkpointer = Checkpointer(coordinator)
    engine = InProcessRun(cfg, run_dir, net, coordinator, live, checkpointer)
    engine.workers.extend(workers)
    coordinator.round_writers.append(lambda result: engine.report_live(result.round))
    coordinator.summary_hooks.append(lambda: {"checkpoints": [{"round": r, "seconds": s}
                                                              for r, s in checkpointer.written]})
    try:
        if resume_run:
            resume(coordinator, checkpointer)
        _start_roles(engine, devices)
    except BaseException:
        engine.close()
        raise
    return engine


def _start_roles(engine: InProcessRun, devices: dict[str, str]) -> None:
    """Serve the server's endpoint, then build every edge and client process of the plan and
    register it with its parent, as a process run starts them; raises when an edge does not start."""
    cfg, run_dir, net, coordinator = engine.cfg, engine.run_dir, engine.network, engine.coordinator
    server_ep = coordinator.endpoint
    assert isinstance(server_ep, InMemoryEndpoint)   # made by `build`
    addresses = {"server": server_ep.serve(_no_calls, register_handler=coordinator.handle_register)}
    edge_threads: list[threading.Thread] = []
    errors: list[BaseException] = []
    planned_processes = plan_processes(cfg).processes[1:]   # the processes a process run starts
    count = len(engine.workers)   # started by `build`
    hosted = 0   # client processes so far, dealt to the workers in turn
    # the client processes served in this process take turns (InMemoryEndpoint.serve_lock); not
    # where clients call each other (a client's handler then waits for another client's)
    serve_lock = threading.RLock()
    peers_call = spec_for(cfg.topology.kind).peer_link == CLIENT_PEERS
    for planned in planned_processes:
        assert planned.parent is not None   # only the server has none
        ep_ledger, ep_counter = _ledger(run_dir, planned.node_id)
        ep: InMemoryEndpoint
        if planned.kind != "edge" and engine.workers:
            ep = WorkerEndpoint(net, planned.node_id, ep_ledger, engine.workers[hosted % count],
                                counter=ep_counter, chunk_bytes=cfg.transport.chunk_bytes)
            hosted += 1
        else:
            ep = InMemoryEndpoint(net, planned.node_id, ep_ledger, chunk_bytes=cfg.transport.chunk_bytes)
            if planned.kind != "edge" and not peers_call:
                ep.serve_lock = serve_lock
        ep.use_checksum(cfg.security.checksum)   # known here before the registration that tells a process run's child
        process: ClientProcess | EdgeProcess
        if planned.kind == "edge":
            process = EdgeProcess(ep, addresses[planned.parent], device=devices.get(planned.node_id, ""))
            edge_threads.append(_start_edge(process, errors))
            addresses[planned.node_id] = process.address
        elif isinstance(ep, WorkerEndpoint):
            process = WorkerClientProcess(ep, addresses[planned.parent], list(planned.clients),
                                          device=devices.get(planned.node_id, ""))
        else:
            process = ClientProcess(ep, addresses[planned.parent], list(planned.clients),
                                    device=devices.get(planned.node_id, ""))
            if cfg.algorithm.vectorized:   # a batch's train requests trained together (client/host.py)
                ep.before_batch = lambda requests, p=process: p.host.prepare_batch(requests) if p.host else None
        engine.roles.append(Role(planned, process, ep, ep_counter))
        if isinstance(process, ClientProcess):
            process.register()
    for thread in edge_threads:
        thread.join(EDGE_WAIT)
    if errors:
        raise RuntimeError(f"an edge did not start: {errors[0]}") from errors[0]
    served = {role.endpoint.node_id: role.endpoint.worker for role in engine.roles
              if isinstance(role.endpoint, WorkerEndpoint)}
    if served:   # a worker can end apart from the run: its client processes are then dead (workers.py)
        WorkerLiveness(server_ep, served, on_event=coordinator.liveness_event,
                       interval=cfg.security.heartbeat_interval, timeout=cfg.security.heartbeat_timeout).start()


@dataclass
class RunLog:
    """The run's log records (every role's, at run.log_level) into RUN_DIR/logs/inprocess.log,
    as a process run's go to one log per process; taken off the root logger afterwards."""

    path: Path
    level: str
    handler: logging.Handler | None = None
    before: int = logging.WARNING

    def __enter__(self) -> "RunLog":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(self.path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root = logging.getLogger()
        self.before = root.level
        root.setLevel(self.level.upper())
        root.addHandler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        if self.handler is not None:
            root.removeHandler(self.handler)
            self.handler.close()
        root.setLevel(self.before)


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Set-up objects out of the collector's view while the rounds run (common/util/procexit.py
    `freeze_heap`, as every role process does, with its young-generation threshold), given back
    afterwards: this process may be a user's (the Python API), whose objects must be collectable
    again on the collector's own schedule."""
    before = freeze_heap()
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
