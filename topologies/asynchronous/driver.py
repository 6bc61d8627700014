"""The asynchronous topology's server part: clients in flight, their updates applied one by one.

At most `concurrency` clients train at once, each on the model version it was sent (a snapshot
taken when it was dispatched).  A dispatch is one `train` call through the fabric (the ledger
records its request and its reply; the reply runs through the algorithm's reply chain like a
star round's), made on a thread of this driver so that the calls run concurrently.  When a
client's update is taken (its "arrival"), the rule (rule.py) buffers or mixes it, and a newly
sampled idle client is dispatched at once in its place, with the model as it is after the update.

Which update is taken next:

- `clock = "virtual"`: the one with the smallest simulated finish time, dispatch time plus the
  client's simulated download, compute and upload (common/engine/vclock.py `client_timing`, from
  the [clients] device profiles: slowdown, links, latency; the compute of its planned local
  steps, not of the steps its reply reports; transfer times from the tensors' bytes), ties to the
  earlier dispatch.  The order is decided by the seed alone, not by which process answered first:
  an ended call is taken only once no call still in flight can finish before it.  Each flight
  knows at dispatch the earliest it can finish (`Flight.earliest`: its download, its planned
  compute and the uplink's latency, everything but the reply's own bytes and measured time), so
  the driver waits only for the calls whose earliest finish comes before the best ended one,
  not for every call in flight.  A failed call finishes at its earliest.  Ended calls wait in a
  heap by (finish, dispatch number) and calls in flight in a heap by (earliest, dispatch
  number), so a choice costs O(log concurrency).
- `clock = "real"`: the first to reply.

The order is recorded in run.db, table `async_updates` (one row per dispatch: the client, the
version it was sent, the version its update produced, the staleness and weight, simulated
times, status "applied", "unused" for the calls in flight at the end, or "failed"), so that a
replay of the recorded order reproduces the model (tests/test_async_fl.py).  One run round is one
server update; its metrics add the updates' staleness (mean, max).

Behind edges (`topology.edges` > 0) the buffer lives at the edge: a dispatch is one `edge_round`
call to an idle edge (at most one call per edge at a time, `concurrency` edge calls in flight)
naming `buffer_size` of its clients, drawn from the stream ("async", "edge-clients", n) among
those it has not reported dead; the edge trains them on the model version it was sent (its
usual HierFAVG iteration, edge/aggregator.py, kappa2 = 1) and answers with their weighted sum
sum_i n_i Delta_i and weight sum_i n_i.  The server takes that flush as one update of its rule,
with the staleness of the version the edge was sent:

    FedBuff:  x <- x + eta_g s(t - tau) Delta_e,     Delta_e = sum_i n_i Delta_i / sum_i n_i
    FedAsync: x <- (1 - a_t) x + a_t (x_tau + Delta_e)

(n_i the clients' `weight`: samples, or 1 under algorithm.weighting = "uniform", which makes
Delta_e FedBuff's plain 1/K mean).  On the virtual clock an edge call finishes at the slowest of
its clients (each timed as above with the model's bytes both ways; the edge-server link takes no
simulated time, as in hierarchical rounds).  Its row has `node` the edge and `clients` the ids
it trained (JSON); `client` is NULL.
"""
from __future__ import annotations

import bisect
import heapq
import json
import math
import queue
import sqlite3
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedhop.common.algorithms.base import weighted_mean
from fedhop.common.engine.vclock import client_timing
from fedhop.common.topologies.graphs import topology_params
from fedhop.common.transport.control import control_of, failures_of, sampled_clients
from fedhop.common.transport.fabric import Send, reply_chain
from fedhop.common.util.nodeids import client_node, edge_index
from fedhop.common.util.procexit import raise_if_stopped
from fedhop.common.util.rng import numpy_stream
from fedhop.common.wire.message import COMPUTE_KEY, Payload
from fedhop.common.wire.methods import Method
from fedhop.server.driver import DriverContext, RoundResult, RunFailed, TopologyDriver
from fedhop.topologies.asynchronous import AsyncParams, concurrency_of
from fedhop.topologies.asynchronous.rule import FedBuffBuffer, fedasync_mix, staleness_weight

TABLE = "async_updates"
SCHEMA = (f"CREATE TABLE IF NOT EXISTS {TABLE} (run_id TEXT, arrival INTEGER, dispatch INTEGER, client INTEGER, "
          "sent_version INTEGER, applied_version INTEGER, staleness INTEGER, weight REAL, sim_dispatch REAL, "
          "sim_arrival REAL, round INTEGER, status TEXT, detail TEXT, node TEXT, clients TEXT)")
WAIT_SLICE = 0.5          # seconds between checks for a stop signal while waiting for replies
FAILURES_IN_A_ROW = 10    # failed calls in a row (times the concurrency) that fail the run
BATCH_SHARE = 8           # on the virtual clock dispatches go out in groups of concurrency / BATCH_SHARE


@dataclass
class Flight:
    """One dispatched client: what it was sent and, once its call is over, what came back."""

    seq: int                          # dispatch number, 1-based (also the call's step: its own minibatch stream)
    cid: int | None                   # the client called (None: an edge call)
    version: int                      # the model version it was sent (tau)
    round: int                        # the run round in progress when it was sent (the call's round)
    sent: dict[str, torch.Tensor]
    down_bytes: int
    sim_start: float
    future: Future
    reply: Payload | None = None
    failure: str = ""
    sim_finish: float = 0.0
    earliest: float = 0.0             # the least sim_finish its call can have (known at dispatch)
    settled: bool = False
    taken: dict = field(default_factory=dict)   # the row written when it is taken
    node: str = ""                    # the node called: the client's, or the edge's
    clients: list[int] = field(default_factory=list)   # the clients that trained: [cid], or the edge's draw
    steps: list[int] = field(default_factory=list)     # each client's planned local steps (its simulated compute)
    update: dict[str, torch.Tensor] = field(default_factory=dict)   # the delta the rule applies


class AsyncDriver(TopologyDriver):
    """FedBuff or FedAsync over the fabric (module docstring)."""

    kind = "asynchronous"

    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        self.params: AsyncParams = topology_params(ctx.run.cfg)
        self.concurrency = concurrency_of(ctx.run.cfg, self.params)
        self.edges = ctx.run.cfg.topology.edges > 0   # the buffer lives at the edges (module docstring)
        self.targets: list[str] = []              # the nodes a dispatch may call, in draw order (start)
        self.position: dict[str, int] = {}        # a target's index in `targets`
        self.client_of: dict[str, int] = {}       # star: a client's node id -> its id
        self.cluster: dict[str, list[int]] = {}   # behind edges: an edge's clients
        self.version = 0            # server updates applied (t)
        self.sim_now = 0.0          # the server's simulated time
        self.sim_last = 0.0         # at the previous update
        self.seq = 0                # dispatches made
        self.arrivals = 0           # updates taken (applied, buffered or failed)
        self.in_flight: dict[int, Flight] = {}
        self.busy: list[int] = []   # the in-flight targets' positions in `targets`, sorted
        self.done: queue.Queue[int] = queue.Queue()   # dispatch numbers, as their calls end
        self.unsettled: set[int] = set()   # in flight, and their end not yet taken from `done`
        self.settled_order: list[tuple[float, int]] = []   # virtual clock: (sim_finish, seq) of settled flights, a heap
        self.unsettled_order: list[tuple[float, int]] = []   # (earliest, seq) of flights in the air, a heap; stale
        #                                                      entries (settled since) are dropped when they surface
        # behind edges the edge buffered: each flush it sends is one server update
        self.buffer = FedBuffBuffer(1 if self.edges else self.params.buffer_size, self.params.server_lr)
        self.buffered: list[Flight] = []
        self.round_failures: dict[int, str] = {}
        self.failures_in_a_row = 0
        self.staleness_all: list[int] = []
        self.pool: ThreadPoolExecutor | None = None
        self.db: sqlite3.Connection | None = None
        self.version_sent: tuple[tuple[int, int], dict[str, torch.Tensor], Payload, dict] | None = None
        # dispatches not yet sent, and how many are held before they go together (send_outbox)
        self.outbox: list[tuple[Flight, Send[Any], float]] = []
        batched = (self.params.clock == "virtual" and not self.edges
                   and bool(getattr(ctx.fabric, "batch", False)))
        self.batch_sends = max(1, self.concurrency // BATCH_SHARE) if batched else 1

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        home = self.ctx.nodes.client_home
        if self.edges:
            for cid in sorted(home):
                self.cluster.setdefault(home[cid].node_id, []).append(cid)
            self.targets = sorted(self.cluster, key=edge_index)
        else:
            self.client_of = {client_node(cid): cid for cid in sorted(home)}
            self.targets = list(self.client_of)
        self.position = {node: i for i, node in enumerate(self.targets)}
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="async-dispatch")
        self.db = sqlite3.connect(str(self.ctx.run.run_dir / "run.db"), timeout=30.0, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout = 30000")
        self.db.execute("PRAGMA synchronous = NORMAL")   # as the run store's connections: no fsync per row (WAL)
        self.db.execute(SCHEMA)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, round: int) -> None:
        """Send the current model to one idle client (or, behind edges, one idle edge), drawn from
        the stream ("async", "dispatch", n)."""
        ctx = self.ctx
        idle = len(self.targets) - len(self.busy)
        if idle <= 0:
            return
        self.seq += 1
        draw = int(numpy_stream(ctx.run.cfg.run.seed, "async", "dispatch", self.seq).integers(idle))
        position = nth_idle(draw, self.busy)
        node = self.targets[position]
        sent, plain, spec = self.version_message(round)
        rules = ctx.run.algorithm.reply_scalars()
        timeout = ctx.run.cfg.run.round_timeout
        who = f"dispatch {self.seq} (version {self.version})"
        send: Send[Any]   # keyed by the edge's node id, or by the client id
        if self.edges:
            cids = self.edge_clients(node)
            shared = ctx.model.group_message(plain, round, cids)
            message = Payload(tensors=shared.tensors, scalars=shared.scalars, control=sampled_clients(cids))
            send = Send(node, ctx.nodes.children[node].address, node, Method.EDGE_ROUND, message,
                        inbound=reply_chain(ctx.run.cfg, spec, Method.EDGE_ROUND, rules, ctx.model.reply_limits(cids),
                                            round=round, peer=node),   # the edge speaks for its clients
                        who=f"{who} partial of {node}")
            call_timeout, cid = 2 * timeout, None
        else:
            cid = self.client_of[node]
            cids = [cid]
            message = ctx.model.client_message(plain, round, cid)
            send = Send(cid, ctx.nodes.client_home[cid].address, node, Method.TRAIN, message, step=self.seq,
                        inbound=reply_chain(ctx.run.cfg, spec, Method.TRAIN, rules, ctx.model.reply_limits([cid]),
                                            round=round, peer=node),
                        who=f"{who} reply of client {cid}")
            call_timeout = ctx.run.cfg.run.call_timeout
        seq = self.seq
        f = Flight(seq, cid, self.version, round, sent, message.tensor_bytes(), self.sim_now, Future(), node=node,
                   clients=cids)
        f.steps = [ctx.clock.planned_steps(c, 0) for c in cids]
        f.earliest = f.sim_start + self.sim_seconds(f, up_bytes=0, measured_seconds=0.0)
        self.in_flight[seq] = f
        bisect.insort(self.busy, position)
        self.unsettled.add(seq)
        heapq.heappush(self.unsettled_order, (f.earliest, seq))
        f.future.add_done_callback(lambda _f: self.done.put(seq))
        if self.outbox and self.outbox[0][0].round != round:
            self.send_outbox()   # a batch's calls share one round
        self.outbox.append((f, send, call_timeout))
        if len(self.outbox) >= self.batch_sends:
            self.send_outbox()

    def send_outbox(self) -> None:
        """Send the dispatches held in the outbox, in one `send_and_receive` (batched per client
        process where `transport.batch` is on, each with its own step); each flight's future gets
        the outcome.  Dispatches are held only on the virtual clock, where the order does not
        depend on when a call goes out, and sent before the driver waits for a call."""
        if not self.outbox:
            return
        held, self.outbox = self.outbox, []
        timeout = self.ctx.run.cfg.run.round_timeout
        assert self.pool is not None   # made by start
        group = self.pool.submit(self.ctx.fabric.send_and_receive, [send for _, send, _ in held],
                                 round=held[0][0].round, timeout=2 * timeout if self.edges else timeout,
                                 call_timeout=held[0][2],
                                 timeout_reason=f"timeout: no result within run.round_timeout={timeout}s")

        def relay(done: Future) -> None:
            error = CancelledError() if done.cancelled() else done.exception()
            for f, _, _ in held:
                if error is not None:
                    f.future.set_exception(error)
                else:
                    f.future.set_result(done.result())
        group.add_done_callback(relay)

    def version_message(self, round: int) -> tuple[dict[str, torch.Tensor], Payload, dict]:
        """The model version being sent (kept: the rule reads it at the update), the message made
        of it and the reply spec, made once per (version, round) and shared by the dispatches
        in between (a FedBuff buffer's worth): one copy of the model, and one encoding per group
        of dispatches sent together (the fabric encodes each distinct message once)."""
        key = (self.version, round)
        if self.version_sent is None or self.version_sent[0] != key:
            algorithm, state = self.ctx.run.algorithm, self.ctx.model.state
            base = algorithm.broadcast(state, round)
            sent = {k: v.detach().clone() for k, v in base.tensors.items()}
            self.version_sent = (key, sent, Payload(tensors=dict(sent), scalars=dict(base.scalars)),
                                 algorithm.reply_spec(state))
        _, sent, plain, spec = self.version_sent
        return sent, plain, spec

    def edge_clients(self, edge: str) -> list[int]:
        """The clients an edge call trains: `buffer_size` of the edge's cluster (all of them where
        fewer are left), drawn from ("async", "edge-clients", n) among those the edge has not
        reported on dead processes (sorted: the edge folds its replies in client-id order)."""
        ctx = self.ctx
        draw = numpy_stream(ctx.run.cfg.run.seed, "async", "edge-clients", self.seq)
        return draw_clients(self.cluster[edge], ctx.nodes.unavailable.get(edge, set()), self.params.buffer_size, draw)

    def fill(self, round: int) -> None:
        while len(self.in_flight) < min(self.concurrency, len(self.targets)):
            self.dispatch(round)

    # ------------------------------------------------------------------ arrivals
    def settle(self, f: Flight) -> None:
        """The call's outcome, the delta the rule applies and its simulated finish time (once per flight)."""
        if f.settled:
            return
        f.settled = True
        key = f.node if self.edges else f.cid
        try:
            results, failures = f.future.result()
        except Exception as exc:   # the fabric closed under it (a stop)
            results, failures = {}, {key: f"call not made: {exc}"}
        f.reply = results.get(key)
        f.failure = failures.get(key, "" if f.reply is not None else "no reply")
        if f.reply is None:   # known no sooner than its reply could have come
            f.sim_finish = f.earliest
            return
        if self.edges:   # the edge's flush: its clients' weighted mean delta (module docstring)
            f.update = {name: weighted_mean(f.reply, name) for name in f.reply.tensors if name in f.sent}
            control = control_of(f.reply)
            self.ctx.nodes.unavailable[f.node] = set(control.clients)
            f.failure = "; ".join(f"client {c}: {why}" for c, why in sorted(failures_of(f.reply).items()))
            up = sum(t.numel() * t.element_size() for t in f.update.values())
            f.sim_finish = f.sim_start + self.sim_seconds(f, up_bytes=up, measured_seconds=0.0)
            return
        f.update = f.reply.tensors
        f.sim_finish = f.sim_start + self.sim_seconds(f, up_bytes=f.reply.tensor_bytes(),
                                                      measured_seconds=float(f.reply.scalars.get(COMPUTE_KEY, 0.0)))

    def sim_seconds(self, f: Flight, *, up_bytes: int, measured_seconds: float) -> float:
        """The simulated duration of `f`'s call: its client's download of the request, the compute
        of its planned local steps (`Flight.steps`, `compute_time = "steps"`; a reply's reported
        steps never move its place in the order) or of `measured_seconds` ("measured"), and the
        upload of `up_bytes`.  Behind an edge, the slowest of the edge's clients, each with the edge's
        request and reply bytes.  With `up_bytes = 0` and `measured_seconds = 0` it is the least
        duration the call can have, whatever it replies (`Flight.earliest`)."""
        clock = self.ctx.clock
        return max(client_timing(c, clock.profiles[c], clock.params, steps=steps, down_bytes=f.down_bytes,
                                 up_bytes=up_bytes, measured_seconds=measured_seconds).finish
                   for c, steps in zip(f.clients, f.steps))

    def _wait(self, futures: list[Future]) -> None:
        while futures:
            _, pending = wait(futures, timeout=WAIT_SLICE)
            raise_if_stopped()
            futures = list(pending)

    def _ended(self) -> int:
        """The dispatch number of the next call to end (its future done), waiting for it."""
        while True:
            try:
                seq = self.done.get(timeout=WAIT_SLICE)
            except queue.Empty:
                raise_if_stopped()
                continue
            self.unsettled.discard(seq)
            return seq

    def _land(self, seq: int) -> Flight:
        """Flight `seq` out of the air: taken next, its target idle again."""
        f = self.in_flight.pop(seq)
        del self.busy[bisect.bisect_left(self.busy, self.position[f.node])]
        self.sim_now = max(self.sim_now, f.sim_finish)
        return f

    def next_arrival(self) -> Flight:
        """The next update to take (module docstring: simulated order or arrival order).  Each
        call's end is taken once from `done`, so a choice costs O(log concurrency), not a pass
        over the calls in flight."""
        raise_if_stopped()
        if self.params.clock == "real":
            self.send_outbox()
            while True:
                seq = self._ended()
                if seq in self.in_flight:
                    self.settle(self.in_flight[seq])
                    return self._land(seq)
        while True:
            while True:   # the calls that have ended, without waiting
                try:
                    seq = self.done.get_nowait()
                except queue.Empty:
                    break
                self._settled(seq)
            if self.settled_order and self.settled_order[0] < self._first_unsettled():
                break   # no call in flight can finish before it (ties to the earlier dispatch)
            self.send_outbox()   # before waiting: a held dispatch may be the call waited for
            self._settled(self._ended())
        _, seq = heapq.heappop(self.settled_order)
        return self._land(seq)

    def _settled(self, seq: int) -> None:
        """Flight `seq`'s call has ended: settled, and into the heap of ended flights."""
        self.unsettled.discard(seq)
        f = self.in_flight[seq]
        self.settle(f)
        heapq.heappush(self.settled_order, (f.sim_finish, seq))

    def _first_unsettled(self) -> tuple[float, float]:
        """The least (earliest finish, dispatch number) of the calls in flight; (inf, inf) when none."""
        order = self.unsettled_order
        while order and order[0][1] not in self.unsettled:
            heapq.heappop(order)
        return order[0] if order else (math.inf, math.inf)

    def take(self, f: Flight, round: int) -> bool:
        """Apply (FedAsync), buffer (FedBuff) or record the failure of `f`; True when the model changed."""
        self.arrivals += 1
        staleness = self.version - f.version
        row: dict[str, Any] = {"arrival": self.arrivals, "staleness": staleness, "sim_arrival": f.sim_finish, "round": round}
        if f.reply is None:
            self.round_failures.update((c, f.failure) for c in f.clients)
            self.failures_in_a_row += 1
            self._rows([(f, {**row, "status": "failed", "detail": f.failure})])
            self.ctx.records.store.add_event("edge_failed" if self.edges else "client_failed", node=f.node, round=round,
                                     detail=f"dispatch {f.seq}: {f.failure}")
            if self.failures_in_a_row >= FAILURES_IN_A_ROW * self.concurrency:
                raise RunFailed(f"round {round}: {self.failures_in_a_row} dispatches in a row failed; last: "
                                f"{f.node}: {f.failure}")
            return False
        self.failures_in_a_row = 0
        if f.failure:   # behind an edge: some of its clients failed, the flush is the others'
            self.round_failures.update(failures_of(f.reply))
            row["detail"] = f.failure
        p = self.params
        weight = staleness_weight(p.staleness, staleness, p.staleness_a, p.staleness_b)
        f.taken = {**row, "weight": weight}
        self.staleness_all.append(staleness)
        state = self.ctx.model.state.params
        if p.mode == "fedasync":
            fedasync_mix(state, f.sent, f.update, p.mixing * weight)
            self.buffered = [f]
        else:
            self.buffer.add(f.update, weight)
            self.buffered.append(f)
            if not self.buffer.ready:
                return False
            self.buffer.flush(state)
        self.version += 1
        self._rows([(g, {**g.taken, "applied_version": self.version, "status": "applied"}) for g in self.buffered])
        return True

    def _rows(self, rows: list[tuple[Flight, dict]]) -> None:
        """`async_updates` rows, one transaction for all of them (a FedBuff flush writes its buffer's)."""
        assert self.db is not None   # made by start
        run_id = self.ctx.run.run_id
        values = [(run_id, row.get("arrival"), f.seq, f.cid, f.version, row.get("applied_version"), row.get("staleness"),
                   row.get("weight"), f.sim_start, row.get("sim_arrival"), row.get("round"), row.get("status"),
                   row.get("detail", ""), f.node, json.dumps(f.clients)) for f, row in rows]
        with self.db:   # committed together, or rolled back by an exception (a stop) before the commit
            self.db.execute("BEGIN")
            self.db.executemany(f"INSERT INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)

    def drain(self, round: int) -> None:
        """After the last update: wait for the calls still in flight (their replies are counted
        in the ledger) and record them "unused" (or "failed", with its event)."""
        self.send_outbox()
        self._wait([f.future for f in self.in_flight.values()])
        rows = []
        for seq in sorted(self.in_flight):
            f = self.in_flight[seq]
            self.settle(f)
            rows.append((f, {"staleness": self.version - f.version, "sim_arrival": f.sim_finish, "round": round,
                             "status": "unused" if f.reply is not None else "failed", "detail": f.failure}))
            if f.reply is None:   # an event for each failed call, as for those taken
                self.ctx.records.store.add_event("edge_failed" if self.edges else "client_failed", node=f.node,
                                                 round=round, detail=f"dispatch {f.seq}: {f.failure}")
        if rows:
            self._rows(rows)
        self.in_flight.clear()
        self.busy.clear()
        self.unsettled.clear()
        self.settled_order.clear()
        self.unsettled_order.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.db is not None:   # every row is written: the last round's record follows
            self.db.close()
            self.db = None

    # ------------------------------------------------------------------ one run round: one server update
    def run_round(self, round: int) -> RoundResult | None:
        ctx = self.ctx
        started = time.perf_counter()
        self.round_failures = {}
        self.fill(round)
        while True:
            f = self.next_arrival()
            updated = self.take(f, round)
            last = updated and round >= ctx.run.cfg.run.rounds
            if not last:
                self.fill(round if not updated else round + 1)
            if updated:
                break
        used, self.buffered = self.buffered, []
        if round >= ctx.run.cfg.run.rounds:
            self.drain(round)
        weights = [float(g.reply.scalars.get("weight", 1.0)) for g in used if g.reply is not None]
        losses = [float(g.reply.scalars.get("train_loss", 0.0)) for g in used if g.reply is not None]
        aggregate = Payload(scalars={"weight": sum(weights), "train_loss": sum(w * x for w, x in zip(weights, losses))})
        metrics = ctx.records.round_metrics(round, aggregate)
        stale = [int(g.taken["staleness"]) for g in used]
        metrics.update({"staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale)),
                        "async_updates": float(len(used)), "async_version": float(self.version),
                        "sim_time": self.sim_now})
        participants = sorted({c for g in used for c in g.clients} - set(self.round_failures))
        sampled = sorted(set(participants) | set(self.round_failures))
        result = RoundResult(round, sampled, participants, dict(self.round_failures), metrics,
                             time.perf_counter() - started, self.sim_now - self.sim_last)
        self.sim_last = self.sim_now
        ctx.records.record_round(result)
        return result

    def summary(self) -> dict:
        stale = self.staleness_all
        return {"asynchronous": {"mode": self.params.mode, "clock": self.params.clock, "updates": len(stale),
                                 "server_versions": self.version, "dispatches": self.seq,
                                 "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
                                 "staleness_max": max(stale, default=0), "sim_seconds": self.sim_now}}


def draw_clients(cluster: list[int], gone: set[int], k: int, rng: np.random.Generator) -> list[int]:
    """`k` clients of `cluster` (sorted ids) not in `gone` (all of the cluster where every one is
    gone), drawn as `rng.choice(len(pool), k, replace=False)` over the list `pool` of those
    clients, sorted; found from the positions of the gone clients (`nth_idle`) rather than by
    building `pool`, which at 1,000,000 clients behind 4 edges is 250,000 ids a dispatch."""
    skipped = sorted({i for i in (bisect.bisect_left(cluster, c) for c in gone) if i < len(cluster)
                      and cluster[i] in gone})
    if len(skipped) == len(cluster):
        skipped = []
    size = len(cluster) - len(skipped)
    return sorted(cluster[nth_idle(int(i), skipped)] for i in rng.choice(size, size=min(k, size), replace=False))


def nth_idle(n: int, busy: list[int]) -> int:
    """The index of the `n`-th (from 0) entry of a list that is not at one of the `busy` indices
    (sorted, distinct): `[i for i in range(size) if i not in busy][n]` without walking the list,
    which holds every client (1,000,000 of them) while at most `concurrency` are busy."""
    i = n
    for b in busy:
        if b > i:
            break
        i += 1
    return i

