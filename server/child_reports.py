"""What the server's children report besides results (docs/faults.md, "Refusals at edges" and
"Plug-ins"): a child that refuses the run's config, and the refusals an edge made.

- A client or edge process that registered and then refused the run's config (PLUGIN_NOT_ALLOWED:
  a plug-in it was not started with, common/util/plugins.py) sends a RegisterRequest with `refusal`
  set before it exits with status 2 (an edge passes its client's on).  The server records a
  `config_refused` event naming the process and the plug-in (its text one printable line, under
  the sender's own node id), and, while this server process has recorded no round (the set-up, of
  a new run or a resumed one), fails the run at once with that line as its reason: `fail_run`
  raises RunFailed in the main thread (SIGUSR1, as SIGTERM raises Stopped), wherever it waits, so
  neither the registration timeout nor a round's is waited out (and again before each round, should
  the signal's exception have been lost: `raise_pending`).  After a round a refusal is only
  recorded: the node leaves and the run goes on as it does when a process dies, so one participant
  cannot end a run under way by claiming to refuse it.
- An edge's heartbeats carry its aggregated refusals (edge/reports.py); each becomes an event of
  the same kind, its detail prefixed with the edge's node id.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from fedhop.common.transport.admission import EDGE_EVENT_KINDS, one_line
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.server.driver import RunFailed

log = logging.getLogger("fedhop.server")


class ChildReports:
    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.failure: str | None = None
        self.installed = False
        self._lock = threading.Lock()
        # whether this server process has recorded a round: a refusal after it fails nothing
        self.rounds_played = False
        coordinator.round_writers.append(self._round_recorded)
        coordinator.round_gates.append(self.raise_pending)

    def _round_recorded(self, result: Any) -> None:
        self.rounds_played = True

    # -- Register ------------------------------------------------------------------------------
    def register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        """The server's Register handler: a refusal here, every other registration the coordinator's."""
        if not req.refusal:
            return self.coordinator.handle_register(req)
        coord = self.coordinator
        coord.endpoint.record_control("register", req.node_id, "server", req.ByteSize(), "receiver", 0.0,
                                      req.msg_id, coord.run_id)
        if req.node_id not in coord.children:   # only a registered child may end the run this way
            reply = pb.RegisterReply(accepted=False, message=f"{req.node_id} is not a registered node of this run")
        else:
            reason = one_line(req.refusal, 2000)
            # the process that refused: the caller itself, or the client process an edge passes on
            # (the edge checked that it is one of its registered client processes: edge/runtime.py)
            relayed = coord.children[req.node_id].role == "edge" and reason.endswith(f"(via {req.node_id})")
            who = reason.split(":", 1)[0][:63] if relayed and ":" in reason else req.node_id
            if not relayed and not reason.startswith(f"{req.node_id}:"):   # its own words, under its own name
                reason = f"{req.node_id}: {reason}"
            coord.store.add_event("config_refused", node=who, round=coord.rounds_completed, detail=reason)
            if self.rounds_played:
                # not a set-up's refusal: the node leaves, and the run goes on as it does when a process dies
                log.warning("%s (after the run's first round here: recorded, the run goes on without it)", reason)
                reply = pb.RegisterReply(accepted=True, run_id=coord.run_id,
                                         message="refusal recorded; the run goes on without this node")
            else:
                log.error("%s", reason)
                self.fail_run(reason)
                reply = pb.RegisterReply(accepted=True, run_id=coord.run_id, message="refusal recorded; the run fails")
        reply.node_id = "server"
        coord.endpoint.record_control("register.reply", "server", req.node_id, reply.ByteSize(), "sender", 0.0,
                                      req.msg_id + ".reply", coord.run_id)
        return reply

    def fail_run(self, reason: str) -> None:
        """End the run as failed with `reason`, from any thread (module docstring)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        if threading.current_thread() is threading.main_thread():
            raise RunFailed(reason)
        if self.installed:   # without the handler, SIGUSR1 would end the process: record only
            main = threading.main_thread().ident
            assert main is not None   # the main thread is running
            signal.pthread_kill(main, signal.SIGUSR1)

    def raise_pending(self) -> None:
        """Raise the failure noted before the run's first round here whose SIGUSR1 exception was
        lost: a signal handler's exception raised while the main thread runs a callback from C code
        (a weakref callback inside an import) is printed and dropped, and the run would go on.  The
        coordinator calls this while it waits for registrations and before each round, as it
        calls `raise_if_stopped` for stops."""
        if self.failure is not None:   # set only by a refusal before this process's first round
            raise RunFailed(self.failure)

    def install(self) -> None:
        """In the main thread, before the run: SIGUSR1 raises the pending failure there, while the
        run's rounds are still to come (never during the run's own ending)."""
        coord = self.coordinator
        if threading.current_thread() is not threading.main_thread():   # signal handlers are the main thread's
            return

        def handler(signum: int, frame: object) -> None:
            if self.failure is not None and coord.rounds_completed < coord.cfg.run.rounds:
                raise RunFailed(self.failure)

        signal.signal(signal.SIGUSR1, handler)
        self.installed = True

    # -- Heartbeat -----------------------------------------------------------------------------
    def events(self, sender: str, events: list[pb.NodeEvent]) -> None:
        """An edge's refusals (edge/reports.py) as run.db events of their own kind.  Only an edge
        reports events, and only refusals (EDGE_EVENT_KINDS, events_dropped): a client process's,
        or another kind (a forged `node_dead` or `config_refused`), is not recorded; the node and
        detail are the edge's words, one printable line each, the detail prefixed with the edge."""
        coord = self.coordinator
        child = coord.children.get(sender)
        if child is None or child.role != "edge":
            return
        for e in events[:512]:
            if e.kind not in EDGE_EVENT_KINDS and e.kind != "events_dropped":
                continue
            coord.store.add_event(e.kind, node=one_line(e.node, 200) or sender, round=coord.rounds_completed,
                                  detail=f"at {sender}: {one_line(e.detail, 2000)}")
