"""`python -m fedhop.edge --parent HOST:PORT | --parent-file PATH --node-id edge-N [--listen HOST:PORT]`

Starts one edge server: it registers with the server, accepts its cluster's client processes
(which register with it), aggregates their results each round and answers the server with
one partial aggregate.  Exits when the server shuts it down (0), when it gives up on a silent
server (3), or on SIGTERM / SIGINT (143 / 130: it shuts its client processes down first).
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from fedhop.common.security.addresses import listen_address
from fedhop.common.security.auth import SecurityError, add_security_args, credentials_from_args
from fedhop.common.transport.admission import RequestGate, model_bytes, request_bounds, throttle_refusal_logs
from fedhop.common.transport.factory import PROCESS_TRANSPORT, make_endpoint
from fedhop.common.transport.livebytes import LinkCounter, Reported
from fedhop.common.transport.liveness import HeartbeatSender, LivenessMonitor, add_parent_args, resolve_parent
from fedhop.common.transport.placement import flag_error
from fedhop.common.util.plugins import allow_list_from, restrict
from fedhop.common.util.procexit import Stopped, exit_now, freeze_heap, ignore_stops, stop_on_sigterm, stop_reason
from fedhop.common.util.proctitle import set_role_title
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.methods import role_of
from fedhop.edge.reports import EdgeRefusals, EventOutbox
from fedhop.edge.runtime import EdgeProcess

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.transport.grpc import GrpcEndpoint  # what make_endpoint builds for PROCESS_TRANSPORT

READY_WAIT = 120.0   # seconds a call may wait for this process to finish registering


def fair_share(endpoint: GrpcEndpoint, proc: EdgeProcess) -> None:
    """Requests bounded by their method and checked against the caller before their data is read;
    the server's calls unlimited, a neighbour's few at once (common/transport/admission.py)."""
    known: list = []

    def router():   # a call that arrives while the edge registers waits for it, as its handler would
        proc._ready.wait(READY_WAIT)
        return proc.aggregator.router if proc.aggregator is not None else None

    def bounds():
        agg = proc.aggregator
        if not known and agg is not None:   # the model is known once registered
            known.append(request_bounds(model_bytes(agg.model_state.params), len(agg.cluster)))
        return known[0] if known else None

    endpoint.request_gate = RequestGate(router, bounds)
    endpoint.call_slots.privileged = lambda node: (role_of(node) == "server" if proc.aggregator is None
                                                   else node == proc.aggregator.router.peers.parent)
    throttle_refusal_logs()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedhop.edge", description=__doc__)
    add_parent_args(ap, "server")
    ap.add_argument("--node-id", required=True, help="edge-<n>: n selects the cluster in the topology config")
    ap.add_argument("--listen", default="127.0.0.1:0", type=listen_address)
    ap.add_argument("--port-file", default="", help="write the bound address here once serving")
    ap.add_argument("--ledger-dir", default="")
    ap.add_argument("--token", default=os.environ.get("FEDHOP_TOKEN", ""))
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    ap.add_argument("--window-bytes", type=int, default=16 << 20, help="every gRPC stream's window (transport.window_bytes)")
    ap.add_argument("--device", default=os.environ.get("FEDHOP_DEVICE", ""),
                    help="where this edge aggregates and steps: cpu, cuda, cuda:N or auto (default: the config's "
                         "edges.device; env FEDHOP_DEVICE)")
    add_security_args(ap)
    ap.add_argument("--allow-plugin", action="append", default=[], metavar="MODULE",
                    help="a plug-in module (or entry-point name) this process may load when its parent's config "
                         "names it; repeatable (also FEDHOP_ALLOW_PLUGINS=a,b); any other is refused, never imported")
    args = ap.parse_args(argv)
    restrict(allow_list_from(args.allow_plugin))   # run only the code this process was started with
    set_role_title("edge", args.node_id)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node_id} %(levelname)s %(message)s")
    try:
        args.parent = resolve_parent(args)
    except (TimeoutError, ValueError) as exc:
        logging.error("%s", exc)
        return 2
    torch.set_num_threads(1)
    device_problem = flag_error(args.device)   # a device this machine lacks (common/transport/placement.py)
    if device_problem:
        logging.error("%s", device_problem)
        return 2
    sink = Path(args.ledger_dir) / f"{args.node_id}.jsonl" if args.ledger_dir else None
    try:
        creds = credentials_from_args(args, [args.parent, args.listen])
    except SecurityError as exc:
        logging.error("%s", exc)
        return 2
    ledger = Ledger(sink)
    counter = LinkCounter(args.node_id)   # live byte totals for the server (common/transport/livebytes.py)
    ledger.observers.append(counter.observe)
    refusals = EdgeRefusals(EventOutbox())   # run.db events at the server, carried by heartbeats (edge/reports.py)
    endpoint = cast("GrpcEndpoint", make_endpoint(PROCESS_TRANSPORT, args.node_id, ledger, token="",   # what PROCESS_TRANSPORT builds
                                                  max_message_bytes=args.max_message_bytes, window_bytes=args.window_bytes,
                                                  credentials=creds,
                                                  on_refused=refusals.auth_refused))
    endpoint.on_busy = refusals.call_refused

    def monitor_event(kind: str, node: str, detail: str) -> None:
        logging.warning("%s: %s", kind, detail)
        refusals.monitor_event(kind, node, detail)

    # watches this edge's client processes; intervals are set from the run's config once it arrives
    monitor = LivenessMonitor(endpoint, interval=1.0, timeout=5.0, on_event=monitor_event)
    relayed = Reported()   # the live totals this edge's children last sent, passed on with its own
    monitor.on_bytes = relayed.report
    try:
        proc = EdgeProcess(endpoint, args.parent, bind=args.listen, device=args.device)
    except (OSError, RuntimeError) as exc:   # grpc: "Failed to bind to address ..."
        logging.error("cannot serve on --listen %s: %s", args.listen, str(exc).split(";")[0])
        return 2
    fair_share(endpoint, proc)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(proc.address)
        tmp.replace(args.port_file)
    logging.info("serving at %s, registering with %s", proc.address, args.parent)
    try:
        proc.start()
    except Exception as exc:
        logging.error("%s", exc)
        endpoint.stop()
        return 2
    freeze_heap()   # set-up done: the collector walks only what the run allocates (common/util/procexit.py)
    aggregator = proc.aggregator
    assert aggregator is not None   # made by a successful start
    sec = aggregator.cfg.security
    endpoint.checksum = sec.checksum
    monitor.interval, monitor.timeout = sec.heartbeat_interval, sec.heartbeat_timeout
    monitor.start()
    gave_up: list[str] = []

    def give_up(why: str) -> None:
        gave_up.append(why)
        aggregator.shutdown_event.set()

    beats = HeartbeatSender(endpoint, args.parent, interval=sec.heartbeat_interval, parent_timeout=sec.parent_timeout,
                            reregister=lambda: proc.register_with_parent(aggregator.cluster, timeout=10.0),
                            on_give_up=give_up, counts=lambda: counter.entries() + relayed.entries(),
                            events=refusals.outbox.take).start()
    def last_words() -> None:   # before the reply to the server's shutdown
        refusals.flush()
        beats.stop(wait=True, final=True)

    aggregator.before_shutdown.append(last_words)
    stop_on_sigterm()   # SIGTERM or Ctrl-C: shut the cluster's client processes down, then leave
    try:
        proc.wait()
    except (KeyboardInterrupt, Stopped) as exc:
        ignore_stops()
        reason, code = stop_reason(exc)
        logging.warning("%s: shutting down the cluster's client processes and leaving", reason)
        beats.stop()
        aggregator.shutdown_clients(round=0)
        monitor.stop()
        endpoint.stop(grace=0.5)
        return code
    beats.stop()
    monitor.stop()
    endpoint.stop(grace=0.5)
    if gave_up:
        logging.error("exiting: %s", gave_up[0])
        return 3
    return 0


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
