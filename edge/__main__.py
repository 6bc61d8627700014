"""`python -m fedhop.edge --parent HOST:PORT | --parent-file PATH --node-id edge-N [--listen HOST:PORT]`

Starts one edge server: it registers with the server, accepts its cluster's client processes
(which register with it), aggregates their results each round and answers the server with
one partial aggregate.  Exits when the server shuts it down (0), when it gives up on a silent
server (3), or on SIGTERM / SIGINT (143 / 130: it shuts its client processes down first).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from fedhop.common.transport.admission import RequestGate, model_bytes, request_bounds, throttle_refusal_logs
from fedhop.common.transport.factory import PROCESS_TRANSPORT, make_endpoint
from fedhop.common.transport.livebytes import Reported
from fedhop.common.transport.liveness import LivenessMonitor
from fedhop.common.transport.startup import (
    cannot_serve,
    child_parser,
    child_setup,
    heartbeats,
    publish_address,
    serve_until_stopped,
)
from fedhop.common.util.procexit import exit_now, freeze_heap
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
    ap = child_parser("python -m fedhop.edge", __doc__, "server",
                      "where this edge aggregates and steps: cpu, cuda, cuda:N or auto (default: the config's "
                      "edges.device; env FEDHOP_DEVICE)")
    ap.add_argument("--node-id", required=True, help="edge-<n>: n selects the cluster in the topology config")
    ap.add_argument("--port-file", default="", help="write the bound address here once serving")
    args = ap.parse_args(argv)
    setup = child_setup(args, "edge", None, threads=1)   # common/transport/startup.py
    if isinstance(setup, int):
        return setup
    refusals = EdgeRefusals(EventOutbox())   # run.db events at the server, carried by heartbeats (edge/reports.py)
    endpoint = cast("GrpcEndpoint", make_endpoint(PROCESS_TRANSPORT, args.node_id, setup.ledger, token="",   # what PROCESS_TRANSPORT builds
                                                  max_message_bytes=args.max_message_bytes, window_bytes=args.window_bytes,
                                                  credentials=setup.creds,
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
        return cannot_serve(args.listen, exc)
    fair_share(endpoint, proc)
    publish_address(args.port_file, proc.address)
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
    monitor.interval, monitor.timeout = sec.heartbeat_interval, sec.heartbeat_timeout
    monitor.start()
    beats, gave_up = heartbeats(endpoint, args.parent, sec,
                                lambda: proc.register_with_parent(aggregator.cluster, timeout=10.0),
                                aggregator.shutdown_event, lambda: setup.counter.entries() + relayed.entries(),
                                events=refusals.outbox.take)

    def last_words() -> None:   # before the reply to the server's shutdown
        refusals.flush()
        beats.stop(wait=True, final=True)

    def close() -> None:
        monitor.stop()
        endpoint.stop(grace=0.5)

    aggregator.before_shutdown.append(last_words)
    # SIGTERM or Ctrl-C: shut the cluster's client processes down, then leave
    return serve_until_stopped(proc.wait, beats, gave_up, "shutting down the cluster's client processes and leaving",
                               on_stop=lambda: aggregator.shutdown_clients(round=0), close=close)


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
