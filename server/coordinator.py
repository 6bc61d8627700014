"""The server: owns the run (registration, the round loop, sampling, aggregation and the server
step, evaluation, the run directory).  What a round is belongs to the topology's driver
(server/driver.py: star and hierarchical in server/sampled.py, sequential in
server/sequential.py, chain and relay in server/chain.py); the Coordinator is the drivers'
`DriverContext`.  It sends only through its fabric (common/transport/fabric.py), so the same
code runs over gRPC, torch.distributed and, in unit tests, in memory.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from safetensors.torch import save_file

from fedhop.common.methods import Method
from fedhop.common.algorithms.base import COMPUTE_KEY, Payload, ServerState
from fedhop.common.algorithms.local import set_params
from fedhop.common.config import Config, config_to_toml, resolve_clients_per_round, resolve_min_results
from fedhop.common.ledger import Ledger
from fedhop.common.runstore import RunStore
from fedhop.common.rounds import RoundEngine
from fedhop.common.transport.base import CallFailed, Endpoint, RemoteError
from fedhop.common.transport.fabric import Fabric
from fedhop.common.liveness import live_pool
from fedhop.common.topology import edge_index
from fedhop.common.validation import ReplyLimiter, consistent_results, rejection_code
from fedhop.common.vclock import RoundClock
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.server.driver import ChildNode, RoundResult, RunFailed, TopologyDriver, client_node, make_driver
from fedhop.server.resilience import fault_summary, record_refusals

__all__ = ["Coordinator", "ChildNode", "RoundResult", "RunFailed", "client_node", "time_breakdown"]

log = logging.getLogger("fedhop.server")


def time_breakdown(wait: float, compute: float, arrivals: dict[int, float], dispatched: float,
                   results: dict[int, Payload]) -> dict[str, float]:
    """Split the server's wait for results (`wait` seconds) into the round-time breakdown that
    `fedhop report` plots: compute (the slowest local solver, `compute`), communication (the
    smallest round trip minus that client's own solver time: what moving the message and the
    reply costs when nothing queues) and waiting (the rest: stragglers, queueing behind other
    clients' transfers and processes).  Without per-client arrivals (hierarchical, torch) the
    rest of the wait is reported as communication and waiting is 0."""
    trips = [arrivals[c] - dispatched - float(p.scalars.get(COMPUTE_KEY, 0.0))
             for c, p in results.items() if c in arrivals]
    communication = max(min(trips), 0.0) if trips else max(wait - compute, 0.0)
    communication = min(communication, max(wait - compute, 0.0))
    return {"time_compute": compute, "time_communication": communication,
            "time_waiting": max(wait - compute - communication, 0.0)}


class Coordinator:
    def __init__(self, cfg: Config, run_dir: Path, endpoint: Endpoint, ledger: Ledger,
                 on_round: Callable[[RoundResult], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.endpoint = endpoint
        self.ledger = ledger
        # after every recorded round (the progress line, checkpoints: server/resilience.py)
        self.round_listeners: list[Callable[[RoundResult], None]] = [on_round] if on_round is not None else []
        self.run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
        endpoint.run_id = self.run_id
        # the round's rules without a transport (common/rounds.py): sampling, aggregation and the
        # server step, metrics; the same engine plays whole rounds in process for benchmarks
        self.engine = RoundEngine(cfg)
        self.task, self.algorithm, self.model = self.engine.task, self.engine.algorithm, self.engine.model
        self.state: ServerState = self.engine.state
        self.clock: RoundClock = self.engine.clock   # stragglers, device profiles, virtual clock (common/vclock.py)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.run_dir / "run.db")
        self.children: dict[str, ChildNode] = {}
        self.client_home: dict[int, ChildNode] = {}
        self._registered = threading.Condition()
        self.rounds_completed = 0
        self.failures_total = 0
        self.history: list[RoundResult] = []
        self.fabric = Fabric(endpoint, batch=cfg.transport.batch)
        self.config_toml = config_to_toml(cfg)
        self.driver: TopologyDriver | None = None   # the topology's rounds, made after registration (server/driver.py)
        self.ready_listeners: list[Callable[[], None]] = []   # after registration (resume: restore client states)
        self.restored_topology: dict | None = None          # resume: the driver's checkpoint state (e.g. the walk)
        self.summary_hooks: list[Callable[[], dict]] = [lambda: fault_summary(self.store)]  # summary.json sections
        self.limiter = ReplyLimiter(self.algorithm, self.task, 2 * cfg.run.round_timeout)   # replies' claims bounded

    # ------------------------------------------------------------------ registration
    def handle_register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        """Register handler: a child announces its node id, address and logical clients."""
        self.endpoint.record_control("register", req.node_id, "server", req.ByteSize(), "receiver", 0.0,
                                     req.msg_id, self.run_id)
        token = getattr(self.endpoint, "token", "")
        if token and req.token != token:
            reply = pb.RegisterReply(accepted=False, message="registration refused: wrong token")
            self._refused(req, reply.message)
        else:
            bad = [c.client_id for c in req.clients if c.client_id >= self.cfg.clients.count]
            if bad:
                reply = pb.RegisterReply(accepted=False, message=f"client ids {bad[:10]} out of range "
                                                                 f"(clients.count = {self.cfg.clients.count})")
                self._refused(req, reply.message)
            else:
                node = ChildNode(req.node_id, req.role, req.address, sorted(c.client_id for c in req.clients))
                with self._registered:
                    self.children[req.node_id] = node
                    for cid in node.clients:
                        self.client_home[cid] = node
                    self._registered.notify_all()
                self.store.add_event("registered", node=req.node_id, round=0,
                                     detail=f"{req.role} at {req.address} hosting {len(node.clients)} clients")
                reply = pb.RegisterReply(accepted=True, run_id=self.run_id, config_toml=self.config_toml)
        reply.node_id = "server"
        self.endpoint.record_control("register.reply", "server", req.node_id, reply.ByteSize(), "sender", 0.0,
                                     req.msg_id + ".reply", self.run_id)
        return reply

    def _refused(self, req: pb.RegisterRequest, message: str) -> None:
        """A refused registration's event; where a liveness monitor watches the endpoint it records
        every refusal itself, one event per node per interval (common/admission.py)."""
        if getattr(self.endpoint, "liveness", None) is None:
            self.store.add_event("register_refused", node=req.node_id, detail=message, round=0)

    def wait_for_clients(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        need = set(range(self.cfg.clients.count))
        with self._registered:
            while not need <= set(self.client_home):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(need - set(self.client_home))
                    raise RunFailed(f"registration timed out after {timeout:.0f}s: {len(missing)} logical "
                                    f"clients never registered (first: {missing[:10]})")
                self._registered.wait(min(left, 0.5))
            nodes = len({node.node_id for node in self.client_home.values()})
        # the launcher watches for this: a child that dies before it can only be a failed start
        self.store.add_event("registration_complete", node="server", round=0,
                             detail=f"{len(need)} logical clients in {nodes} processes")

    # ------------------------------------------------------------------ rounds
    def sample(self, round: int) -> list[int]:
        """The round's clients (RoundEngine.sample), none of them hosted by a node known dead."""
        def live_only(pool: list[int], size: int) -> list[int]:
            pool, dead = live_pool(pool, size, self.client_home, getattr(self.endpoint, "liveness", None))
            if dead:   # no dead node's client drawn in place of a live one (common/liveness.py)
                self.store.add_event("sampling_excluded", node="server", round=round,
                                     detail=f"{len(dead)} clients of dead nodes not sampled: {dead[:20]}")
            return pool
        return self.engine.sample(round, restrict=live_only)

    def client_message(self, message: Payload, round: int, cid: int) -> Payload:
        """Client `cid`'s message this round: the shared one or its own variant (Algorithm.client_message)."""
        return self.algorithm.client_message(self.state, message, round, cid)

    def run_round(self, round: int) -> RoundResult:
        return self.driver.run_round(round)

    def complete_round(self, round: int, sampled: list[int], results: dict[int, Payload], failures: dict[int, str],
                       message: Payload, started: float, dispatched: float, arrivals: dict[int, float],
                       per_client: bool = True) -> RoundResult:
        """The end of a round of sampled clients (any topology's driver): record the failures,
        settle the virtual clock, check min_results, aggregate, take the server step, evaluate
        and record the round.  `per_client`: `results` holds one reply per client (not edge
        partials), so the virtual clock can cut single clients."""
        results, inconsistent = consistent_results(results)
        failures.update(inconsistent)
        for cid, why in sorted(failures.items()):
            code = rejection_code(why)   # typed rejections (common/validation.py), the rest: lost or failed
            kind = "rejected_payload" if code else "client_failed"
            self.store.add_event(kind, node=client_node(cid), detail=f"{code}: {why}" if code else why, round=round)
            log.warning("round %d: client %d left out: %s", round, cid, why)
        non_finite = [cid for cid, why in failures.items() if rejection_code(why) == "NON_FINITE"]
        if non_finite and self.cfg.security.nan_policy == "fail":
            raise RunFailed(f"round {round}: NaN/Inf in the results of clients {sorted(non_finite)[:10]} and "
                            f"security.nan_policy = 'fail'")
        settled = self.clock.settle(round, message, results, self.ledger.records(),
                                    star=per_client)   # deadline / over-commit cuts
        for cid, why in sorted(settled.cut.items()):
            self.store.add_event("deadline_missed" if why.startswith("deadline") else "overcommit_dropped",
                                 node=client_node(cid), detail=why, round=round)
        self.clock.emulate(settled.sim_seconds, time.perf_counter() - dispatched)
        participants = sorted(set(sampled) - set(failures) - set(settled.cut))
        needed = max(resolve_min_results(self.cfg, len(sampled)), 1)
        if len(participants) < needed or not results:
            raise RunFailed(f"round {round}: only {len(participants)} of {len(sampled)} sampled clients returned a "
                            f"result; run.min_results requires {needed}")
        collected = time.perf_counter()
        aggregate = self.engine.finish_round(   # NaN/Inf: rolled back, the offender left out
            round, results, participants, lambda blamed, kept: self._left_out(round, blamed, kept, failures, per_client))
        aggregated = time.perf_counter()
        metrics = self.round_metrics(round, aggregate)
        compute = float(aggregate.scalars.get(COMPUTE_KEY, 0.0))
        metrics.update(time_breakdown(collected - dispatched, compute, arrivals, dispatched, results))
        metrics.update({"time_aggregation": aggregated - collected + (dispatched - started),
                        "time_evaluation": time.perf_counter() - aggregated})
        metrics.update(settled.metrics)
        result = RoundResult(round, sampled, participants, failures, metrics, time.perf_counter() - started,
                             settled.sim_seconds)
        self.record_round(result)
        return result

    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload:
        """One message for a group of clients (an edge's, a collective's): the largest of their
        variants (variants extend the shared message, Algorithm.client_message)."""
        variants = {id(m): m for m in (self.algorithm.client_message(self.state, message, round, c) for c in cids)}
        return max(variants.values(), key=lambda m: (len(m.tensors), len(m.scalars)), default=message)

    def _left_out(self, round: int, blamed: dict[int, str], participants: list[int], failures: dict[int, str],
                  per_client: bool) -> list[int]:
        """Results whose contribution made the aggregate or the model non-finite (common/validation.py
        `finite_step`): recorded as typed rejections, out of the round, or the run fails under
        security.nan_policy = "fail".  Without `per_client` the results are edges' partials."""
        def key_of(cid: int) -> int:
            return cid if per_client else edge_index(self.client_home[cid].node_id)

        for key, why in sorted(blamed.items()):
            node = client_node(key) if per_client else f"edge-{key}"
            self.store.add_event("rejected_payload", node=node, detail=why, round=round)
            log.warning("round %d: %s left out: %s", round, node, why)
        gone = [c for c in participants if key_of(c) in blamed]
        failures.update({c: blamed[c] if per_client else
                         f"NON_FINITE_AGGREGATE: the partial of edge-{key_of(c)} was left out" for c in gone})
        kept = [c for c in participants if c not in gone]
        if self.cfg.security.nan_policy == "fail" or not kept:
            raise RunFailed(f"round {round}: {next(iter(blamed.values()))} (security.nan_policy = "
                            f"'{self.cfg.security.nan_policy}', {len(kept)} results left)")
        return kept

    def round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        return self.engine.metrics(round, aggregate)

    def evaluate(self) -> dict[str, float]:
        return self.engine.evaluate()

    def record_round(self, result: RoundResult) -> None:
        self.rounds_completed = result.round
        self.failures_total += len(result.failures)
        self.history.append(result)
        self.store.insert_records(self.ledger.drain())
        self.store.add_round(result.round, participants=len(result.participants),
                             sampled=len(result.sampled), failures=len(result.failures),
                             metrics=result.metrics, wall_seconds=result.wall_seconds,
                             sim_seconds=result.sim_seconds,
                             clients_dropped=len(set(result.sampled) - set(result.participants)))
        log.info("round %d: %d/%d results, %s", result.round, len(result.participants), len(result.sampled),
                 ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()))
        for listener in self.round_listeners:
            listener(result)

    # ------------------------------------------------------------------ whole run
    def run(self, register_timeout: float = 120.0) -> dict:
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.config_toml)
        self.store.start_run(run_id=self.run_id, name=self.cfg.run.name, algorithm=self.cfg.algorithm.name,
                             topology=self.cfg.topology.kind, transport=self.cfg.transport.kind,
                             config_toml=self.config_toml)
        status, error = "completed", ""
        try:
            self.wait_for_clients(register_timeout)
            for listener in self.ready_listeners:
                listener()
            self.driver = make_driver(self)
            self.driver.start()
            for r in range(self.rounds_completed + 1, self.cfg.run.rounds + 1):  # rounds are 1-based
                self.run_round(r)
        except RunFailed as exc:
            status, error = "failed", str(exc)
            self.store.add_event("run_failed", node="server", detail=error, round=self.rounds_completed)
            log.error("run failed: %s", error)
        finally:
            self.shutdown_children()
        summary = self.finalize(status, error, time.perf_counter() - started)
        return summary

    def shutdown_children(self) -> None:
        if getattr(self.endpoint, "liveness", None) is not None:   # children told to stop are not "dead"
            self.endpoint.liveness.stop()
        for node in list(self.children.values()):
            try:
                self.fabric.call(node.address, node.node_id, Method.SHUTDOWN, Payload(), round=self.rounds_completed,
                                 timeout=5.0)
            except (CallFailed, RemoteError) as exc:
                self.store.add_event("shutdown_failed", node=node.node_id, detail=str(exc), round=self.rounds_completed)
        self.fabric.close()

    def merge_ledgers(self) -> None:
        """Insert every process's ledger file (run_dir/ledger/*.jsonl) into run.db (idempotent)."""
        self.store.insert_records(self.ledger.drain())
        self.store.merge_ledger_dir(self.run_dir / "ledger")
        record_refusals(self.store)   # calls a child refused: the caller may not use the method

    def finalize(self, status: str, error: str, wall_seconds: float) -> dict:
        self.merge_ledgers()
        final = self.evaluate() if self.rounds_completed else {}
        if "train_loss" not in final:
            set_params(self.model, self.state.params)
            final["train_loss"] = float(self.task.train_loss(self.model))
        save_file({k: v.contiguous() for k, v in self.state.params.items()}, str(self.run_dir / "model.safetensors"))
        for name, params in self.algorithm.outputs(self.state).items():
            save_file({k: v.contiguous() for k, v in params.items()}, str(self.run_dir / f"model-{name}.safetensors"))
        by_link = self.store.bytes_by_link()
        agreement = self.store.check_agreement()
        summary = {
            "status": status,
            "error": error,
            "run_id": self.run_id,
            "name": self.cfg.run.name,
            "algorithm": self.cfg.algorithm.name,
            "topology": self.cfg.topology.kind,
            "transport": self.cfg.transport.kind,
            "rounds_completed": self.rounds_completed,
            "rounds_planned": self.cfg.run.rounds,
            "final": final,
            "bytes": {"total": by_link.pop("total", None), "by_link": by_link},
            "ledger_agreement": {"ok": agreement.ok, "matched": agreement.matched,
                                 "sender_only": len(agreement.sender_only),
                                 "receiver_only": len(agreement.receiver_only),
                                 "mismatched": len(agreement.mismatched)},
            "failures": self.failures_total,
            "clients_dropped": self.store.clients_dropped(),   # sampled clients whose result did not count
            "wall_seconds": wall_seconds,
            "num_parameters": int(sum(t.numel() for t in self.state.params.values())),
            "num_clients": self.cfg.clients.count,
            "clients_per_round": resolve_clients_per_round(self.cfg),
        }
        if self.driver is not None:
            summary.update(self.driver.summary())
        for hook in self.summary_hooks:
            summary.update(hook())
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        self.store.finish_run(status)
        return summary
