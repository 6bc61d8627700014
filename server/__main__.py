"""`python -m fedhop.server --config CONFIG.toml --run-dir DIR [--listen HOST:PORT] [--port-file F] [--resume] [--insecure]`

Starts the server process of one run: it serves registrations and results, drives the rounds,
and writes the run directory (config.toml, run.db, summary.json, model.safetensors, checkpoints).
`--resume` continues the run in DIR from its newest checkpoint (server/resilience.py).
Security (common/security/auth.py): TLS when security.certs_dir is set (mutual TLS with
security.mtls); every call's node credential is checked; plaintext on a non-loopback address
needs --insecure (the same as security.insecure = true; or FEDHOP_INSECURE=1).
Exit status: 0 when the run completed, 1 when it failed, 2 on a bad config or a security refusal,
128 + N when signal N stopped it (SIGINT, SIGTERM), after it has recorded the run as "stopped"
(summary.json, run.db) and told its children to shut down.  A stop signal is noted from the
process's first line: one that arrives during set-up stops the run as soon as its records exist
(before any round); one after the last round's row is written leaves a "completed" run, exit 0
(server/coordinator.py `Coordinator.run`); one while the records are written waits for them; one
while the run's task and model are built (a model factory, a data set read) cuts the build and
records the run as stopped before its first round (server/setup_stop.py).
"""
from __future__ import annotations

if __name__ == "__main__":   # before the slow imports: a signal during them is noted, not a traceback
    from fedhop.common.util.procexit import stop_on_sigterm as _defer_stops
    _defer_stops(deferred=True)

import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fedhop.common.config import ConfigError, load_config  # noqa: E402
from fedhop.common.records.checkpoint import CheckpointError  # noqa: E402
from fedhop.common.security.addresses import insecure_from_env, plaintext_refusal  # noqa: E402
from fedhop.common.security.auth import NodeCredentials, SecurityError, announce_security  # noqa: E402
from fedhop.common.transport.admission import EventThrottle, RequestGate, peer_host, throttle_refusal_logs  # noqa: E402
from fedhop.common.transport.factory import make_endpoint  # noqa: E402
from fedhop.common.transport.livebytes import LinkCounter, ServerLive  # noqa: E402
from fedhop.common.transport.liveness import LivenessMonitor  # noqa: E402
from fedhop.common.transport.placement import process_device  # noqa: E402
from fedhop.common.transport.startup import announce, cannot_serve, publish_address, role_parser  # noqa: E402
from fedhop.common.util.procexit import Stopped, exit_now, freeze_heap, signals_restored, stop_on_sigterm  # noqa: E402
from fedhop.common.wire.ledger import Ledger  # noqa: E402
from fedhop.server.child_reports import ChildReports  # noqa: E402
from fedhop.server.coordinator import Coordinator  # noqa: E402
from fedhop.server.resilience import Checkpointer, resume  # noqa: E402
from fedhop.server.setup_stop import stopped_in_setup  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The server process (module docstring); a caller in the same process (a test) keeps its
    own SIGINT and SIGTERM handlers afterwards."""
    with signals_restored():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = role_parser("python -m fedhop.server", __doc__,   # --listen, --token, --device (common/transport/startup.py)
                     "where the server aggregates and steps: cpu, cuda, cuda:N or auto (default: the config's "
                     "run.device; env FEDHOP_DEVICE)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--port-file", default="", help="write the bound address here once serving")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--register-timeout", type=float, default=120.0)
    ap.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    ap.add_argument("--insecure", action="store_true", default=insecure_from_env(),
                    help="allow plaintext gRPC on a non-loopback --listen address: the same as "
                         "--set security.insecure=true (also FEDHOP_INSECURE=1)")
    args = ap.parse_args(argv)
    stop_on_sigterm(deferred=True)   # noted until the run's records exist (Coordinator.run arms them)
    started = time.monotonic()
    run_dir = Path(args.run_dir)
    announce("server", "server", run_dir.resolve().name)
    if args.insecure:   # recorded in the run's config.toml like the key it stands for
        args.overrides.append("security.insecure=true")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        logging.error("%s", exc)
        return 2
    if cfg.run.engine != "processes":   # every role inside `fedhop run` (deploy/launch/inprocess.py): no server process
        logging.error("config key 'run.engine' = '%s' runs every role inside one `fedhop run` process; a server "
                      "process needs run.engine = \"processes\"", cfg.run.engine)
        return 2
    logging.getLogger().setLevel(cfg.run.log_level.upper())
    torch.set_num_threads(cfg.run.torch_threads)
    sec = cfg.security
    insecure = sec.insecure
    refusal = plaintext_refusal([args.listen], insecure, tls=bool(sec.certs_dir), who="server")
    if refusal:
        logging.error("refusing to start: %s", refusal)
        return 2
    try:
        creds = NodeCredentials.from_options("server", sec.certs_dir, sec.mtls, env_secret=args.token)
    except SecurityError as exc:
        logging.error("%s", exc)
        return 2
    announce_security(creds, [args.listen])   # shared token, no credential, plaintext: one line each
    ledger = Ledger(run_dir / "ledger" / "server.jsonl", keep_drained=False)
    counter = LinkCounter("server")   # the live view of every link's bytes (common/transport/livebytes.py)
    ledger.observers.append(counter.observe)
    holder: dict = {}

    def record(kind: str, node: str, detail: str) -> None:
        coord = holder.get("coordinator")
        if coord is not None:
            coord.store.add_event(kind, node=node, round=coord.rounds_completed, detail=detail)

    throttle = EventThrottle(record)   # one auth_refused event per peer host per interval, with a count

    def refused(node: str, method: str, reason: str, peer: str) -> None:
        throttle("auth_refused", peer_host(peer), node or "?", f"{method} from {peer}: {reason}")

    try:
        endpoint = make_endpoint(cfg.transport.kind, "server", ledger, token="", chunk_bytes=cfg.transport.chunk_bytes,
                                 max_message_bytes=cfg.transport.max_message_bytes, workers=32,
                                 window_bytes=cfg.transport.window_bytes, credentials=creds, on_refused=refused)
    except ValueError as exc:   # a kind without a process endpoint (inmemory)
        logging.error("%s", exc)
        return 2
    endpoint.use_checksum(sec.checksum)
    endpoint.wire_compression = cfg.transport.wire_compression   # "none" unless grpc (transport config_problem)
    # the server serves no Exchange calls: refused on their header, before their data is read
    endpoint.request_gate = RequestGate(None, on_refused=lambda env, code, reason: throttle(
        "request_refused", env.src or "?", env.src or "?", f"{code}: {reason}"))
    endpoint.on_busy = lambda node, method, reason, peer: throttle(   # call_slots: a caller over its share
        "call_refused", node or peer_host(peer), node or "?", f"{method} from {peer}: {reason}")
    throttle_refusal_logs()                     # a flood of refused calls is a few log lines
    try:
        device = process_device(args.device, cfg.run.device, "run.device")
        logging.info("server computes on %s", device)
        coordinator = Coordinator(cfg, run_dir, endpoint, ledger, device=device)
    except (ValueError, FileNotFoundError) as exc:   # the task cannot be built: missing data, bad shapes; no such device
        logging.error("%s", exc)
        return 2
    except (KeyboardInterrupt, Stopped) as exc:   # a stop cut the build of the task and model (server/setup_stop.py)
        endpoint.stop()
        code, said = stopped_in_setup(cfg, run_dir, exc, args.resume, time.monotonic() - started)
        logging.warning("%s", said)
        return code
    holder["coordinator"] = coordinator
    reports = ChildReports(coordinator)   # config refusals and an edge's refusals (server/child_reports.py)
    reports.install()                     # before serving: a child's refusal of the config fails the run at once
    live = ServerLive(coordinator.store, counter)
    coordinator.round_writers.append(lambda result: live.flush(result.round))   # each round's live figure
    checkpointer = Checkpointer(coordinator)
    if args.resume:
        try:
            resume(coordinator, checkpointer)
        except CheckpointError as exc:
            logging.error("cannot resume: %s", exc)
            return 2
    monitor = LivenessMonitor(endpoint, sec.heartbeat_interval, sec.heartbeat_timeout,
                              on_event=coordinator.liveness_event)
    coordinator.summary_hooks.append(lambda: {"liveness": monitor.summary(),
                                              "checkpoints": [{"round": r, "seconds": s}
                                                              for r, s in checkpointer.written]})
    monitor.on_bytes = live.report
    monitor.on_events = reports.events
    freeze_heap()   # set-up done: the collector walks only what the run allocates (common/util/procexit.py)
    monitor.start()
    try:
        address = endpoint.serve(lambda req: _no_calls(), args.listen, register_handler=reports.register)
    except (OSError, RuntimeError) as exc:   # grpc: "Failed to bind to address ..."
        code = cannot_serve(args.listen, exc)
        monitor.stop()
        return code
    publish_address(args.port_file, address)
    logging.info("run %s: serving at %s", coordinator.run_id, address)
    def folded_refusals() -> dict:   # folded refusals land before the summary
        throttle.flush()
        return {}

    coordinator.summary_hooks.insert(0, folded_refusals)
    summary = coordinator.run(register_timeout=args.register_timeout)   # stops end registration and rounds only
    live.flush()   # the server's own records up to the last shutdown reply: the live view now equals the final table
    monitor.stop()
    endpoint.stop()
    coordinator.store.close()   # the last connection: SQLite checkpoints the WAL into run.db and removes it
    logging.info("run %s %s after %d rounds", coordinator.run_id, summary["status"], summary["rounds_completed"])
    if summary["status"] == "stopped":
        return coordinator.stop_status
    return 0 if summary["status"] == "completed" else 1


def _no_calls():
    from fedhop.common.transport.base import HandlerError
    raise HandlerError("UNKNOWN_METHOD", "the server accepts no Exchange calls in this topology")


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
