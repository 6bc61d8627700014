"""`python -m fedhop.client --parent HOST:PORT | --parent-file PATH --clients 0-9 [--node-id ID] [--listen HOST:PORT]`

Starts one client process hosting the given logical clients; it registers with its parent
(the server, or an edge), serves training calls and exits when the parent shuts it down (0),
when it gives up on a silent parent (3), or on SIGTERM / SIGINT (143 / 130, logged).
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from fedhop.client.runtime import ClientProcess
from fedhop.common.security.addresses import listen_address
from fedhop.common.security.auth import SecurityError, add_security_args, credentials_from_args
from fedhop.common.transport.admission import RequestGate, model_bytes, request_bounds, throttle_refusal_logs
from fedhop.common.transport.factory import PROCESS_TRANSPORT, make_endpoint
from fedhop.common.transport.livebytes import LinkCounter
from fedhop.common.transport.liveness import HeartbeatSender, add_parent_args, resolve_parent
from fedhop.common.transport.placement import flag_error
from fedhop.common.util.nodeids import client_node, client_proc_node
from fedhop.common.util.plugins import allow_list_from, restrict
from fedhop.common.util.procexit import Stopped, exit_now, freeze_heap, ignore_stops, stop_on_sigterm, stop_reason
from fedhop.common.util.proctitle import set_role_title
from fedhop.common.wire.ledger import Ledger
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
    # until registered, whoever may become its parent (the server or an edge); then only its parent
    endpoint.call_slots.privileged = lambda node: (role_of(node) in ("server", "edge") if proc.host is None
                                                   else node == proc.host.parent)
    throttle_refusal_logs()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedhop.client", description=__doc__)
    add_parent_args(ap, "server or edge")
    ap.add_argument("--clients", required=True, type=parse_ids, help="logical client ids, e.g. 0-9 or 1,3,5")
    ap.add_argument("--node-id", default=client_proc_node(os.getpid()))
    ap.add_argument("--listen", default="127.0.0.1:0", type=listen_address,
                    help="host:port to serve on (port 0 = any free)")
    ap.add_argument("--ledger-dir", default="", help="write this process's ledger records here (JSONL)")
    ap.add_argument("--token", default=os.environ.get("FEDHOP_TOKEN", ""))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    ap.add_argument("--window-bytes", type=int, default=16 << 20, help="every gRPC stream's window (transport.window_bytes)")
    ap.add_argument("--device", default=os.environ.get("FEDHOP_DEVICE", ""),
                    help="where this process trains: cpu, cuda, cuda:N or auto (default: the config's clients.device; "
                         "env FEDHOP_DEVICE)")
    add_security_args(ap)
    ap.add_argument("--allow-plugin", action="append", default=[], metavar="MODULE",
                    help="a plug-in module (or entry-point name) this process may load when its parent's config "
                         "names it; repeatable (also FEDHOP_ALLOW_PLUGINS=a,b); any other is refused, never imported")
    args = ap.parse_args(argv)
    restrict(allow_list_from(args.allow_plugin))   # run only the code this process was started with
    set_role_title("client", args.node_id, args.clients)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node_id} %(levelname)s %(message)s")
    try:
        args.parent = resolve_parent(args)
    except (TimeoutError, ValueError) as exc:
        logging.error("%s", exc)
        return 2
    torch.set_num_threads(args.threads)
    device_problem = flag_error(args.device)   # a device this machine lacks (common/transport/placement.py)
    if device_problem:
        logging.error("%s", device_problem)
        return 2
    sink = Path(args.ledger_dir) / f"{args.node_id}.jsonl" if args.ledger_dir else None
    ledger = Ledger(sink)
    counter = LinkCounter(args.node_id)   # live byte totals for the server (common/transport/livebytes.py)
    ledger.observers.append(counter.observe)
    try:
        creds = credentials_from_args(args, [args.parent, args.listen])
    except SecurityError as exc:
        logging.error("%s", exc)
        return 2
    creds.aliases.update(client_node(c) for c in args.clients)   # calls to a hosted client name it
    endpoint = cast("GrpcEndpoint", make_endpoint(PROCESS_TRANSPORT, args.node_id, ledger, token="",   # what PROCESS_TRANSPORT builds
                                                  chunk_bytes=args.chunk_bytes, max_message_bytes=args.max_message_bytes,
                                                  window_bytes=args.window_bytes, credentials=creds))
    try:
        proc = ClientProcess(endpoint, args.parent, args.clients, bind=args.listen, device=args.device)
    except (OSError, RuntimeError) as exc:   # grpc: "Failed to bind to address ..."
        logging.error("cannot serve on --listen %s: %s", args.listen, str(exc).split(";")[0])
        return 2
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
    sec = host.cfg.security
    gave_up: list[str] = []

    def give_up(why: str) -> None:
        gave_up.append(why)
        host.shutdown_event.set()

    beats = HeartbeatSender(endpoint, args.parent, interval=sec.heartbeat_interval, parent_timeout=sec.parent_timeout,
                            reregister=proc.reregister, on_give_up=give_up, counts=counter.entries).start()
    host.before_shutdown.append(lambda: beats.stop(wait=True, final=True))
    stop_on_sigterm()   # SIGTERM or Ctrl-C: leave cleanly, with the status a shell reports for it
    try:
        proc.wait()
    except (KeyboardInterrupt, Stopped) as exc:
        ignore_stops()
        reason, code = stop_reason(exc)
        logging.warning("%s: leaving (the parent notices at its next call or heartbeat)", reason)
        beats.stop()
        endpoint.stop(grace=0.5)
        return code
    beats.stop()
    endpoint.stop(grace=0.5)
    if gave_up:
        logging.error("exiting: %s", gave_up[0])
        return 3
    logging.info("shut down by parent")
    return 0


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
