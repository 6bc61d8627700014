"""The server: owns the run (registration, the round loop, sampling, aggregation and the server
step, evaluation, the run directory).  What a round is belongs to the topology's driver
(server/driver.py; each topology's own in its folder, topologies/<kind>/driver.py, the sampled
rounds of star and hierarchical on server/sampled.py); the Coordinator builds the drivers'
`DriverContext` over itself (server/context.py) and is the engine of the sampled rounds
(`SampledRounds`, server/sampled.py: `streams`, `note_failures`, `is_short`, `short_round`,
`complete_round`).  It sends only through its fabric (common/transport/fabric.py), so the same
code runs over gRPC, torch.distributed and, in unit tests, in memory.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from safetensors.torch import save_file

from fedhop.common.algorithms.base import ServerState
from fedhop.common.algorithms.local import bind_params, whole_params
from fedhop.common.config import Config, config_to_toml, resolve_clients_per_round, resolve_min_results
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.engine.vclock import RoundClock
from fedhop.common.processors.pipeline import FinitenessPolicy, configure
from fedhop.common.processors.streaming import RoundMemory
from fedhop.common.processors.validation import ReplyLimiter, consistent_results, rejection_code
from fedhop.common.records.runstore import RunStore
from fedhop.common.tasks import build_task
from fedhop.common.tasks.base import Task
from fedhop.common.tasks.placed import place_task
from fedhop.common.transport.base import Endpoint
from fedhop.common.transport.fabric import Fabric, Send
from fedhop.common.transport.liveness import live_pool, unreachable
from fedhop.common.util.nodeids import client_node, edge_index, edge_node
from fedhop.common.util.procexit import (
    Stopped,
    ignore_stops,
    raise_if_stopped,
    stop_noted,
    stop_reason,
    stops_at_waits,
    stops_deferred,
    stops_raised,
)
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import COMPUTE_KEY, Payload
from fedhop.common.wire.methods import Method
from fedhop.server.context import CoordinatorContext
from fedhop.server.driver import ChildNode, RoundResult, RunFailed, TopologyDriver, make_driver
from fedhop.server.resilience import fault_summary, record_refusals

__all__ = ["Coordinator", "ChildNode", "RoundResult", "RunFailed", "client_node", "time_breakdown"]

log = logging.getLogger("fedhop.server")

SHORT_ROUND_RETRIES = 3      # run.on_short_round = "retry": attempts after the first, then the round is skipped
MAX_SKIPPED_IN_A_ROW = 10    # retry and skip: this many skipped rounds in a row fail the run
SHUTDOWN_TIMEOUT = 5.0       # seconds a child may take to answer its shut-down
HISTORY_ROUNDS = 64          # results of the latest rounds kept in memory (`Coordinator.history`)


def id_list(ids: list[int], shown: int = 10) -> str:
    """'[1, 8, 18]', or the first `shown` and the count: '[0, 1, 2, ...] (37 in all)' (shown = 3)."""
    if len(ids) <= shown:
        return str(list(ids))
    return f"[{', '.join(map(str, ids[:shown]))}, ...] ({len(ids)} in all)"


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
                 on_round: Callable[[RoundResult], None] | None = None, device: torch.device | None = None,
                 task: Task | None = None) -> None:
        """`task`: the run's task already built from `cfg` (the in-process engine builds it before it
        forks its workers, which share it: deploy/launch/workers.py `SharedTask`); None builds it."""
        self.cfg = cfg
        configure(cfg, "server")   # the config's [[processors]] for the server, before any chain is built
        # where the server's state, aggregation, step and evaluation live (run.device, resolved by
        # server/__main__.py); received tensors are placed there by the endpoint
        self.device = device if device is not None else torch.device("cpu")
        if self.device.type != "cpu":
            endpoint.device = self.device
        self.run_dir = Path(run_dir)
        self.endpoint = endpoint
        self.ledger = ledger
        # whether records drained from the ledger failed to reach run.db (`store_ledger`)
        self._drain_lost = False
        # after every recorded round (the progress line, checkpoints: server/resilience.py)
        self.round_listeners: list[Callable[[RoundResult], None]] = [on_round] if on_round is not None else []
        # run.db writes that belong to a round's own transaction (the live totals: server/__main__.py)
        self.round_writers: list[Callable[[RoundResult], None]] = []
        self.run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
        endpoint.run_id = self.run_id
        # the round's rules without a transport (common/engine/rounds.py): sampling, aggregation and the
        # server step, metrics; the same engine plays whole rounds in process for benchmarks
        with stops_raised():   # nothing is recorded yet: a stop ends the build (a model factory) at once
            self.engine = RoundEngine(cfg, task=place_task(task if task is not None else build_task(cfg), self.device))
        self.task, self.algorithm, self.model = self.engine.task, self.engine.algorithm, self.engine.model
        self.state: ServerState = self.engine.state
        self.clock: RoundClock = self.engine.clock   # stragglers, device profiles, virtual clock (common/engine/vclock.py)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.run_dir / "run.db")
        self.children: dict[str, ChildNode] = {}
        self.client_home: dict[int, ChildNode] = {}
        self.homed: Counter[str] = Counter()   # node id -> how many clients it is the home of (`live_count`)
        self._registered = threading.Condition()
        self.rounds_completed = 0
        self.stop_status = 0   # with a "stopped" run: the exit status a shell reports for the signal (128 + N)
        self.failures_total = 0
        # the latest rounds' results (run.db's rounds table holds every round): a round of S sampled
        # clients is about 50 S bytes, which a list of every round would hold for the whole run
        self.history: deque[RoundResult] = deque(maxlen=HISTORY_ROUNDS)
        self.fabric = Fabric(endpoint, batch=cfg.transport.batch)
        self.config_toml = config_to_toml(cfg)
        self.driver: TopologyDriver | None = None   # the topology's rounds, made after registration (server/driver.py)
        self.context = CoordinatorContext(self)      # what the driver sees of the run (server/driver.py DriverContext)
        self.ready_listeners: list[Callable[[], None]] = []   # after registration (resume: restore client states)
        # while waiting for registrations and before each round: raise RunFailed for a failure noted
        # from another thread whose signal's exception was lost (server/child_reports.py)
        self.round_gates: list[Callable[[], None]] = []
        self.restored_topology: dict | None = None          # resume: the driver's checkpoint state (e.g. the walk)
        self.summary_hooks: list[Callable[[], dict]] = [lambda: fault_summary(self.store)]  # summary.json sections
        self.limiter = ReplyLimiter(self.algorithm, self.task, 2 * cfg.run.round_timeout)   # replies' claims bounded
        # clients an edge reported dead (their processes failed or stopped beating), by edge node id
        self.unavailable: dict[str, set[int]] = {}
        self.skipped_in_a_row = 0
        # resident memory over the rounds (summary.json server_memory: what streaming aggregation bounds)
        self.memory = RoundMemory()
        self.ready_listeners.append(self.memory.begin)
        self.round_listeners.append(self.memory.note)
        self.summary_hooks.append(self.memory.summary)
        if self.engine.privacy is not None:   # summary.json's privacy section (common/privacy/mechanism.py)
            privacy = self.engine.privacy
            self.summary_hooks.append(lambda: {"privacy": privacy.summary()})

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
            ids = [c.client_id for c in req.clients]
            bad = [c for c in ids if c >= self.cfg.clients.count]
            if bad:
                reply = pb.RegisterReply(accepted=False, message=f"client ids {bad[:10]} out of range "
                                                                 f"(clients.count = {self.cfg.clients.count})")
                self._refused(req, reply.message)
            else:
                node = ChildNode(req.node_id, req.role, req.address, sorted(ids))
                # an edge registers twice: first with no clients (to fetch the config), then with its
                # cluster once that cluster's processes have registered with it (from the same address:
                # a restarted edge has a new one); one event, the second
                known = self.children.get(req.node_id)
                config_fetch = req.role == "edge" and not node.clients and (known is None or known.address != req.address)
                with self._registered:
                    self.children[req.node_id] = node
                    for cid in node.clients:
                        old = self.client_home.get(cid)
                        if old is not None:
                            self.homed[old.node_id] -= 1
                        self.client_home[cid] = node
                    self.homed[node.node_id] += len(node.clients)
                    self._registered.notify_all()
                if not config_fetch:
                    self.store.add_event("registered", node=req.node_id, round=0,
                                         detail=f"{req.role} at {req.address} hosting {len(node.clients)} clients")
                reply = pb.RegisterReply(accepted=True, run_id=self.run_id, config_toml=self.config_toml)
        reply.node_id = "server"
        self.endpoint.record_control("register.reply", "server", req.node_id, reply.ByteSize(), "sender", 0.0,
                                     req.msg_id + ".reply", self.run_id)
        return reply

    def liveness_event(self, kind: str, node: str, detail: str) -> None:
        """A liveness monitor's event (`LivenessMonitor.on_event`: a node dead, a refusal), under
        the round being played."""
        self.store.add_event(kind, node=node, detail=detail, round=self.rounds_completed + 1)

    def _refused(self, req: pb.RegisterRequest, message: str) -> None:
        """A refused registration's event; where a liveness monitor watches the endpoint it records
        every refusal itself, one event per node per interval (common/transport/admission.py)."""
        if getattr(self.endpoint, "liveness", None) is None:
            self.store.add_event("register_refused", node=req.node_id, detail=message, round=0)

    def wait_for_clients(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        need = self.cfg.clients.count
        with self._registered:
            # the ids are checked below clients.count (`handle_register`, uint32 on the wire): every
            # client has a home when there are as many homes as clients, one look per wake-up
            while len(self.client_home) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [c for c in range(need) if c not in self.client_home]
                    raise RunFailed(f"registration timed out after {timeout:.0f}s: {len(missing)} logical "
                                    f"clients never registered (first: {missing[:10]})")
                self._registered.wait(min(left, 0.5))
                raise_if_stopped()   # a stop whose exception the wait lost
                for gate in self.round_gates:   # a child's refusal whose exception was lost
                    gate()
            nodes = len({node.node_id for node in self.client_home.values()})
        # the launcher watches for this: a child that dies before it can only be a failed start
        self.store.add_event("registration_complete", node="server", round=0,
                             detail=f"{need} logical clients in {nodes} processes")

    # ------------------------------------------------------------------ rounds
    def sample(self, round: int, attempt: int = 0) -> list[int]:
        """The round's clients (RoundEngine.sample), none of them hosted by a node known dead or
        suspect, nor reported dead by its edge; `attempt` > 0: a retry of a short round."""
        def live_only(pool: Sequence[int], size: int) -> Sequence[int]:
            pool, dead = live_pool(pool, size, self.client_home, getattr(self.endpoint, "liveness", None),
                                   self.reported_dead(), self.hosts, self.homed)
            if dead:   # no dead node's client drawn in place of a live one (common/transport/liveness.py)
                self.store.add_event("sampling_excluded", node="server", round=round,
                                     detail=f"{len(dead)} clients of dead nodes not sampled: {dead[:20]}"
                                            + (f" (attempt {attempt})" if attempt else ""))
            return pool
        return self.engine.sample(round, restrict=live_only, attempt=attempt)

    @property
    def hosts(self) -> dict[str, list[int]]:
        """Node id -> the clients it registered (`live_pool` finds a dead node's clients there)."""
        return {node_id: node.clients for node_id, node in self.children.items()}

    def reported_dead(self) -> set[int]:
        """Clients whose process an edge reported dead in its last reply (only that edge's own)."""
        out: set[int] = set()
        for node_id, cids in self.unavailable.items():
            out.update(c for c in cids if c in self.client_home and self.client_home[c].node_id == node_id)
        return out

    def note_failures(self, round: int, failures: dict[int, str], per_client: bool) -> None:
        """Failed calls that look like a dead process (common/transport/liveness.py `unreachable`) make its
        node suspect at once: sampling leaves its clients out until it beats again, and it is
        marked dead when it does not within the heartbeat timeout.  Without `per_client` the
        calls went to edges ("edge X failed: ..."); a client failing under an edge is the edge's
        to report (`unavailable`)."""
        monitor = getattr(self.endpoint, "liveness", None)
        if monitor is None:
            return
        for cid, why in sorted(failures.items()):
            node = self.client_home.get(cid)
            if node is None:
                continue
            if not per_client:
                prefix = f"edge {node.node_id} failed: "
                if not why.startswith(prefix):
                    continue
                why = why[len(prefix):]
            if unreachable(why) and monitor.suspect(node.node_id, why):
                self.store.add_event("node_suspect", node=node.node_id, round=round,
                                     detail=f"a call failed: {why}; its clients are not sampled until it beats again")

    def live_count(self, suspects: bool = True) -> int:
        """How many clients have a host that is neither dead nor (with `suspects`) suspect, and
        were not reported dead by their edge: counted by node (`homed`), not by client."""
        monitor = getattr(self.endpoint, "liveness", None)
        gone = set() if monitor is None else monitor.unavailable_nodes() if suspects else monitor.dead_nodes()
        hosted = sum(n for node_id, n in self.homed.items() if node_id not in gone)
        return hosted - sum(1 for c in self.reported_dead() if self.client_home[c].node_id not in gone)

    def lost_call(self, cid: int, why: str) -> bool:
        """Whether client `cid`'s failure is its process being unavailable: the call failed as calls
        to a dead process fail (directly, or through its edge), or its node is now dead or suspect,
        or its edge reported its process dead."""
        text = why.split(" failed: ", 1)[1] if why.startswith("edge ") and " failed: " in why else why
        if unreachable(text) or cid in self.reported_dead():
            return True
        monitor = getattr(self.endpoint, "liveness", None)
        node = self.client_home.get(cid)
        return monitor is not None and node is not None and node.node_id in monitor.unavailable_nodes()

    def is_short(self, sampled: list[int], results: dict, failures: dict[int, str]) -> bool:
        """Whether a round's results (before the virtual clock's cuts) are fewer than run.min_results."""
        got = len(set(sampled) - set(failures))
        return not results or got < max(resolve_min_results(self.cfg, len(sampled)), 1)

    def short_round(self, round: int, attempt: int, sampled: list[int], failures: dict[int, str]) -> str:
        """A short attempt of `round` (`is_short`) under run.on_short_round: "complete" (policy
        "fail", or a round short through refused replies: complete_round fails the run as before),
        "retry" (its failures recorded, sample it again) or "skip" (the model stays, the round is
        over).  Raises RunFailed when no client has a live process left, or after
        MAX_SKIPPED_IN_A_ROW skipped rounds in a row."""
        policy = self.cfg.run.on_short_round
        got = len(set(sampled) - set(failures))
        needed = max(resolve_min_results(self.cfg, len(sampled)), 1)
        # only calls lost to an unavailable process are worth another sample: a reply that came
        # back refused (NaN/Inf, a handler's error) is the algorithm's or the participant's doing,
        # and sampling again would hide a diverging run; so a round short even counting every lost
        # call as returned fails as before
        lost = sum(1 for cid, why in failures.items() if self.lost_call(cid, why))
        if policy == "fail" or got + lost < needed:
            return "complete"
        self.record_failures(round, failures)
        self.failures_total += len(failures)
        live = self.live_count()
        what = f"only {got} of {len(sampled)} sampled clients returned a result (run.min_results requires {needed})"
        dead = sorted({self.client_home[c].node_id for c in failures if c in self.client_home})
        alive = self.live_count(suspects=False)   # a suspect may still beat: only the dead count here
        if alive < needed:
            raise RunFailed(f"round {round}: {what}, and only {alive} clients have a live process left")
        if policy == "retry" and attempt < SHORT_ROUND_RETRIES:
            self.store.add_event("round_retried", node="server", round=round,
                                 detail=f"attempt {attempt + 1}: {what}; failed: {id_list(sorted(failures))} on "
                                        f"{', '.join(dead)}; sampling again among {live} live clients")
            log.warning("round %d: %s; retrying (attempt %d)", round, what, attempt + 2)
            return "retry"
        self.skipped_in_a_row += 1
        self.store.add_event("round_skipped", node="server", round=round,
                             detail=f"{what} after {attempt + 1} attempts; failed: {id_list(sorted(failures))} on "
                                    f"{', '.join(dead)}; the model is unchanged")
        log.warning("round %d: %s; skipped", round, what)
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise RunFailed(f"round {round}: {self.skipped_in_a_row} rounds in a row skipped "
                            f"(run.on_short_round = '{policy}'); last: {what}")
        self.rounds_completed = round
        return "skip"

    def record_failures(self, round: int, failures: dict[int, str]) -> None:
        """One event per client left out: a typed rejection or a lost or failed call."""
        for cid, why in sorted(failures.items()):
            code = rejection_code(why)   # typed rejections (common/processors/validation.py), the rest: lost or failed
            kind = "rejected_payload" if code else "client_failed"
            detail = why if not code or why.startswith(f"{code}:") else f"{code}: {why}"   # the code once
            self.store.add_event(kind, node=client_node(cid), detail=detail, round=round)
            log.warning("round %d: client %d left out: %s", round, cid, why)

    def client_message(self, message: Payload, round: int, cid: int) -> Payload:
        """Client `cid`'s message this round: the shared one or its own variant (Algorithm.client_message)."""
        return self.algorithm.client_message(self.state, message, round, cid)

    def privacy_spent(self, round: int) -> bool:
        """privacy.target_epsilon with on_target = "stop": whether `round` would take epsilon past it;
        then the run ends here, completed, with a `privacy_budget_spent` event."""
        privacy = self.engine.privacy
        if privacy is None or not privacy.would_exceed():
            return False
        privacy.stopped = True
        self.store.add_event("privacy_budget_spent", node="server", round=round - 1,
                             detail=f"epsilon {privacy.epsilon:.4g} after round {round - 1}; round {round} would take "
                                    f"it past privacy.target_epsilon = {privacy.s.target_epsilon:g}")
        log.warning("privacy budget: round %d would exceed epsilon %g; the run ends", round, privacy.s.target_epsilon)
        return True

    def run_round(self, round: int) -> RoundResult | None:
        assert self.driver is not None   # made once the children registered (run)
        return self.driver.run_round(round)

    def complete_round(self, round: int, sampled: list[int], results: dict[int, Payload], failures: dict[int, str],
                       message: Payload, started: float, dispatched: float, arrivals: dict[int, float],
                       per_client: bool = True) -> RoundResult | None:
        """The end of a round of sampled clients (any topology's driver): record the failures,
        settle the virtual clock, check min_results, aggregate, take the server step, evaluate
        and record the round.  `per_client`: `results` holds one reply per client (not edge
        partials), so the virtual clock can cut single clients.  `results` a StreamedResults
        (common/processors/streaming.py): the replies were folded as they arrived and only their scalars
        are here; where the folded aggregate is not finite the round is skipped (None)."""
        fold = getattr(results, "fold", None)
        if fold is not None:
            self.memory.note_fold(fold)
        results, inconsistent = consistent_results(results)
        failures.update(inconsistent)
        self.record_failures(round, failures)
        non_finite = sorted(cid for cid, why in failures.items() if rejection_code(why) == "NON_FINITE")
        refusal = FinitenessPolicy.of(self.cfg).refused_replies(round, id_list(non_finite)) if non_finite else None
        if refusal:
            raise RunFailed(refusal)
        settled = self.clock.settle(round, message, results, self.ledger.records(),
                                    star=per_client)   # deadline / over-commit cuts
        for cid, why in sorted(settled.cut.items()):
            self.store.add_event("deadline_missed" if why.startswith("deadline") else "overcommit_dropped",
                                 node=client_node(cid), detail=why, round=round)
        self.clock.emulate(settled.sim_seconds, time.perf_counter() - dispatched)
        participants = sorted(set(sampled) - set(failures) - set(settled.cut))
        needed = max(resolve_min_results(self.cfg, len(sampled)), 1)
        if len(participants) < needed or not results:
            diverged = (f"the run diverged: {len(non_finite)} of {len(sampled)} sampled clients replied with "
                        f"non-finite values (NaN/Inf), clients {id_list(non_finite)} (a lower algorithm.lr may help); "
                        if non_finite else "")
            raise RunFailed(f"round {round}: {diverged}only {len(participants)} of {len(sampled)} sampled clients "
                            f"returned a result; run.min_results requires {needed}")
        collected = time.perf_counter()
        aggregate = self.engine.finish_round(   # NaN/Inf: rolled back, the offender left out
            round, results, participants, lambda blamed, kept: self._left_out(round, blamed, kept, failures, per_client),
            fold=fold)
        if aggregate is None:   # a folded round whose sum or step was not finite (common/processors/validation.py)
            self.skip_streamed(round, failures)
            return None
        for node, detail in getattr(self.algorithm.aggregate, "drain", list)():   # common/engine/robust.py: short groups
            self.store.add_event("robust_fallback", node=node or "server", detail=detail, round=round)
        aggregated = time.perf_counter()
        metrics = self.round_metrics(round, aggregate)
        metrics.update(self.engine.privacy_round(round, sampled, participants))   # [privacy]: epsilon, C
        compute = float(aggregate.scalars.get(COMPUTE_KEY, 0.0))
        metrics.update(time_breakdown(collected - dispatched, compute, arrivals, dispatched, results))
        metrics.update({"time_aggregation": aggregated - collected + (dispatched - started),
                        "time_evaluation": time.perf_counter() - aggregated})
        metrics.update(settled.metrics)
        result = RoundResult(round, sampled, participants, failures, metrics, time.perf_counter() - started,
                             settled.sim_seconds)
        self.record_round(result)
        return result

    def streams(self, per_client: bool = True) -> bool:
        """Whether the round's replies are folded as they arrive (RoundEngine.streams)."""
        return self.engine.streams(per_client)

    def skip_streamed(self, round: int, failures: dict[int, str]) -> None:
        """A folded round whose aggregate or new model was not finite: the model stays, the
        round is over (its offender is recorded by `_left_out`), as a skipped short round."""
        self.failures_total += len(failures)
        self.skipped_in_a_row += 1
        self.store.add_event("round_skipped", node="server", round=round,
                             detail="NON_FINITE_AGGREGATE: the folded aggregate or the new model held NaN/Inf and "
                                    "the replies were not kept to retry without the worst; the model is unchanged")
        log.warning("round %d: the folded aggregate was not finite; skipped", round)
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise RunFailed(f"round {round}: {self.skipped_in_a_row} rounds in a row skipped; last: the folded "
                            f"aggregate held NaN/Inf")
        self.store_ledger()
        self.rounds_completed = round
        return None

    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload:
        """One message for a group of clients (an edge's, a collective's): the largest of their
        variants (variants extend the shared message, Algorithm.client_message)."""
        variants = {id(m): m for m in (self.algorithm.client_message(self.state, message, round, c) for c in cids)}
        return max(variants.values(), key=lambda m: (len(m.tensors), len(m.scalars)), default=message)

    def _left_out(self, round: int, blamed: dict[int, str], participants: list[int], failures: dict[int, str],
                  per_client: bool) -> list[int]:
        """Results whose contribution made the aggregate or the model non-finite (common/processors/validation.py
        `finite_step`): recorded as typed rejections, out of the round, or the run fails under
        security.nan_policy = "fail".  Without `per_client` the results are edges' partials."""
        def key_of(cid: int) -> int:
            return cid if per_client else edge_index(self.client_home[cid].node_id)

        for key, why in sorted(blamed.items()):
            node = client_node(key) if per_client else edge_node(key)
            self.store.add_event("rejected_payload", node=node, detail=why, round=round)
            log.warning("round %d: %s left out: %s", round, node, why)
        gone = [c for c in participants if key_of(c) in blamed]
        failures.update({c: blamed[c] if per_client else
                         f"NON_FINITE_AGGREGATE: the partial of edge-{key_of(c)} was left out" for c in gone})
        kept = [c for c in participants if c not in gone]
        refusal = FinitenessPolicy.of(self.cfg).blamed_aggregate(
            round, "clients" if per_client else "edges", id_list(sorted(blamed)), next(iter(blamed.values())), len(kept))
        if refusal:
            raise RunFailed(refusal)
        return kept

    def round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        return self.engine.metrics(round, aggregate)

    def evaluate(self) -> dict[str, float]:
        return self.engine.evaluate()

    def record_round(self, result: RoundResult) -> None:
        """Record a finished round: its ledger records, its row and the `round_writers`' rows (the
        live figure) in one run.db transaction, then the listeners (checkpoint, memory, progress).
        A stop signal waits until all of that is written (`stops_deferred`): the rounds table,
        `rounds_completed` and the newest checkpoint then agree, and a stop raised at the next
        round's start (`raise_if_stopped`) reports this round as the last."""
        with stops_deferred(), self._drain_guard():
            with self.store.transaction():
                self.store.insert_records(self.ledger.drain())
                self.store.add_round(result.round, participants=len(result.participants),
                                     sampled=len(result.sampled), failures=len(result.failures),
                                     metrics=result.metrics, wall_seconds=result.wall_seconds,
                                     sim_seconds=result.sim_seconds, finished=time.time(),
                                     clients_dropped=len(set(result.sampled) - set(result.participants)))
                for writer in self.round_writers:
                    writer(result)
            self.rounds_completed = result.round
            self.skipped_in_a_row = 0
            self.failures_total += len(result.failures)
            self.history.append(result)
            log.info("round %d: %d/%d results, %s", result.round, len(result.participants), len(result.sampled),
                     ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()))
            for listener in self.round_listeners:
                listener(result)

    # ------------------------------------------------------------------ whole run
    def run(self, register_timeout: float = 120.0) -> dict:
        """Wait for the registrations, play the rounds, shut the children down and write the
        run's records (summary.json, run.db's status, the model).

        How a stop signal (SIGINT, SIGTERM: common/util/procexit.py) ends it, wherever it lands:
        while the run waits for registrations or plays its rounds it ends them there, and the
        run is recorded "stopped" after the last round recorded, unless every planned round was
        recorded already: a run whose last round's row is written is "completed" whatever
        arrives after it.  While a round is being recorded, the children are told to shut
        down, and the records are written, a signal is noted only: it never cuts them, and a
        second signal is noted like the first."""
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.config_toml)
        self.store.start_run(run_id=self.run_id, name=self.cfg.run.name, algorithm=self.cfg.algorithm.name,
                             topology=self.cfg.topology.kind, transport=self.cfg.transport.kind,
                             config_toml=self.config_toml)
        status, error = "completed", ""
        try:
            with stops_at_waits():   # a stop noted during set-up is raised here, before the first registration
                self.wait_for_clients(register_timeout)
                for listener in self.ready_listeners:
                    listener()
                self.driver = make_driver(self.context, self)
                self.driver.start()
                for r in range(self.rounds_completed + 1, self.cfg.run.rounds + 1):  # rounds are 1-based
                    raise_if_stopped()   # a stop noted while the round before was recorded, or whose exception was lost
                    for gate in self.round_gates:
                        gate()
                    if self.privacy_spent(r):
                        break
                    self.run_round(r)
        except RunFailed as exc:
            status, error = "failed", str(exc)
            self.store.add_event("run_failed", node="server", detail=error, round=self.rounds_completed)
            log.error("run failed: %s", error)
        except (KeyboardInterrupt, Stopped) as exc:   # Ctrl-C, or SIGTERM (common/util/procexit.py stop_on_sigterm)
            ignore_stops()
            status, error = self._stopped(exc)
        except BaseException:
            with stops_deferred():
                self.shutdown_children()
            raise
        with stops_deferred():   # closing the records: a signal now is noted, never cuts them
            self.shutdown_children()
            noted = stop_noted()
            if noted is not None and status == "completed":   # after the last round's row: still completed
                self._stop_after_last_round(stop_reason(Stopped(noted) if noted != signal.SIGINT
                                                        else KeyboardInterrupt())[0])
            summary = self.finalize(status, error, time.perf_counter() - started)
        return summary

    def _stopped(self, exc: BaseException) -> tuple[str, str]:
        """The status and error of a run a stop signal ended (see `run`): "stopped" with the exit
        status a shell reports for the signal, or "completed" once every planned round is recorded."""
        reason, code = stop_reason(exc)
        if self.rounds_completed >= self.cfg.run.rounds:
            self._stop_after_last_round(reason)
            return "completed", ""
        self.stop_status = code
        error = f"{reason} after round {self.rounds_completed}"
        self.store.add_event("run_stopped", node="server", detail=error, round=self.rounds_completed)
        log.warning("run %s", error)
        return "stopped", error

    def _stop_after_last_round(self, reason: str) -> None:
        self.store.add_event("stop_after_last_round", node="server", round=self.rounds_completed,
                             detail=f"{reason} after the last round: the run is complete, its records are "
                                    "written before the server leaves")
        log.warning("%s after the last round (%d): recording the completed run", reason, self.rounds_completed)

    def shutdown_children(self) -> None:
        liveness = getattr(self.endpoint, "liveness", None)
        if liveness is not None:   # children told to stop are not "dead"
            liveness.stop()
        children = list(self.children.values())
        bye = Payload()
        _, failures = self.fabric.send_to_all([Send(i, node.address, node.node_id, Method.SHUTDOWN, bye)
                                               for i, node in enumerate(children)],
                                              round=self.rounds_completed, call_timeout=SHUTDOWN_TIMEOUT)
        for i, why in sorted(failures.items()):   # in the children's order, as they registered
            self.store.add_event("shutdown_failed", node=children[i].node_id, detail=why, round=self.rounds_completed)
        self.fabric.close()

    @contextlib.contextmanager
    def _drain_guard(self) -> Iterator[None]:
        """Around a drain of the ledger into run.db: if it raises, the drained records are in
        the ledger file only, and `merge_ledgers` reads the whole file."""
        try:
            yield
        except BaseException:
            self._drain_lost = True
            raise

    def store_ledger(self) -> None:
        """Insert the records the server's ledger holds into run.db."""
        with self._drain_guard():
            self.store.insert_records(self.ledger.drain())

    def merge_ledgers(self) -> None:
        """Insert every process's ledger file (run_dir/ledger/*.jsonl) into run.db (idempotent).
        The server's own file is read only up to where its own records begin (`Ledger.own_from`):
        the records after were drained into run.db as the run went, unless an insert of drained
        records failed, and then the whole file is read."""
        self.store_ledger()
        own = self.ledger.path
        stored = {own: self.ledger.own_from} if own is not None and not self._drain_lost else {}
        self.store.merge_ledger_dir(self.run_dir / "ledger", stored)
        record_refusals(self.store)   # calls a child refused: the caller may not use the method

    def finalize(self, status: str, error: str, wall_seconds: float) -> dict:
        """Write the run's records: the ledgers merged into run.db, the final evaluation, the
        model files, summary.json, then run.db's status, last (what `fedhop report` and the
        launcher read as "over").  Idempotent: every file is written whole and then renamed
        into place, so calling it again, or a process killed inside it (SIGKILL), never leaves a
        half-written file."""
        from fedhop.server.agreement import ledger_verdict  # beside ledger_consistency, which it reads
        self.merge_ledgers()
        final, final_error = self._final_metrics()
        self._save_model(whole_params(self.model, self.state.params), "model.safetensors")   # frozen ones too
        for name, params in self.algorithm.outputs(self.state).items():
            self._save_model(whole_params(self.model, params), f"model-{name}.safetensors")
        by_link = self.store.bytes_by_link()
        summary = {
            "status": status,
            "error": error,
            "run_id": self.run_id,
            "name": self.cfg.run.name,
            "algorithm": self.cfg.algorithm.name,
            "topology": self.cfg.topology.kind,
            "transport": self.cfg.transport.kind,   # whose framing the ledger counts, whichever engine ran
            "engine": self.cfg.run.engine,           # separate processes, or every role in one (deploy/launch/inprocess.py)
            "rounds_completed": self.rounds_completed,
            "rounds_planned": self.cfg.run.rounds,
            "final": final,
            **({"final_error": final_error} if final_error else {}),
            "bytes": {"total": by_link.pop("total", None), "by_link": by_link},
            "ledger_agreement": ledger_verdict(self.store).as_dict(),   # explained losses agree (server/agreement.py)
            "failures": self.failures_total,
            "clients_dropped": self.store.clients_dropped(),   # sampled clients whose result did not count
            "round_retries": len(self.store.events("round_retried")),   # run.on_short_round
            "rounds_skipped": len(self.store.events("round_skipped")),
            "wall_seconds": wall_seconds,
            "num_parameters": int(sum(t.numel() for t in whole_params(self.model, self.state.params).values())),
            "exchanged_parameters": int(sum(t.numel() for t in self.state.params.values())),   # model.exchange
            "num_clients": self.cfg.clients.count,
            "clients_per_round": resolve_clients_per_round(self.cfg),
        }
        if self.driver is not None:
            summary.update(self.driver.summary())
        for hook in self.summary_hooks:
            summary.update(hook())
        self._replace(self.run_dir / "summary.json",
                      lambda tmp: tmp.write_text(json.dumps(summary, indent=2, default=float)))
        self.store.finish_run(status)
        return summary

    def _final_metrics(self) -> tuple[dict[str, float], str]:
        """The final evaluation and training loss, and "" or why they could not be made.  They
        read the task's data (the test set, and clients no round may have read, e.g. a LEAF user
        whose file holds values of the wrong kind): a failure there is recorded (an event and
        summary.json's `final_error`) and the run's model and records are still written."""
        try:
            final = self.evaluate() if self.rounds_completed else {}
            if "train_loss" not in final:
                bind_params(self.model, self.state.params)
                final["train_loss"] = float(self.task.train_loss(self.model))
            return final, ""
        except Exception as exc:   # noqa: BLE001  # whatever the data held: the run's results come first
            why = f"{type(exc).__name__}: {exc}"[:500]
            log.error("the final evaluation failed (the model and records are written): %s", why)
            self.store.add_event("final_evaluation_failed", node="server", detail=why)
            return {}, why

    def _save_model(self, params: dict[str, torch.Tensor], name: str) -> None:
        self._replace(self.run_dir / name, lambda tmp: save_file(
            {k: v.detach().cpu().contiguous() for k, v in params.items()}, str(tmp)))

    @staticmethod
    def _replace(path: Path, write: Callable[[Path], object]) -> None:
        """Write `path` whole: `write` fills a temporary file beside it, which is then renamed
        over it (a rename within a folder is atomic)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
