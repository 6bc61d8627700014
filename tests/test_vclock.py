"""Virtual clock, deadline cut-off and over-commitment (common/engine/vclock.py) in real in-memory runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.heterogeneity import DeviceProfile, DevicesParams, device_profiles
from fedhop.common.engine.vclock import client_timing, settle, transfer_seconds
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import numpy_fedavg_round, quadratic_config


def _config(count, per_round, clients_extra, *, dim=1000, rounds=2, steps=10, seed=0, algorithm="fedavg"):
    return parse_config(f"""
[run]
name = "vclock"
seed = {seed}
rounds = {rounds}
[algorithm]
name = "{algorithm}"
lr = 0.1
local_steps = {steps}
batch_size = 0
[data]
dataset = "quadratic"
dim = {dim}
[clients]
count = {count}
per_round = {per_round}
processes = 2
{clients_extra}
[transport]
kind = "inmemory"
""")


# ----------------------------------------------------------------------------- pure functions
def test_transfer_seconds_and_unlimited_links():
    assert transfer_seconds(1_000_000, 8.0) == pytest.approx(1.0)        # 8 Mbit over 8 Mbit/s
    assert transfer_seconds(1_000_000, 0.0) == 0.0                       # 0 = unlimited
    assert transfer_seconds(125, 1.0, latency=0.5) == pytest.approx(0.501)


def test_settle_deadline_and_overcommit_by_hand():
    p = DevicesParams(step_seconds=0.1)
    t = {c: client_timing(c, DeviceProfile(slowdown=s), p, steps=2, down_bytes=0, up_bytes=0)
         for c, s in {0: 1.0, 1: 4.0, 2: 2.0, 3: 3.0, 4: 2.0}.items()}  # finish 0.2, 0.8, 0.4, 0.6, 0.4
    s = settle(t, target=3)
    assert s.kept == [0, 2, 4] and set(s.cut) == {1, 3} and s.sim_seconds == pytest.approx(0.4)
    s = settle(t, target=5, deadline=0.5)
    assert s.kept == [0, 2, 4] and set(s.cut) == {1, 3} and s.sim_seconds == 0.5   # waited out the deadline
    assert all(why.startswith("deadline") for why in s.cut.values())
    s = settle(t, target=2, deadline=0.5)                 # ties at 0.4 broken by id; round ends at 2nd finish
    assert s.kept == [0, 2] and s.cut[4].startswith("overcommit") and s.sim_seconds == pytest.approx(0.4)
    s = settle(t, target=5, deadline=0.1)
    assert s.kept == [] and len(s.cut) == 5 and s.sim_seconds == 0.1


# ----------------------------------------------------------------------------- hand-computed round
HAND = """
slowdown = {dist = "per_client", values = [1.0, 1.0, 3.0, 3.0]}
uplink_mbps = {dist = "per_client", values = [1.0, 8.0, 1.0, 8.0]}
downlink_mbps = {dist = "per_client", values = [2.0, 16.0, 2.0, 16.0]}
step_seconds = 0.01
bytes_kind = "tensor"
"""


def test_round_time_matches_hand_computation(tmp_path):
    """Two speed classes (1x, 3x), two bandwidth classes, 10 steps, d = 1000 floats each way:
    request and reply are 4000 tensor bytes = 32,000 bits.
      client 0: 32e3/2e6 + 10*0.01*1 + 32e3/1e6 = 0.016 + 0.1 + 0.032 = 0.148
      client 1: 32e3/16e6 + 0.1 + 32e3/8e6      = 0.002 + 0.1 + 0.004 = 0.106
      client 2: 0.016 + 0.3 + 0.032 = 0.348;   client 3: 0.002 + 0.3 + 0.004 = 0.306
    round = slowest = 0.348 s."""
    summary, coord = run_inmemory(_config(4, 4, HAND), tmp_path)
    assert summary["status"] == "completed"
    finish = {c: t.finish for c, t in coord.clock.settlements[1].timings.items()}
    assert finish == pytest.approx({0: 0.148, 1: 0.106, 2: 0.348, 3: 0.306}, abs=1e-12)
    rows = RunStore(tmp_path / "run.db").rounds()
    assert [r["sim_seconds"] for r in rows] == pytest.approx([0.348, 0.348], abs=1e-12)
    assert rows[0]["metrics"]["sim_compute_seconds"] == pytest.approx(0.3)
    assert rows[0]["metrics"]["sim_comm_seconds"] == pytest.approx(0.048)


def test_framed_bytes_come_from_the_ledger(tmp_path):
    """bytes_kind = "framed": the clock uses the measured framed bytes of each client's messages."""
    summary, coord = run_inmemory(_config(4, 4, HAND.replace('"tensor"', '"framed"'), rounds=1), tmp_path)
    msgs = RunStore(tmp_path / "run.db").messages()
    for cid, t in coord.clock.settlements[1].timings.items():
        down = [m["framed_bytes"] for m in msgs if m["method"] == "train" and m["dst"] == f"client-{cid}"
                and m["role"] == "sender"]      # each message has a sender and a receiver record
        up = [m["framed_bytes"] for m in msgs if m["method"] == "train.reply" and m["src"] == f"client-{cid}"
              and m["role"] == "sender"]
        assert [t.down_bytes] == down and [t.up_bytes] == up and t.down_bytes > 4000 and t.up_bytes > 4000


# ----------------------------------------------------------------------------- deadline
def test_deadline_drops_exactly_the_late_clients(tmp_path):
    """Random device speeds and bandwidths; a deadline between the fast and slow ones.  Every
    round's finish times are recomputed here from run.db's messages and the profiles, and the
    dropped set must be exactly {finish > deadline}; the dropped are recorded as events."""
    extra = """
slowdown = {dist = "lognormal", median = 1.0, sigma = 0.6}
uplink_mbps = {dist = "classes", values = [0.5, 5.0]}
downlink_mbps = 4.0
step_seconds = 0.01
latency_seconds = 0.002
deadline_seconds = 0.13
"""
    cfg = _config(12, 6, extra, rounds=5, dim=500)
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed"
    store = RunStore(tmp_path / "run.db")
    msgs = [m for m in store.messages() if m["role"] == "sender"]   # one record per message
    profiles = device_profiles(cfg.clients.params, cfg.run.seed, 12)
    events = store.events("deadline_missed")
    dropped_total = 0
    for result in coord.history:
        finish = {}
        for cid in result.sampled:
            down = sum(m["framed_bytes"] for m in msgs if m["round"] == result.round and m["method"] == "train"
                       and m["dst"] == f"client-{cid}")
            up = sum(m["framed_bytes"] for m in msgs if m["round"] == result.round and m["method"] == "train.reply"
                     and m["src"] == f"client-{cid}")
            pr = profiles[cid]
            finish[cid] = (0.002 + down * 8 / (4.0 * 1e6) + 10 * 0.01 * pr.slowdown
                           + 0.002 + up * 8 / (pr.uplink_mbps * 1e6))
        late = {c for c, f in finish.items() if f > 0.13}
        assert set(coord.clock.settlements[result.round].cut) == late
        assert result.participants == sorted(set(result.sampled) - late)
        assert sorted(e["node"] for e in events if e["round"] == result.round) == sorted(f"client-{c}" for c in late)
        dropped_total += len(late)
        rounds_row = next(r for r in store.rounds() if r["round"] == result.round)
        assert rounds_row["participants"] == len(result.participants)
    assert 0 < dropped_total < 5 * 6                   # the deadline cut some, not all


def test_deadline_cut_clients_do_not_enter_the_model(tmp_path):
    """Odd clients are 3x slower; a deadline between the classes leaves FedAvg over the even ones."""
    rng = np.random.default_rng(5)
    centers, curv, sizes = rng.normal(0, 2, size=(6, 3)), rng.uniform(0.5, 2, size=(6, 3)), [5, 8, 13, 2, 7, 9]
    text = quadratic_config(centers, curv, sizes, rounds=4, local_steps=5, lr=0.1, per_round=4)
    text = text.replace("[clients]", '[clients]\nslowdown = {dist = "per_client", values = [1.0, 3.0, 1.0, 3.0, '
                                     '1.0, 3.0]}\nstep_seconds = 0.01\ndeadline_seconds = 0.1\nbytes_kind = "tensor"')
    summary, coord = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed"
    w = np.zeros(3)
    for result in coord.history:
        assert result.participants == [c for c in result.sampled if c % 2 == 0]
        assert result.sim_seconds == 0.1 if any(c % 2 for c in result.sampled) else result.sim_seconds < 0.1
        w = numpy_fedavg_round(w, centers, curv, sizes, result.participants, 5, 0.1, 1.0)
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- over-commitment
def test_overcommit_samples_more_and_keeps_the_first_to_finish(tmp_path):
    extra = """
overcommit = 1.5
slowdown = {dist = "per_client", values = [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.5, 2.5]}
step_seconds = 0.01
"""
    summary, coord = run_inmemory(_config(8, 4, extra, rounds=4, dim=4), tmp_path)
    assert summary["status"] == "completed"
    slow = [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.5, 2.5]
    store = RunStore(tmp_path / "run.db")
    for result in coord.history:
        assert len(result.sampled) == 6                                # ceil(1.5 * 4)
        fastest = sorted(result.sampled, key=lambda c: slow[c])[:4]
        assert result.participants == sorted(fastest)
        assert result.sim_seconds == pytest.approx(max(slow[c] for c in fastest) * 10 * 0.01, rel=1e-3)
        dropped = [e["node"] for e in store.events("overcommit_dropped") if e["round"] == result.round]
        assert sorted(dropped) == sorted(f"client-{c}" for c in set(result.sampled) - set(fastest))
    assert len({tuple(r.sampled) for r in coord.history}) > 1


def test_sleep_scale_makes_wall_time_track_simulated_time(tmp_path):
    extra = "step_seconds = 0.02\nsleep_scale = 1.0"
    summary, coord = run_inmemory(_config(3, 3, extra, rounds=2, dim=4), tmp_path)
    for result in coord.history:
        assert result.sim_seconds == pytest.approx(0.2)                # 10 steps * 0.02 s
        assert result.wall_seconds >= 0.2


def test_the_clock_keeps_the_latest_rounds_plans_and_settlements(tmp_path):
    """RoundClock keeps KEPT_ROUNDS rounds' straggler plans and settlements (one entry per
    sampled client each): after more rounds, the latest ones, each with the round's own
    participants and stragglers; a round set again counts as the newest."""
    from fedhop.common.engine.vclock import KEPT_ROUNDS, _keep

    rounds = KEPT_ROUNDS + 6
    cfg = _config(8, 4, "straggler_fraction = 0.5", dim=10, rounds=rounds, steps=4)
    _, coord = run_inmemory(cfg, tmp_path)
    kept = list(range(rounds - KEPT_ROUNDS + 1, rounds + 1))
    assert list(coord.clock.settlements) == kept and list(coord.clock.plans) == kept
    for result in coord.history:
        if result.round in coord.clock.settlements:
            assert sorted(coord.clock.settlements[result.round].timings) == result.participants
            assert len(coord.clock.plans[result.round]) == 2   # half of the 4 sampled straggle
    by_round = {r: r for r in range(1, KEPT_ROUNDS + 1)}
    _keep(by_round, 1, "again")   # a retried round: newest, so the next eviction takes round 2
    _keep(by_round, KEPT_ROUNDS + 1, "next")
    assert len(by_round) == KEPT_ROUNDS and 2 not in by_round and by_round[1] == "again"


@pytest.mark.parametrize("reported", [2 ** 62, 0, 1, None])
def test_a_reply_is_timed_by_its_plan_whatever_steps_it_reports(tmp_path, monkeypatch, reported):
    """A client's reply is timed by the local steps planned for it (its straggler plan's), never
    by the `local_steps` it reports (red team): 2^62 would make the simulated round (and the real
    sleep of clients.sleep_scale) last for ever; 0 or 1 would make a participant finish first,
    so that it is always kept under over-commitment and never misses the deadline."""
    from fedhop.common.algorithms.fedavg import FedAvg
    original = FedAvg.client_update

    def reporting(self, ctx, message):
        reply = original(self, ctx, message)
        if reported is None:
            del reply.scalars["local_steps"]
        else:
            reply.scalars["local_steps"] = reported
        return reply

    monkeypatch.setattr(FedAvg, "client_update", reporting)
    cfg = _config(4, 2, "straggler_fraction = 0.5\nstep_seconds = 0.01", dim=10, rounds=3, steps=6)
    _, coord = run_inmemory(cfg, tmp_path)
    clock = coord.clock
    timed = 0
    for result in coord.history:
        for cid, timing in clock.settlements[result.round].timings.items():
            planned = clock.planned_steps(cid, result.round)
            assert 1 <= planned <= 6 and timing.steps == planned
            assert timing.compute_seconds == pytest.approx(planned * 0.01 * clock.profiles[cid].slowdown, rel=1e-12)
            timed += 1
    assert timed == 3 * 2 and any(len(clock.plans[r.round]) for r in coord.history)


def test_a_client_reporting_no_work_is_not_kept_first_under_overcommitment(tmp_path, monkeypatch):
    """The slowest client (slowdown 6) reports 0 local steps: it is still timed by its plan, so the
    rounds keep the same clients as an honest run (timed by the report it would finish first and
    always be kept, never cut as the slowest)."""
    from fedhop.common.algorithms.fedavg import FedAvg
    extra = """
overcommit = 1.5
slowdown = {dist = "per_client", values = [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.5, 2.5]}
step_seconds = 0.01
"""
    _, honest = run_inmemory(_config(8, 4, extra, rounds=6, dim=4), tmp_path / "honest")
    original = FedAvg.client_update

    def idle_claim(self, ctx, message):
        reply = original(self, ctx, message)
        if ctx.client_id == 0:
            reply.scalars["local_steps"] = 0
        return reply

    monkeypatch.setattr(FedAvg, "client_update", idle_claim)
    _, lying = run_inmemory(_config(8, 4, extra, rounds=6, dim=4), tmp_path / "lying")
    assert [r.participants for r in lying.history] == [r.participants for r in honest.history]
    assert any(0 in r.sampled for r in lying.history) and all(0 not in r.participants for r in lying.history)


@pytest.mark.parametrize("dataset", ["femnist", "cifar10", "crossdevice", "digits"])
def test_the_servers_clock_plans_a_clients_epochs_without_reading_its_data(tmp_path, monkeypatch, dataset):
    """Epochs of local work (`local_steps = 0`): the server times each reply by the client's
    planned steps, local_epochs x ceil(rows / batch_size), and counts the rows from the task's
    index (`Task.num_rows`), never by reading or making the client's data: a LEAF or CIFAR
    server would otherwise read every sampled client's records and keep them."""
    import math

    from fedhop.common.engine.vclock import RoundClock
    from fedhop.common.tasks import build_task
    from fedhop.common.tasks.classification import ArrayTask
    from fedhop.common.tasks.placed import PlacedTask
    from tests.helpers import data_set_config
    from tests.test_cifar import _stage_cifar10
    from tests.test_leaf import _stage_femnist

    epochs, batch = 3, 4
    if dataset == "femnist":
        _stage_femnist(tmp_path / "data" / "femnist")
    elif dataset == "cifar10":
        _stage_cifar10(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    count = {"femnist": 9, "cifar10": 6, "crossdevice": 50, "digits": 20}[dataset]
    partition = {"femnist": "natural", "crossdevice": "iid"}.get(dataset, "dirichlet")
    data = "size_mean = 2.5\nsize_sigma = 1.0\nsize_min = 3\nsize_max = 40\n" if dataset == "crossdevice" else ""
    cfg = parse_config(data_set_config(dataset, partition, count, seed=3, kind="mlp", extra=data + f"""
[algorithm]
name = "fedavg"
local_epochs = {epochs}
batch_size = {batch}
"""))
    task = build_task(cfg)
    clock = RoundClock(cfg, task)
    built: list[int] = []
    real = task.client_data

    def counted(cid):
        built.append(cid)
        return real(cid)

    monkeypatch.setattr(task, "client_data", counted)
    planned = [clock.planned_steps(cid, 1) for cid in range(count)]
    on_device = RoundClock(cfg, PlacedTask(task, torch.device("cpu")))   # a task wrapped for a device
    assert [on_device.planned_steps(cid, 1) for cid in range(count)] == planned
    assert built == []                                             # no client's data was read or made
    rows = [int(real(cid).tensors[0].shape[0]) for cid in range(count)]   # now read, to compare
    assert len(set(rows)) > 1 and min(rows) > 2
    assert planned == [epochs * math.ceil(n / min(batch, n)) for n in rows]

    if isinstance(task, ArrayTask):   # a subclass that makes its clients' data itself is asked through it
        class FirstTwoRows(type(task)):  # type: ignore[misc, valid-type]
            def client_data(self, cid):
                data = super().client_data(cid)
                return type(data)(tensors=tuple(t[:2] for t in data.tensors), num_samples=2)

        monkeypatch.delattr(task, "client_data")
        task.__class__ = FirstTwoRows
        assert [clock.planned_steps(cid, 1) for cid in range(count)] == [epochs * 1] * count   # 2 rows, batch 4
