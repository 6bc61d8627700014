"""Straggler draws and device profiles (common/engine/heterogeneity.py) and their config keys."""
from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from fedhop.common.algorithms.base import Payload
from fedhop.common.config import ConfigError, config_to_toml, parse_config
from fedhop.common.engine.heterogeneity import (
    PLAN_KEY,
    DevicesParams,
    apply_straggler_plan,
    device_profiles,
    draw_stragglers,
    plan_to_scalar,
    straggler_count,
)
from fedhop.common.wire.codec import PayloadError
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

RNG = np.random.default_rng(3)
CENTERS = RNG.normal(0, 1, size=(8, 4))
SIZES = [10] * 8


# ----------------------------------------------------------------------------- config keys
def test_clients_keys_parse_and_round_trip():
    cfg = parse_config('[clients]\ncount = 4\nstraggler_fraction = 0.5\nstraggler_mode = "literal"\n'
                       'slowdown = {dist = "classes", values = [1.0, 3.0], probs = [0.25, 0.75]}\n'
                       'uplink_mbps = 2\ndeadline_seconds = 1.5\novercommit = 1.3')
    p = cfg.clients.params
    assert isinstance(p, DevicesParams) and p.straggler_mode == "literal" and p.uplink_mbps == 2.0
    assert p.slowdown["values"] == [1.0, 3.0] and p.overcommit == 1.3
    assert parse_config(config_to_toml(cfg)).clients.params == p


@pytest.mark.parametrize("text,fragment", [
    ('straggler_mode = "sometimes"', "clients.straggler_mode"),
    ("overcommit = 0.5", "clients.overcommit"),
    ("deadline_seconds = -1", "clients.deadline_seconds"),
    ("slowdown = 0", "clients.slowdown"),
    ('slowdown = {dist = "zipf", a = 2}', "clients.slowdown.dist"),
    ('uplink_mbps = {dist = "uniform", low = 1}', "clients.uplink_mbps.high"),
    ('uplink_mbps = {dist = "uniform", low = 3, high = 1}', "clients.uplink_mbps"),
    ('slowdown = {dist = "classes", values = [1, 2], probs = [0.5, 0.6]}', "clients.slowdown.probs"),
    ('slowdown = {dist = "lognormal", median = 1, sigma = 1, mu = 3}', "clients.slowdown.mu"),
    ('bytes_kind = "wire"', "clients.bytes_kind"),
    ("colour = 3", "clients.colour"),
])
def test_bad_device_keys_name_the_key(text, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(f"[clients]\ncount = 4\n{text}")
    assert fragment in str(err.value)


def test_straggler_fraction_needs_two_units_of_work(tmp_path):
    cfg = parse_config(quadratic_config(CENTERS, np.ones_like(CENTERS), SIZES, local_steps=1).replace(
        "[clients]", "[clients]\nstraggler_fraction = 0.5"))
    with pytest.raises(ConfigError, match="straggler_fraction"):
        run_inmemory(cfg, tmp_path)


# ----------------------------------------------------------------------------- straggler draws
@pytest.mark.parametrize("rho,k,k1", [(0.5, 10, 5), (0.25, 10, 3), (0.5, 5, 3), (0.1, 4, 0), (1.0, 7, 7)])
def test_straggler_count_is_round_half_up(rho, k, k1):
    assert straggler_count(rho, k) == k1


def test_exact_mode_matches_the_configured_distribution():
    """K1 = round(rho K) every round; each sampled client straggles with frequency rho; the
    missed epochs m = E - E_i are uniform on {1..tau_max} (chi-square, 3 dof, 99.9 % level)."""
    full = {c: 5 for c in range(50)}
    sampled = list(range(0, 50, 5))                    # the same 10 clients each round
    hits, missed = Counter(), Counter()
    rounds = 2000
    for r in range(1, rounds + 1):
        plan = draw_stragglers(7, r, sampled, 0.5, full, tau_max=0, mode="exact")
        assert len(plan) == 5 and set(plan) <= set(sampled)
        for cid, d in plan.items():
            assert d.full_work == 5 and 1 <= d.work <= 4 and d.tau == 5 - d.work + 1
            hits[cid] += 1
            missed[5 - d.work] += 1
    for cid in sampled:                                # Binomial(2000, 0.5): sd ~ 22
        assert abs(hits[cid] - rounds / 2) < 5 * math.sqrt(rounds / 4)
    n = sum(missed.values())
    chi2 = sum((missed[m] - n / 4) ** 2 / (n / 4) for m in (1, 2, 3, 4))
    assert set(missed) == {1, 2, 3, 4} and chi2 < 16.27


def test_tau_max_caps_missed_work_and_literal_mode_allows_full_work():
    full = {c: 5 for c in range(10)}
    seen_exact, seen_literal = set(), set()
    for r in range(1, 400):
        for d in draw_stragglers(1, r, list(range(10)), 0.5, full, tau_max=2, mode="exact").values():
            seen_exact.add(d.full_work - d.work)
        plan = draw_stragglers(1, r, list(range(10)), 0.5, full, tau_max=2, mode="literal")
        seen_literal.update(d.full_work - d.work for d in plan.values())
        assert len(plan) <= 5
    assert seen_exact == {1, 2}            # m ~ U{1, 2}
    assert seen_literal == {1}             # tau ~ U{1, 2}: tau = 1 is full work (left out of the plan)


def test_draws_depend_on_seed_and_round_only():
    full = {c: 4 for c in range(20)}
    a = draw_stragglers(3, 5, [1, 4, 9, 12], 0.5, full)
    assert a == draw_stragglers(3, 5, [12, 9, 4, 1], 0.5, full)      # order of the sample is irrelevant
    assert any(draw_stragglers(3, r, [1, 4, 9, 12], 0.5, full) != a for r in range(6, 12))
    assert any(draw_stragglers(s, 5, [1, 4, 9, 12], 0.5, full) != a for s in range(4, 10))


# ----------------------------------------------------------------------------- client side
def _ctx(cid=3, steps=0, epochs=5):
    return SimpleNamespace(client_id=cid, local_steps=steps, local_epochs=epochs, info={})


def test_apply_plan_cuts_epochs_or_steps():
    msg = Payload(scalars={PLAN_KEY: '{"3":2,"7":1}'})
    ctx = _ctx()
    apply_straggler_plan(ctx, msg)
    assert ctx.local_epochs == 2 and ctx.info == {"straggler": True, "work": 2, "full_work": 5, "tau": 4}
    ctx = _ctx(cid=7, steps=6)
    apply_straggler_plan(ctx, msg)
    assert ctx.local_steps == 1 and ctx.local_epochs == 5 and ctx.info["tau"] == 6
    ctx = _ctx(cid=4)
    apply_straggler_plan(ctx, msg)
    assert ctx.local_epochs == 5 and ctx.info["straggler"] is False and ctx.info["tau"] == 1
    ctx = _ctx()
    apply_straggler_plan(ctx, Payload())
    assert ctx.local_epochs == 5 and ctx.info == {}


@pytest.mark.parametrize("raw", ['{"3":5}', '{"3":0}', '{"3":"2"}', "[1]", "not json"])
def test_apply_plan_rejects_bad_plans(raw):
    with pytest.raises(PayloadError):
        apply_straggler_plan(_ctx(), Payload(scalars={PLAN_KEY: raw}))


def test_plan_scalar_is_compact_json():
    plan = draw_stragglers(0, 1, [2, 5, 11, 13], 0.5, {c: 5 for c in range(14)})
    text = plan_to_scalar(plan)
    assert " " not in text and len(text) < 20
    ctx = _ctx(cid=next(iter(plan)))
    apply_straggler_plan(ctx, Payload(scalars={PLAN_KEY: text}))
    assert ctx.local_epochs == plan[ctx.client_id].work


# ----------------------------------------------------------------------------- device profiles
def test_profiles_from_distributions_and_lists():
    p = DevicesParams(slowdown={"dist": "classes", "values": [1.0, 4.0], "probs": [0.8, 0.2]},
                      uplink_mbps={"dist": "per_client", "values": [float(i + 1) for i in range(400)]},
                      downlink_mbps={"dist": "pareto", "shape": 3.0, "scale": 2.0})
    profs = device_profiles(p, seed=0, count=400)
    slow = sum(pr.slowdown == 4.0 for pr in profs)
    assert all(pr.slowdown in (1.0, 4.0) for pr in profs)
    assert abs(slow - 80) < 5 * math.sqrt(400 * 0.8 * 0.2)
    assert [pr.uplink_mbps for pr in profs] == [float(i + 1) for i in range(400)]
    down = np.array([pr.downlink_mbps for pr in profs])
    assert down.min() >= 2.0 and abs(np.median(down) - 2.0 * 2 ** (1 / 3)) < 0.15  # Pareto median x_m 2^(1/a)
    assert device_profiles(p, seed=0, count=400) == profs and device_profiles(p, seed=1, count=400) != profs


def test_per_client_list_must_match_count():
    p = DevicesParams(slowdown={"dist": "per_client", "values": [1.0, 2.0]})
    with pytest.raises(ValueError, match="clients.slowdown"):
        device_profiles(p, seed=0, count=3)


def test_trace_file_by_row_and_by_client_column(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("slowdown,uplink_mbps\n1.5,10\n3.0,2\n")
    profs = device_profiles(DevicesParams(trace=str(path), downlink_mbps=7.0), seed=0, count=5)
    assert [p.slowdown for p in profs] == [1.5, 3.0, 1.5, 3.0, 1.5]
    assert [p.uplink_mbps for p in profs] == [10, 2, 10, 2, 10] and all(p.downlink_mbps == 7.0 for p in profs)
    path.write_text("client,slowdown\n1,2.0\n0,5.0\n")
    profs = device_profiles(DevicesParams(trace=str(path)), seed=0, count=2)
    assert [p.slowdown for p in profs] == [5.0, 2.0]
    with pytest.raises(ValueError, match="no row for clients"):
        device_profiles(DevicesParams(trace=str(path)), seed=0, count=3)
    path.write_text("client,speed\n0,1\n")
    with pytest.raises(ValueError, match="clients.trace"):
        device_profiles(DevicesParams(trace=str(path)), seed=0, count=1)


# ----------------------------------------------------------------------------- in a run
def _straggler_run(tmp_path, algorithm, extra=""):
    text = quadratic_config(CENTERS, np.ones_like(CENTERS), SIZES, rounds=6, local_steps=6, lr=0.05,
                            per_round=4, algorithm=algorithm, extra_algorithm=extra, seed=11)
    cfg = parse_config(text.replace("[clients]", "[clients]\nstraggler_fraction = 0.5"))
    summary, coord = run_inmemory(cfg, tmp_path / algorithm)
    assert summary["status"] == "completed", summary["error"]
    return coord


def test_straggler_pattern_is_identical_across_algorithms_and_clients_obey_it(tmp_path):
    runs = {a: _straggler_run(tmp_path, a) for a in ("fedavg", "fedlga", "feddyn")}
    plans = {a: c.clock.plans for a, c in runs.items()}
    assert plans["fedavg"] == plans["fedlga"] == plans["feddyn"]
    assert all(len(p) == 2 for p in plans["fedavg"].values())      # round(0.5 * 4) per round
    assert len({tuple(sorted(p)) for p in plans["fedavg"].values()}) > 1
    for coord in runs.values():
        for r, s in coord.clock.settlements.items():
            for cid, t in s.timings.items():    # steps the clients report = the plan (6 if not a straggler)
                draw = coord.clock.plans[r].get(cid)
                assert t.steps == (draw.work if draw else 6)
