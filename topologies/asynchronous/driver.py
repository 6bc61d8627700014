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
  the [clients] device profiles: slowdown, links, latency; transfer times from the tensors' bytes),
  ties to the earlier dispatch.  The driver waits until every call in flight has replied, so the
  order is decided by the seed alone, not by which process answered first.
- `clock = "real"`: the first to reply.

The order is recorded in run.db, table `async_updates` (one row per dispatch: the client, the
version it was sent, the version its update produced, the staleness and weight, simulated
times, status "applied", "unused" for the calls in flight at the end, or "failed"), so that a
replay of the recorded order reproduces the model (tests/test_async_fl.py).  One run round is one
server update; its metrics add the updates' staleness (mean, max).
"""
from __future__ import annotations

import queue
import sqlite3
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from fedhop.common.engine.vclock import client_timing
from fedhop.common.topologies.graphs import topology_params
from fedhop.common.transport.fabric import Send, reply_chain
from fedhop.common.util.nodeids import client_node
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
          "sim_arrival REAL, round INTEGER, status TEXT, detail TEXT)")
WAIT_SLICE = 0.5          # seconds between checks for a stop signal while waiting for replies
FAILURES_IN_A_ROW = 10    # failed calls in a row (times the concurrency) that fail the run


@dataclass
class Flight:
    """One dispatched client: what it was sent and, once its call is over, what came back."""

    seq: int                          # dispatch number, 1-based (also the call's step: its own minibatch stream)
    cid: int
    version: int                      # the model version it was sent (tau)
    round: int                        # the run round in progress when it was sent (the call's round)
    sent: dict[str, torch.Tensor]
    down_bytes: int
    sim_start: float
    future: Future
    reply: Payload | None = None
    failure: str = ""
    sim_finish: float = 0.0
    settled: bool = False
    taken: dict = field(default_factory=dict)   # the row written when it is taken


class AsyncDriver(TopologyDriver):
    """FedBuff or FedAsync over the fabric (module docstring)."""

    kind = "asynchronous"

    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        self.params: AsyncParams = topology_params(ctx.run.cfg)
        self.concurrency = concurrency_of(ctx.run.cfg, self.params)
        self.version = 0            # server updates applied (t)
        self.sim_now = 0.0          # the server's simulated time
        self.sim_last = 0.0         # at the previous update
        self.seq = 0                # dispatches made
        self.arrivals = 0           # updates taken (applied, buffered or failed)
        self.in_flight: dict[int, Flight] = {}
        self.done: queue.Queue[int] = queue.Queue()
        self.buffer = FedBuffBuffer(self.params.buffer_size, self.params.server_lr)
        self.buffered: list[Flight] = []
        self.round_failures: dict[int, str] = {}
        self.failures_in_a_row = 0
        self.staleness_all: list[int] = []
        self.pool: ThreadPoolExecutor | None = None
        self.db: sqlite3.Connection | None = None

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="async-dispatch")
        self.db = sqlite3.connect(str(self.ctx.run.run_dir / "run.db"), timeout=30.0, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout = 30000")
        self.db.execute(SCHEMA)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, round: int) -> None:
        """Send the current model to one idle client, drawn from the stream ("async", "dispatch", n)."""
        ctx, cfg, model, home = self.ctx, self.ctx.run.cfg, self.ctx.model, self.ctx.nodes.client_home
        algorithm = ctx.run.algorithm
        busy = {f.cid for f in self.in_flight.values()}
        idle = [c for c in sorted(home) if c not in busy]
        if not idle:
            return
        self.seq += 1
        cid = idle[int(numpy_stream(cfg.run.seed, "async", "dispatch", self.seq).integers(len(idle)))]
        base = algorithm.broadcast(model.state, round)
        sent = {k: v.detach().clone() for k, v in base.tensors.items()}   # the version it trains on, kept
        message = model.client_message(Payload(tensors=dict(sent), scalars=dict(base.scalars)), round, cid)
        spec, rules = algorithm.reply_spec(model.state), algorithm.reply_scalars()
        send = Send(cid, home[cid].address, client_node(cid), Method.TRAIN, message, step=self.seq,
                    inbound=reply_chain(cfg, spec, Method.TRAIN, rules, model.reply_limits([cid]),
                                        round=round, peer=client_node(cid)),
                    who=f"dispatch {self.seq} (version {self.version}) reply of client {cid}")
        assert self.pool is not None   # made by start
        timeout = cfg.run.round_timeout
        future = self.pool.submit(ctx.fabric.send_and_receive, [send], round=round, timeout=timeout,
                                  call_timeout=cfg.run.call_timeout,
                                  timeout_reason=f"timeout: no result within run.round_timeout={timeout}s")
        seq = self.seq
        self.in_flight[seq] = Flight(seq, cid, self.version, round, sent, message.tensor_bytes(), self.sim_now, future)
        future.add_done_callback(lambda _f: self.done.put(seq))

    def fill(self, round: int) -> None:
        while len(self.in_flight) < self.concurrency and len(self.in_flight) < len(self.ctx.nodes.client_home):
            self.dispatch(round)

    # ------------------------------------------------------------------ arrivals
    def settle(self, f: Flight) -> None:
        """The call's outcome and its simulated finish time (once per flight)."""
        if f.settled:
            return
        f.settled = True
        try:
            results, failures = f.future.result()
        except Exception as exc:   # the fabric closed under it (a stop)
            results, failures = {}, {f.cid: f"call not made: {exc}"}
        f.reply = results.get(f.cid)
        f.failure = failures.get(f.cid, "" if f.reply is not None else "no reply")
        if f.reply is None:
            f.sim_finish = f.sim_start
            return
        clock = self.ctx.clock
        steps = f.reply.scalars.get("local_steps")
        timing = client_timing(f.cid, clock.profiles[f.cid], clock.params,
                               steps=int(steps) if isinstance(steps, (int, float)) else clock.planned_steps(f.cid, 0),
                               down_bytes=f.down_bytes, up_bytes=f.reply.tensor_bytes(),
                               measured_seconds=float(f.reply.scalars.get(COMPUTE_KEY, 0.0)))
        f.sim_finish = f.sim_start + timing.finish

    def _wait(self, futures: list[Future]) -> None:
        while futures:
            _, pending = wait(futures, timeout=WAIT_SLICE)
            raise_if_stopped()
            futures = list(pending)

    def next_arrival(self) -> Flight:
        """The next update to take (module docstring: simulated order or arrival order)."""
        if self.params.clock == "real":
            while True:
                try:
                    seq = self.done.get(timeout=WAIT_SLICE)
                except queue.Empty:
                    raise_if_stopped()
                    continue
                if seq in self.in_flight:
                    f = self.in_flight.pop(seq)
                    self.settle(f)
                    self.sim_now = max(self.sim_now, f.sim_finish)
                    return f
        self._wait([f.future for f in self.in_flight.values()])
        for f in self.in_flight.values():
            self.settle(f)
        f = self.in_flight.pop(min(self.in_flight.values(), key=lambda g: (g.sim_finish, g.seq)).seq)
        self.sim_now = max(self.sim_now, f.sim_finish)
        return f

    def take(self, f: Flight, round: int) -> bool:
        """Apply (FedAsync), buffer (FedBuff) or record the failure of `f`; True when the model changed."""
        self.arrivals += 1
        staleness = self.version - f.version
        row = {"arrival": self.arrivals, "staleness": staleness, "sim_arrival": f.sim_finish, "round": round}
        if f.reply is None:
            self.round_failures[f.cid] = f.failure
            self.failures_in_a_row += 1
            self._row(f, {**row, "status": "failed", "detail": f.failure})
            self.ctx.records.store.add_event("client_failed", node=client_node(f.cid), round=round,
                                     detail=f"dispatch {f.seq}: {f.failure}")
            if self.failures_in_a_row >= FAILURES_IN_A_ROW * self.concurrency:
                raise RunFailed(f"round {round}: {self.failures_in_a_row} dispatches in a row failed; last: client "
                                f"{f.cid}: {f.failure}")
            return False
        self.failures_in_a_row = 0
        p = self.params
        weight = staleness_weight(p.staleness, staleness, p.staleness_a, p.staleness_b)
        f.taken = {**row, "weight": weight}
        self.staleness_all.append(staleness)
        state = self.ctx.model.state.params
        if p.mode == "fedasync":
            fedasync_mix(state, f.sent, f.reply.tensors, p.mixing * weight)
            self.buffered = [f]
        else:
            self.buffer.add(f.reply.tensors, weight)
            self.buffered.append(f)
            if not self.buffer.ready:
                return False
            self.buffer.flush(state)
        self.version += 1
        for g in self.buffered:
            self._row(g, {**g.taken, "applied_version": self.version, "status": "applied"})
        return True

    def _row(self, f: Flight, row: dict) -> None:
        assert self.db is not None   # made by start
        self.db.execute(f"INSERT INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (self.ctx.run.run_id, row.get("arrival"), f.seq, f.cid, f.version, row.get("applied_version"),
                         row.get("staleness"), row.get("weight"), f.sim_start, row.get("sim_arrival"),
                         row.get("round"), row.get("status"), row.get("detail", "")))

    def drain(self, round: int) -> None:
        """After the last update: wait for the calls still in flight (their replies are counted
        in the ledger) and record them "unused"."""
        self._wait([f.future for f in self.in_flight.values()])
        for seq in sorted(self.in_flight):
            f = self.in_flight[seq]
            self.settle(f)
            self._row(f, {"staleness": self.version - f.version, "sim_arrival": f.sim_finish, "round": round,
                          "status": "unused" if f.reply is not None else "failed", "detail": f.failure})
        self.in_flight.clear()
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
        participants = sorted({g.cid for g in used})
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
