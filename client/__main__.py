"""`python -m fedhop.client --parent HOST:PORT | --parent-file PATH --clients 0-9 [--node-id ID] [--listen HOST:PORT]`

Starts one client process hosting the given logical clients; it registers with its parent
(the server, or an edge), serves training calls and exits when the parent shuts it down (0),
when it gives up on a silent parent (3), or on SIGTERM / SIGINT (143 / 130, logged).
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, cast

from fedhop.client.runtime import ClientProcess
from fedhop.common.transport.admission import RequestGate, model_bytes, request_bounds, throttle_refusal_logs
from fedhop.common.transport.factory import PROCESS_TRANSPORT, make_endpoint
from fedhop.common.transport.startup import cannot_serve, child_parser, child_setup, heartbeats, serve_until_stopped
from fedhop.common.util.nodeids import client_node, client_proc_node
from fedhop.common.util.procexit import exit_now, freeze_heap
from fedhop.common.wire.methods import role_of

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.transport.grpc import GrpcEndpoint  # what make_endpoint builds for PROCESS_TRANSPORT


def parse_ids(text: str) -> list[int]:
    """'0-9', '1,3,5' or '0-4,10-12' -> sorted unique ids (argparse type: a bad spec is a usage error)."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"bad client id or range '{part}' (expected e.g. 0-9 or 1,3,5)")
        if hi and int(hi) < int(lo):
            raise argparse.ArgumentTypeError(f"bad range '{part}': its end is below its start")
        ids.update(range(int(lo), int(hi or lo) + 1))
    if not ids:
        raise argparse.ArgumentTypeError("no client ids given")
    return sorted(ids)


READY_WAIT = 120.0   # seconds a call may wait for this process to finish registering


def fair_share(endpoint: GrpcEndpoint, proc: ClientProcess) -> None:
    """Requests bounded by their method and checked against the caller before their data is read;
    the parent's calls unlimited, any other caller's few at once (common/transport/admission.py)."""
    def router():   # a call that arrives while the process registers waits for it, as its handler would
        proc._ready.wait(READY_WAIT)
        return proc.host.router if proc.host is not None else None

    known: list = []

    def bounds():
        if not known and proc.host is not None:   # the model is known once registered
            known.append(request_bounds(model_bytes(proc.host.model.state_dict()), len(proc.host.client_ids)))
        return known[0] if known else None

    endpoint.request_gate = RequestGate(router, bounds)
    # large train requests beyond the one in training and the next wait with their sender (client/host.py)
    endpoint.request_hold = lambda env, alive: proc.host.request_hold(env, alive) if proc.host is not None else None
    # [algorithm] vectorized: a batch's train requests trained together before they are answered
    endpoint.before_batch = lambda requests: proc.host.prepare_batch(requests) if proc.host is not None else None
    # until registered, whoever may become its parent (the server or an edge); then only its parent
    endpoint.call_slots.privileged = lambda node: (role_of(node) in ("server", "edge") if proc.host is None
                                                   else node == proc.host.parent)
    throttle_refusal_logs()


def main(argv: list[str] | None = None) -> int:
    ap = child_parser("python -m fedhop.client", __doc__, "server or edge",
                      "where this process trains: cpu, cuda, cuda:N or auto (default: the config's clients.device; "
                      "env FEDHOP_DEVICE)")
    ap.add_argument("--clients", required=True, type=parse_ids, help="logical client ids, e.g. 0-9 or 1,3,5")
    ap.add_argument("--node-id", default=client_proc_node(os.getpid()))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    args = ap.parse_args(argv)
    setup = child_setup(args, "client", args.clients, threads=args.threads)   # common/transport/startup.py
    if isinstance(setup, int):
        return setup
    creds = setup.creds
    creds.aliases.update(client_node(c) for c in args.clients)   # calls to a hosted client name it
    endpoint = cast("GrpcEndpoint", make_endpoint(PROCESS_TRANSPORT, args.node_id, setup.ledger, token="",   # what PROCESS_TRANSPORT builds
                                                  chunk_bytes=args.chunk_bytes, max_message_bytes=args.max_message_bytes,
                                                  window_bytes=args.window_bytes, credentials=creds))
    try:
        proc = ClientProcess(endpoint, args.parent, args.clients, bind=args.listen, device=args.device)
    except (OSError, RuntimeError) as exc:   # grpc: "Failed to bind to address ..."
        return cannot_serve(args.listen, exc)
    fair_share(endpoint, proc)
    logging.info("serving at %s, registering with %s", proc.address, args.parent)
    try:
        proc.register()
    except Exception as exc:
        logging.error("%s", exc, exc_info=not isinstance(exc, RuntimeError))   # a bug: with its traceback
        endpoint.stop()
        return 2
    freeze_heap()   # set-up done: the collector walks only what the run allocates (common/util/procexit.py)
    host = proc.host
    assert host is not None   # made by a successful registration
    beats, gave_up = heartbeats(endpoint, args.parent, host.cfg.security, proc.reregister, host.shutdown_event,
                                setup.counter.entries)
    host.before_shutdown.append(lambda: beats.stop(wait=True, final=True))
    code = serve_until_stopped(proc.wait, beats, gave_up, "leaving (the parent notices at its next call or heartbeat)",
                               on_stop=lambda: None, close=lambda: endpoint.stop(grace=0.5))
    if code == 0:
        logging.info("shut down by parent")
    return code


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
