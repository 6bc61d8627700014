"""The start-up the role processes share (`python -m fedhop.server | edge | client`).

Every role: the flags each takes (`role_parser`: --listen, --token, --device), its process title
and log line format (`announce`), the one line for an address it cannot serve on
(`cannot_serve`), and its bound address published whole for a waiting launcher or child
(`publish_address`, --port-file).

A child process (a client process or an edge) shares its whole life beside that
(`child_parser`, `child_setup`, `serve_until_stopped`): it registers with its parent (--parent,
or --parent-file written by the parent), loads only the plug-ins it was started with
(--allow-plugin), checks its device and credentials, counts its bytes in its ledger
(--ledger-dir) and live totals, and then serves until its parent shuts it down (0), it gives up
on a silent parent (3), or SIGTERM / SIGINT ends it (143 / 130, logged).  A bad flag, device,
credential or parent file is one logged line and exit status 2.  Each role keeps what differs:
its own flags, its process (a client process's logical clients, an edge's cluster and its
monitor) and what it does on a stop.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fedhop.common.security.addresses import listen_address
from fedhop.common.security.auth import NodeCredentials, SecurityError, add_security_args, credentials_from_args
from fedhop.common.transport.livebytes import LinkCounter
from fedhop.common.transport.liveness import HeartbeatSender, add_parent_args, resolve_parent
from fedhop.common.transport.placement import flag_error
from fedhop.common.util.cliparser import ArgumentParser
from fedhop.common.util.plugins import allow_list_from, restrict
from fedhop.common.util.procexit import Stopped, ignore_stops, stop_on_sigterm, stop_reason
from fedhop.common.util.proctitle import set_role_title
from fedhop.common.util.rolelog import line_format
from fedhop.common.wire.ledger import Ledger

SETUP_FAILED = 2   # a bad flag, device, credential or address: one line, as for a bad config
GAVE_UP = 3        # a child gave up on a silent parent


def role_parser(prog: str, description: str | None, device_help: str) -> argparse.ArgumentParser:
    """The parser with the flags every role takes: --listen, --token, --device."""
    ap = ArgumentParser(prog=prog, description=description)
    ap.add_argument("--listen", default="127.0.0.1:0", type=listen_address,
                    help="host:port to serve on (port 0 = any free)")
    ap.add_argument("--token", default=os.environ.get("FEDHOP_TOKEN", ""))
    ap.add_argument("--device", default=os.environ.get("FEDHOP_DEVICE", ""), help=device_help)
    return ap


def announce(role: str, node: str, name: str, clients: list[int] | None = None) -> None:
    """The process title (`ps` shows the role, `name` and the clients it hosts: common/util/proctitle.py)
    and the log line format, which names `node`."""
    set_role_title(role, name, clients)
    logging.basicConfig(level=logging.INFO, format=line_format(node))


def cannot_serve(listen: str, exc: BaseException) -> int:
    """An address that cannot be served on (grpc: "Failed to bind to address ..."): one line."""
    logging.error("cannot serve on --listen %s: %s", listen, str(exc).split(";")[0])
    return SETUP_FAILED


def publish_address(port_file: str, address: str) -> None:
    """Write the bound address to --port-file whole (a reader sees no file or the whole address)."""
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(port_file)


# ----------------------------------------------------------------------------- a child process
def child_parser(prog: str, description: str | None, parent: str, device_help: str) -> argparse.ArgumentParser:
    """The flags of a child process: the role's, its parent (`parent` names it in the help),
    its ledger folder, message and window sizes, its credentials and the plug-ins it may load."""
    ap = role_parser(prog, description, device_help)
    add_parent_args(ap, parent)
    ap.add_argument("--ledger-dir", default="", help="write this process's ledger records here (JSONL)")
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    ap.add_argument("--window-bytes", type=int, default=16 << 20,
                    help="every gRPC stream's window (transport.window_bytes)")
    add_security_args(ap)
    ap.add_argument("--allow-plugin", action="append", default=[], metavar="MODULE",
                    help="a plug-in module (or entry-point name) this process may load when its parent's config "
                         "names it; repeatable (also FEDHOP_ALLOW_PLUGINS=a,b); any other is refused, never imported")
    return ap


@dataclass
class ChildSetup:
    """What `child_setup` made: the credentials, the ledger and its live byte counter."""

    creds: NodeCredentials
    ledger: Ledger
    counter: LinkCounter


def child_setup(args: argparse.Namespace, role: str, clients: list[int] | None, threads: int) -> ChildSetup | int:
    """A child's set-up before its endpoint: the plug-ins it may load, its title and logging,
    its parent's address (into `args.parent`), torch's threads, its device, its credentials and
    its ledger.  An exit status (2, logged) where one of them is wrong."""
    restrict(allow_list_from(args.allow_plugin))   # run only the code this process was started with
    announce(role, args.node_id, args.node_id, clients)
    try:
        args.parent = resolve_parent(args)
    except (TimeoutError, ValueError) as exc:
        logging.error("%s", exc)
        return SETUP_FAILED
    torch.set_num_threads(threads)
    device_problem = flag_error(args.device)   # a device this machine lacks (common/transport/placement.py)
    if device_problem:
        logging.error("%s", device_problem)
        return SETUP_FAILED
    try:
        creds = credentials_from_args(args, [args.parent, args.listen])
    except SecurityError as exc:
        logging.error("%s", exc)
        return SETUP_FAILED
    # the records go to the file (merged by the server) and the live counter; none stay in memory
    ledger = Ledger(Path(args.ledger_dir) / f"{args.node_id}.jsonl" if args.ledger_dir else None, hold=False)
    counter = LinkCounter(args.node_id)   # live byte totals for the server (common/transport/livebytes.py)
    ledger.observers.append(counter.observe)
    return ChildSetup(creds, ledger, counter)


def heartbeats(endpoint, parent: str, security, reregister: Callable[[], object], shutdown: threading.Event,
               counts: Callable[[], list], events: Callable[[], list] | None = None
               ) -> tuple[HeartbeatSender, list[str]]:
    """The child's heartbeats to its parent, started (common/transport/liveness.py), and the list
    that holds why it gave up on a silent parent (then `shutdown` is set and the process ends, 3)."""
    gave_up: list[str] = []

    def give_up(why: str) -> None:
        gave_up.append(why)
        shutdown.set()

    beats = HeartbeatSender(endpoint, parent, interval=security.heartbeat_interval,
                            parent_timeout=security.parent_timeout, reregister=reregister, on_give_up=give_up,
                            counts=counts, events=events).start()
    return beats, gave_up


def serve_until_stopped(wait: Callable[[], None], beats: HeartbeatSender, gave_up: list[str], stopping: str,
                        on_stop: Callable[[], None], close: Callable[[], None]) -> int:
    """Serve until the process ends: `wait` returns when the parent shut it down (0) or it gave
    up on its parent (`gave_up` holds why: 3); SIGTERM or Ctrl-C (from here on) logs
    `stopping` with the signal, runs `on_stop` once the heartbeats stopped and leaves with the
    status a shell reports for the signal.  The heartbeats stop and then `close` (monitors, the
    endpoint) runs whichever way it ends."""
    stop_on_sigterm()   # SIGTERM or Ctrl-C: leave cleanly, with the status a shell reports for it
    try:
        wait()
    except (KeyboardInterrupt, Stopped) as exc:
        ignore_stops()
        reason, code = stop_reason(exc)
        logging.warning("%s: %s", reason, stopping)
        beats.stop()
        on_stop()
        close()
        return code
    beats.stop()
    close()
    if gave_up:
        logging.error("exiting: %s", gave_up[0])
        return GAVE_UP
    return 0
