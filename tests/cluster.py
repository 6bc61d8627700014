"""An in-process cluster over real gRPC sockets on loopback, for fault and hostile-input tests.

The server (Coordinator + LivenessMonitor + Checkpointer, as `python -m fedhop.server` wires them) and
honest client processes (ClientProcess) run as threads of the test process; their endpoints are
real `GrpcEndpoint`s, so every byte goes through sockets, the codec and the interceptors.  A test
can put a proxy in front of a client (its advertised address) or add a hostile client.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from fedhop.client.runtime import ClientProcess
from fedhop.common.config import Config
from fedhop.common.records.runstore import RunStore
from fedhop.common.security.auth import NodeCredentials
from fedhop.common.transport.base import HandlerError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.transport.liveness import HeartbeatSender, LivenessMonitor
from fedhop.common.wire.ledger import Ledger
from fedhop.server.coordinator import Coordinator
from fedhop.server.resilience import Checkpointer


def _no_calls(_req):
    raise HandlerError("UNKNOWN_METHOD", "the server accepts no Exchange calls")


class Cluster:
    def __init__(self, cfg: Config, run_dir: Path, creds: Callable[[str], NodeCredentials | None] = lambda n: None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.creds = creds
        self.ledger = Ledger(self.run_dir / "ledger" / "server.jsonl", keep_drained=False)
        self.refused: list[tuple[str, str, str]] = []
        self.endpoint = GrpcEndpoint("server", self.ledger, chunk_bytes=cfg.transport.chunk_bytes,
                                     credentials=creds("server"), on_refused=self._refused)
        self.endpoint.use_checksum(cfg.security.checksum)
        self.coord = Coordinator(cfg, self.run_dir, self.endpoint, self.ledger)
        self.checkpointer = Checkpointer(self.coord)
        sec = cfg.security
        self.monitor = LivenessMonitor(self.endpoint, sec.heartbeat_interval, sec.heartbeat_timeout,
                                       on_event=lambda k, n, d: self.coord.store.add_event(
                                           k, node=n, detail=d, round=self.coord.rounds_completed + 1))
        self.coord.summary_hooks.append(lambda: {"liveness": self.monitor.summary()})
        self.monitor.start()
        self.address = self.endpoint.serve(_no_calls, "127.0.0.1:0", register_handler=self.coord.handle_register)
        self.clients: list[ClientProcess] = []
        self.senders: list[HeartbeatSender] = []
        self.summary: dict | None = None
        self._thread: threading.Thread | None = None

    def _refused(self, node: str, method: str, reason: str, peer: str) -> None:
        self.refused.append((node, method, reason))
        self.coord.store.add_event("auth_refused", node=node or "?", detail=f"{method} from {peer}: {reason}", round=0)

    def add_client(self, node_id: str, ids: list[int], advertise: Callable[[str], str] | None = None,
                   heartbeats: bool = True) -> ClientProcess:
        ep = GrpcEndpoint(node_id, Ledger(self.run_dir / "ledger" / f"{node_id}.jsonl"),
                          chunk_bytes=self.cfg.transport.chunk_bytes, credentials=self.creds(node_id))
        proc = ClientProcess(ep, self.address, ids)
        if advertise is not None:   # e.g. a proxy in front of this client: the server calls the proxy
            proc.address = advertise(proc.address)
        proc.register(deadline_s=20.0)
        if heartbeats:
            sec = self.cfg.security
            self.senders.append(HeartbeatSender(ep, self.address, interval=sec.heartbeat_interval,
                                                parent_timeout=sec.parent_timeout, reregister=proc.reregister,
                                                on_give_up=lambda why: None).start())
        self.clients.append(proc)
        return proc

    def run(self, timeout: float = 120.0) -> dict:
        out: dict = {}
        self._thread = threading.Thread(target=lambda: out.update(self.coord.run(register_timeout=30.0)), daemon=True)
        self._thread.start()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the run did not finish"
        self.summary = out
        return out

    def close(self) -> None:
        for s in self.senders:
            s.stop()
        self.monitor.stop()
        for proc in self.clients:
            proc.endpoint.stop(grace=0.1)
            proc.endpoint.ledger.close()
        self.endpoint.stop(grace=0.1)

    def store(self) -> RunStore:
        return RunStore(self.run_dir / "run.db")


def failed_clients_by_round(store: RunStore) -> dict[int, set[int]]:
    """{round: client ids whose result was not used} from run.db's events."""
    out: dict[int, set[int]] = {}
    for e in store.events():
        if e["kind"] in ("client_failed", "rejected_payload", "deadline_missed", "overcommit_dropped") \
                and e["node"].startswith("client-"):
            out.setdefault(int(e["round"]), set()).add(int(e["node"].split("-")[1]))
    return out


def fedavg_reference(centers, curvatures, sizes, rounds: int, local_steps: int, lr: float,
                     left_out: dict[int, set[int]]) -> np.ndarray:
    """FedAvg on the separable quadratics in float64, leaving out the given clients per round."""
    from tests.helpers import numpy_fedavg_round
    w = np.zeros(np.asarray(centers).shape[1])
    for r in range(1, rounds + 1):
        part = [i for i in range(len(sizes)) if i not in left_out.get(r, set())]
        w = numpy_fedavg_round(w, np.asarray(centers), np.asarray(curvatures), sizes, part, local_steps, lr, 1.0)
    return w
