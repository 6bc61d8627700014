"""Virtual clock, deadline and over-commitment (FedScale / Plato style, see research/anchors.md).

Per round and per participant i (star topology; the server's own ledger has every message):

    down_i    = latency + request bytes_i * 8 / (downlink_i * 1e6)       (0 if unlimited)
    compute_i = local steps_i * step_seconds * slowdown_i                (compute_time = "steps")
              | measured local-solver seconds_i * slowdown_i             (compute_time = "measured")
    up_i      = latency + reply bytes_i * 8 / (uplink_i * 1e6)
    finish_i  = down_i + compute_i + up_i

The bytes are the ones the ledger *measured* for that client's `train` request and reply
(`clients.bytes_kind`: framed = payload + gRPC framing, payload, or tensor).  Steps are the
client's planned work (its straggler plan's, else its full local work), never the `local_steps`
its reply reports: a participant that reported fewer steps would finish earlier on the clock and
so always be kept under over-commitment and never miss the deadline, and one that reported more
would stretch the round (and the real sleep of `sleep_scale`).

Settling a round: results whose finish exceeds `clients.deadline_seconds` are dropped; with
over-commitment (ceil(c * S) sampled) only the first S by finish time (ties: lower id) are kept.
The round's simulated time is the finish of the slowest kept participant, or the deadline when
fewer than S results arrived in time and the deadline cut someone (the server waited it out).
Server-side aggregation and evaluation take no simulated time.  With `clients.sleep_scale` > 0
the server sleeps so the round's wall time is at least sleep_scale * simulated time.

Hierarchical rounds get the straggler plan but no simulated time yet (the client-edge bytes live
in the edges' ledgers): `sim_seconds` is left empty there (docs/heterogeneity.md).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fedhop.common.config.schema import Config, ConfigError, client_local_steps, resolve_clients_per_round
from fedhop.common.engine.heterogeneity import (
    PLAN_KEY,
    DeviceProfile,
    DeviceProfiles,
    DevicesParams,
    StragglerDraw,
    devices_params,
    draw_stragglers,
    plan_to_scalar,
)
from fedhop.common.numerics.sampling import steps_per_epoch
from fedhop.common.tasks.base import client_rows
from fedhop.common.util.procexit import sleep_stoppable
from fedhop.common.wire.message import COMPUTE_KEY, Payload
from fedhop.common.wire.methods import Method

log = logging.getLogger("fedhop.vclock")

BYTE_COLUMN = {"framed": "framed_bytes", "payload": "payload_bytes", "tensor": "tensor_bytes"}
KEPT_ROUNDS = 64   # rounds whose straggler plan and settlement RoundClock keeps


def _keep(by_round: dict[int, Any], round: int, value: Any) -> None:
    """by_round[round] = value, dropping the entries set longest ago beyond KEPT_ROUNDS."""
    by_round.pop(round, None)   # a round set again (a retry) counts as the newest
    by_round[round] = value
    while len(by_round) > KEPT_ROUNDS:
        del by_round[next(iter(by_round))]


def transfer_seconds(nbytes: int, mbps: float, latency: float = 0.0) -> float:
    """Seconds to move `nbytes` over a `mbps` megabit/s link (0 = unlimited), plus latency."""
    return latency + (nbytes * 8.0 / (mbps * 1e6) if mbps > 0 else 0.0)


@dataclass(frozen=True)
class ClientTiming:
    """One participant's simulated round: download, local compute, upload (seconds)."""

    client: int
    steps: int
    down_bytes: int
    up_bytes: int
    down_seconds: float
    compute_seconds: float
    up_seconds: float

    @property
    def finish(self) -> float:
        return self.down_seconds + self.compute_seconds + self.up_seconds


def client_timing(client: int, profile: DeviceProfile, params: DevicesParams, *, steps: int,
                  down_bytes: int, up_bytes: int, measured_seconds: float = 0.0) -> ClientTiming:
    if params.compute_time == "measured":
        compute = measured_seconds * profile.slowdown
    else:
        compute = steps * params.step_seconds * profile.slowdown
    return ClientTiming(client=client, steps=steps, down_bytes=down_bytes, up_bytes=up_bytes,
                        down_seconds=transfer_seconds(down_bytes, profile.downlink_mbps, params.latency_seconds),
                        compute_seconds=compute,
                        up_seconds=transfer_seconds(up_bytes, profile.uplink_mbps, params.latency_seconds))


@dataclass
class Settlement:
    """Which results a round keeps, which it cuts and why, and its simulated duration."""

    timings: dict[int, ClientTiming] = field(default_factory=dict)
    kept: list[int] = field(default_factory=list)
    cut: dict[int, str] = field(default_factory=dict)       # client -> "deadline: ..." | "overcommit: ..."
    sim_seconds: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def settle(timings: Mapping[int, ClientTiming], target: int, deadline: float = 0.0) -> Settlement:
    """Apply the deadline and over-commitment to a round's timings (see the module docstring)."""
    order = sorted(timings, key=lambda c: (timings[c].finish, c))
    cut: dict[int, str] = {}
    if deadline > 0:
        for c in order:
            if timings[c].finish > deadline:
                cut[c] = f"deadline: simulated finish {timings[c].finish:.6g}s > clients.deadline_seconds={deadline:g}"
    in_time = [c for c in order if c not in cut]
    for rank, c in enumerate(in_time[target:], start=target + 1):
        cut[c] = (f"overcommit: finished {rank}th at {timings[c].finish:.6g}s; the first {target} "
                  f"(clients.per_round) are kept")
    kept = in_time[:target]
    if not kept:
        sim = deadline if cut else None
    elif len(kept) < target and any(why.startswith("deadline") for why in cut.values()):
        sim = deadline
    else:
        sim = max(timings[c].finish for c in kept)
    return Settlement(timings=dict(timings), kept=sorted(kept), cut=cut, sim_seconds=sim)


def message_bytes(records: Iterable[Any], round: int, kind: str = "framed") -> dict[int, list[int]]:
    """client -> [request bytes, reply bytes] of its `train` call in `round`, from the server's
    ledger records (the sender record of the request, the receiver record of the reply)."""
    column = BYTE_COLUMN[kind]
    train, reply = str(Method.TRAIN), str(Method.TRAIN.reply())
    out: dict[int, list[int]] = {}
    for r in records:
        if r.round != round or r.status != "ok":
            continue
        if r.role == "sender" and r.method == train and r.dst.startswith("client-"):
            out.setdefault(int(r.dst.split("-", 1)[1]), [0, 0])[0] += int(getattr(r, column))
        elif r.role == "receiver" and r.method == reply and r.src.startswith("client-"):
            out.setdefault(int(r.src.split("-", 1)[1]), [0, 0])[1] += int(getattr(r, column))
    return out


class FullWork(Mapping[int, int]):
    """Client id -> its units of local work in a full round (algorithm.local_steps, or
    algorithm.local_epochs where that is 0), read from the config when asked: nothing is held
    per registered client."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def __getitem__(self, cid: int) -> int:
        if not 0 <= cid < self.cfg.clients.count:
            raise KeyError(cid)
        return client_local_steps(self.cfg, cid) or self.cfg.algorithm.local_epochs

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.cfg.clients.count))

    def __len__(self) -> int:
        return self.cfg.clients.count

    def below(self, units: int) -> list[int]:
        """The clients with fewer than `units` units, in id order (one look where every client
        has the same local work)."""
        if isinstance(self.cfg.algorithm.local_steps, list):
            return [c for c in self if self[c] < units]
        return list(self) if self.cfg.clients.count and self[0] < units else []


class RoundClock:
    """The coordinator's heterogeneity hooks: sample size, straggler plan, settling a round.

    Keeps the plan and the settlement of the latest KEPT_ROUNDS rounds (`plans`, `settlements`)
    so tests and tools can check them: one entry per sampled client each, about 350 kB a round
    at 1,000 sampled, which every round of a long run would add up to gigabytes.
    """

    def __init__(self, cfg: Config, task: Any) -> None:
        self.cfg = cfg
        self.task = task
        self.params = devices_params(cfg)
        self.rho = float(cfg.clients.straggler_fraction)
        self.target = resolve_clients_per_round(cfg)
        self.full_work = FullWork(cfg)
        if self.rho > 0:
            short = self.full_work.below(2)
            if short:
                raise ConfigError(f"config key 'clients.straggler_fraction' = {self.rho} needs at least 2 units of "
                                  f"local work per client (algorithm.local_epochs or local_steps); clients "
                                  f"{short[:10]} have {self.full_work[short[0]]}")
        try:
            self.profiles: Sequence[DeviceProfile] = DeviceProfiles(self.params, cfg.run.seed, cfg.clients.count)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.plans: dict[int, dict[int, StragglerDraw]] = {}
        self.settlements: dict[int, Settlement] = {}

    # -- before the round ----------------------------------------------------------
    def sample_size(self, target: int) -> int:
        """ceil(overcommit * S), at most clients.count."""
        return min(self.cfg.clients.count, math.ceil(self.params.overcommit * target - 1e-9))

    def begin_round(self, round: int, sampled: list[int], message: Payload) -> Payload:
        """Draw the round's straggler plan and add it to the broadcast message (if any)."""
        plan = draw_stragglers(self.cfg.run.seed, round, sampled, self.rho, self.full_work,
                               self.params.straggler_tau_max, self.params.straggler_mode) if self.rho > 0 else {}
        _keep(self.plans, round, plan)
        if not plan:
            return message
        return Payload(tensors=message.tensors, scalars={**message.scalars, PLAN_KEY: plan_to_scalar(plan)})

    # -- after the results are in -----------------------------------------------------
    def planned_steps(self, cid: int, round: int) -> int:
        draw = self.plans.get(round, {}).get(cid)
        work = draw.work if draw is not None else self.full_work[cid]
        if client_local_steps(self.cfg, cid) > 0:
            return work
        return work * steps_per_epoch(client_rows(self.task, cid), self.cfg.algorithm.batch_size)

    def settle(self, round: int, message: Payload, results: dict[int, Payload],
               records: Iterable[Any], star: bool = True) -> Settlement:
        """Time every result, cut the late/surplus ones out of `results` (in place)."""
        plan = self.plans.get(round, {})
        if not star:  # hierarchical: per-client bytes are not visible here (module docstring)
            s = Settlement(metrics={"stragglers": float(len(plan))})
            _keep(self.settlements, round, s)
            return s
        measured = message_bytes(records, round, self.params.bytes_kind)
        timings = {}
        for cid, reply in results.items():
            steps = self.planned_steps(cid, round)   # not the reply's `local_steps` (module docstring)
            if cid in measured:
                down, up = measured[cid]
            else:  # no per-client ledger record (torch collectives): the tensors' own bytes
                down, up = message.tensor_bytes(), reply.tensor_bytes()
            timings[cid] = client_timing(cid, self.profiles[cid], self.params, steps=steps, down_bytes=down,
                                         up_bytes=up, measured_seconds=float(reply.scalars.get(COMPUTE_KEY, 0.0)))
        s = settle(timings, self.target, self.params.deadline_seconds)
        for cid in s.cut:
            results.pop(cid, None)
        kept = [timings[c] for c in s.kept]
        s.metrics = {
            "stragglers": float(len(plan)),
            "sim_compute_seconds": max((t.compute_seconds for t in kept), default=0.0),
            "sim_comm_seconds": max((t.down_seconds + t.up_seconds for t in kept), default=0.0),
            "dropped_deadline": float(sum(why.startswith("deadline") for why in s.cut.values())),
            "dropped_overcommit": float(sum(why.startswith("overcommit") for why in s.cut.values())),
        }
        _keep(self.settlements, round, s)
        return s

    def emulate(self, sim_seconds: float | None, elapsed: float) -> None:
        """Optional real sleep so the round's wall time tracks the simulated one."""
        if self.params.sleep_scale > 0 and sim_seconds:
            left = sim_seconds * self.params.sleep_scale - elapsed
            if left > 0:
                sleep_stoppable(left)   # a stop signal ends it (common/util/procexit.py)
