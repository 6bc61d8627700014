"""The server: owns the run (registration, round loop, sampling, server step, evaluation,
run directory).  Transport-agnostic: it talks to its children through an `Endpoint`, so the
same code runs over gRPC and, in unit tests, in memory.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import COMPUTE_KEY, Payload, ServerState
from fedhop.common.algorithms.local import get_params, set_params
from fedhop.common.codec import PayloadError
from fedhop.common.compress import decompress_upload
from fedhop.common.config import Config, config_to_toml, resolve_clients_per_round, resolve_min_results
from fedhop.common.ledger import Ledger
from fedhop.common.rng import numpy_stream
from fedhop.common.runstore import RunStore
from fedhop.common.tasks import build_task
from fedhop.common.topology import sampling_pool
from fedhop.common.transport.base import CallFailed, Endpoint, RemoteError
from fedhop.common.validation import consistent_results, rejection_code, validate_reply
from fedhop.server.resilience import fault_summary
from fedhop.common.vclock import RoundClock
from fedhop.common.wire import fedhop_pb2 as pb

log = logging.getLogger("fedhop.server")


@dataclass
class ChildNode:
    """A registered child process (client process or edge)."""

    node_id: str
    role: str
    address: str
    clients: list[int] = field(default_factory=list)


@dataclass
class RoundResult:
    round: int
    sampled: list[int]
    participants: list[int]
    failures: dict[int, str]
    metrics: dict[str, float]
    wall_seconds: float
    sim_seconds: float | None = None   # virtual-clock duration (common/vclock.py); None where not simulated


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


class RunFailed(RuntimeError):
    """The run cannot go on (too few results, registration timed out, ...)."""


def client_node(cid: int) -> str:
    return f"client-{cid}"


class Coordinator:
    def __init__(self, cfg: Config, run_dir: Path, endpoint: Endpoint, ledger: Ledger,
                 on_round: Callable[[RoundResult], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.endpoint = endpoint
        self.ledger = ledger
        self.on_round = on_round
        self.run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
        endpoint.run_id = self.run_id
        self.task = build_task(cfg)
        self.algorithm = build_algorithm(cfg)
        self.model = self.task.build_model()
        self.state: ServerState = self.algorithm.init_state(get_params(self.model))
        self.clock = RoundClock(cfg, self.task)  # stragglers, device profiles, virtual clock (common/vclock.py)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.run_dir / "run.db")
        self.children: dict[str, ChildNode] = {}
        self.client_home: dict[int, ChildNode] = {}
        self._registered = threading.Condition()
        self.rounds_completed = 0
        self.failures_total = 0
        self.history: list[RoundResult] = []
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="server-call")
        self.config_toml = config_to_toml(cfg)
        self.torch_rounds = None  # set up after registration when transport.kind = "torch"
        self._arrivals: dict[tuple[int, int], float] = {}   # (round, client id) -> when its reply arrived
        self.on_ready: Callable[[], None] | None = None   # after registration (resume: restore client states)
        self.restored_topology: dict | None = None          # resume: the walk of a sequential run (server/sequential.py)
        self.summary_hooks: list[Callable[[], dict]] = [lambda: fault_summary(self.store)]  # summary.json sections

    # ------------------------------------------------------------------ registration
    def handle_register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        """Register handler: a child announces its node id, address and logical clients."""
        self.endpoint.record_control("register", req.node_id, "server", req.ByteSize(), "receiver", 0.0,
                                     req.msg_id, self.run_id)
        token = getattr(self.endpoint, "token", "")
        if token and req.token != token:
            self.store.add_event("register_refused", node=req.node_id, detail="wrong token", round=0)
            reply = pb.RegisterReply(accepted=False, message="registration refused: wrong token")
        else:
            bad = [c.client_id for c in req.clients if c.client_id >= self.cfg.clients.count]
            if bad:
                reply = pb.RegisterReply(accepted=False, message=f"client ids {bad} out of range "
                                                                 f"(clients.count = {self.cfg.clients.count})")
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
        """Seeded sampling without replacement: stream ("sampling", round), over every client or,
        with topology.edges_per_round > 0, over the clients of the round's edges (at most all of them)."""
        pool = sampling_pool(self.cfg, round)
        size = min(len(pool), self.clock.sample_size(resolve_clients_per_round(self.cfg)))  # over-commitment: ceil(c * S)
        rng = numpy_stream(self.cfg.run.seed, "sampling", round)
        return sorted(pool[int(i)] for i in rng.choice(len(pool), size=size, replace=False))

    def _train_one(self, cid: int, round: int, prepared) -> Payload:
        node = self.client_home[cid]
        reply = self.endpoint.call(node.address, client_node(cid), "train", round=round,
                                   timeout=self.cfg.run.call_timeout, prepared=prepared)
        self._arrivals[(round, cid)] = time.perf_counter()   # the round-time breakdown's per-client round trip
        reply = decompress_upload(self.cfg, reply, self.algorithm.reply_spec(self.state))   # QSGD (common/compress.py)
        validate_reply(reply, self.algorithm.reply_spec(self.state), f"round {round} reply of client {cid}")
        return reply

    def run_round(self, round: int) -> RoundResult:
        if self.cfg.topology.kind in ("sequential", "chain"):   # driven rounds: server/sequential.py, server/chain.py
            return self.topology_driver().run_round(round)
        started = time.perf_counter()
        sampled = self.sample(round)
        self._arrivals = {}
        message = self.clock.begin_round(round, sampled, self.algorithm.broadcast(self.state, round))
        dispatched = time.perf_counter()
        if self.torch_rounds is not None:
            results, failures = self._dispatch_torch(round, sampled, message)
        elif self.cfg.topology.kind == "hierarchical":
            results, failures = self._dispatch_edges(round, sampled, message)
        else:
            results, failures = self._dispatch_clients(round, sampled, message)
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
                                    star=self.cfg.topology.kind == "star")   # deadline / over-commit cuts
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
        aggregate = self.algorithm.aggregate(sorted(results.items()))
        self.algorithm.server_update(self.state, aggregate, round)
        self.algorithm.note_participants(self.state, round, participants)
        aggregated = time.perf_counter()
        metrics = self._round_metrics(round, aggregate)
        compute = float(aggregate.scalars.get(COMPUTE_KEY, 0.0))
        arrivals = {c: t for (r, c), t in list(self._arrivals.items()) if r == round}
        metrics.update(time_breakdown(collected - dispatched, compute, arrivals, dispatched, results))
        metrics.update({"time_aggregation": aggregated - collected + (dispatched - started),
                        "time_evaluation": time.perf_counter() - aggregated})
        metrics.update(settled.metrics)
        result = RoundResult(round, sampled, participants, failures, metrics, time.perf_counter() - started,
                             settled.sim_seconds)
        self._record_round(result)
        return result

    def _dispatch_torch(self, round: int, sampled: list[int], message: Payload):
        """transport.kind = "torch": tensors as collectives (server/torch_rounds.py)."""
        from fedhop.server.torch_rounds import CollectiveFailed
        try:
            return self.torch_rounds.dispatch(round, sampled, self.group_message(message, round, sampled))
        except CollectiveFailed as exc:
            raise RunFailed(str(exc)) from None

    def _gather(self, calls: dict, timeout: float) -> tuple[dict, dict]:
        """Wait for submitted calls until `timeout`; split results from failures."""
        _, pending = wait(calls.values(), timeout=timeout)
        results, failures = {}, {}
        for key, fut in calls.items():
            if fut in pending:
                failures[key] = f"timeout: no result within run.round_timeout={self.cfg.run.round_timeout}s"
                continue
            try:
                results[key] = fut.result()
            except (CallFailed, RemoteError, PayloadError) as exc:
                failures[key] = str(exc)
        return results, failures

    def _dispatch_clients(self, round: int, sampled: list[int], message: Payload):
        """Star: the message to every sampled client, one reply each.  Each distinct message
        (the shared one, or a client's own variant: Algorithm.client_message) is encoded once."""
        prepared: dict[int, tuple[Payload, object]] = {}   # id(message) -> (message kept alive, frames)
        calls = {}
        for cid in sampled:
            own = self.algorithm.client_message(self.state, message, round, cid)
            if id(own) not in prepared:
                prepared[id(own)] = (own, self.endpoint.prepare(own))
            calls[cid] = self._pool.submit(self._train_one, cid, round, prepared[id(own)][1])
        return self._gather(calls, self.cfg.run.round_timeout)

    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload:
        """One message for a group of clients (an edge's, a collective's): the largest of their
        variants (variants extend the shared message, Algorithm.client_message)."""
        variants = {id(m): m for m in (self.algorithm.client_message(self.state, message, round, c) for c in cids)}
        return max(variants.values(), key=lambda m: (len(m.tensors), len(m.scalars)), default=message)

    def _dispatch_edges(self, round: int, sampled: list[int], message: Payload):
        """Hierarchical: one call per edge with sampled clients; each returns a partial aggregate."""
        by_edge: dict[str, list[int]] = {}
        for cid in sampled:
            by_edge.setdefault(self.client_home[cid].node_id, []).append(cid)
        calls = {}
        for node_id, cids in sorted(by_edge.items()):
            shared = self.group_message(message, round, cids)
            payload = Payload(tensors=shared.tensors,
                              scalars={**shared.scalars, "edge_clients": ",".join(map(str, cids))})
            calls[node_id] = self._pool.submit(self._edge_round, node_id, round, payload)
        partials, edge_failures = self._gather(calls, self.cfg.run.round_timeout * 2)
        failures: dict[int, str] = {}
        for node_id, why in edge_failures.items():
            self.store.add_event("edge_failed", node=node_id, detail=why, round=round)
            for cid in by_edge[node_id]:
                failures[cid] = f"edge {node_id} failed: {why}"
        results = {}
        for node_id, partial in partials.items():
            lost = json.loads(str(partial.scalars.pop("failures_json", "{}")))
            failures.update({int(c): f"at {node_id}: {why}" for c, why in lost.items()})
            results[self.edge_order(node_id)] = partial
        return results, failures

    def topology_driver(self):
        """The round driver of the sequential (Fed-CHS) and chain topologies, made on first use."""
        driver = getattr(self, "_topology_driver", None)
        if driver is None:
            from fedhop.server.sequential import make_driver
            driver = self._topology_driver = make_driver(self)
        return driver

    @staticmethod
    def edge_order(node_id: str) -> int:
        return int(node_id.split("-")[1])

    def _edge_round(self, node_id: str, round: int, payload: Payload) -> Payload:
        node = self.children[node_id]
        partial = self.endpoint.call(node.address, node_id, "edge_round", payload, round=round,
                                     timeout=self.cfg.run.round_timeout * 2)
        partial = decompress_upload(self.cfg, partial, self.algorithm.reply_spec(self.state))   # QSGD
        validate_reply(partial, self.algorithm.reply_spec(self.state), f"round {round} partial of {node_id}")
        return partial

    def _round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        metrics: dict[str, float] = {}
        weight = float(aggregate.scalars.get("weight", 0.0)) or 1.0
        if "train_loss" in aggregate.scalars:
            metrics["client_train_loss"] = float(aggregate.scalars["train_loss"]) / weight
        every = self.cfg.run.eval_every
        last = round == self.cfg.run.rounds
        if last or (every and round % every == 0):
            metrics.update(self.evaluate())
        return metrics

    def evaluate(self) -> dict[str, float]:
        """The model's metrics, and each of the algorithm's other outputs' as `NAME_METRIC`."""
        out = self._evaluate(self.state.params)
        for name, params in self.algorithm.outputs(self.state).items():
            out.update({f"{name}_{k}": v for k, v in self._evaluate(params).items()})
        set_params(self.model, self.state.params)
        return out

    def _evaluate(self, params: dict[str, torch.Tensor]) -> dict[str, float]:
        set_params(self.model, params)
        with torch.no_grad():
            return {k: float(v) for k, v in self.task.evaluate(self.model).items()}

    def _record_round(self, result: RoundResult) -> None:
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
        if self.on_round is not None:
            self.on_round(result)

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
            if self.on_ready is not None:
                self.on_ready()
            if self.cfg.transport.kind == "torch" and self.cfg.topology.kind in ("star", "hierarchical"):
                from fedhop.server.torch_rounds import TorchRounds   # sequential: server/sequential.py joins the world
                try:
                    self.torch_rounds = TorchRounds(self)
                except (RuntimeError, ValueError) as exc:
                    raise RunFailed(str(exc)) from None
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
        for node in list(self.children.values()):
            try:
                self.endpoint.call(node.address, node.node_id, "shutdown", Payload(), round=self.rounds_completed,
                                   timeout=5.0)
            except (CallFailed, RemoteError) as exc:
                self.store.add_event("shutdown_failed", node=node.node_id, detail=str(exc), round=self.rounds_completed)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def merge_ledgers(self) -> None:
        """Insert every process's ledger file (run_dir/ledger/*.jsonl) into run.db (idempotent)."""
        self.store.insert_records(self.ledger.drain())
        for path in sorted((self.run_dir / "ledger").glob("*.jsonl")):
            self.store.insert_records(Ledger.read_jsonl(path))

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
        for hook in self.summary_hooks:
            summary.update(hook())
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        self.store.finish_run(status)
        return summary
