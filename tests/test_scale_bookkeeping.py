"""The server's bookkeeping per registered client is O(1) (issue 49, item 4: 1,000,000 registered
clients, 1,000 sampled a round): setting up the round engine and playing a round cost the same
at 1,000 and at 1,000,000 registered clients with the same number sampled.

The cost is counted in operations, not seconds (a timing would flake on a loaded machine): the
Python function calls made (`sys.setprofile`, one thread) and the bytes held (tracemalloc).  A
structure built per registered client (a dict of every client's local work, a list of every
client's device profile, a set of every id) makes both grow a thousandfold; the bounds below
leave a margin for what legitimately differs between the two runs (the sampled clients' data
sizes), far below that.
"""
from __future__ import annotations

import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.engine.heterogeneity import DeviceProfiles, DevicesParams, device_profiles
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.tasks import build_task
from fedhop.common.transport.liveness import Without, live_pool
from fedhop.deploy.bench.bench_system import _scale_text

SMALL, LARGE = 1_000, 1_000_000


def scale_config(count: int) -> str:
    """`fedhop bench scale`'s config (deploy/bench/bench_system.py) with 10 sampled a round."""
    return _scale_text(count, processes=1, per_round=10, rounds=2, batch=True)


def calls(fn: Callable[[], object]) -> Counter:
    """Python function calls made by `fn()`, by function name."""
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            seen[frame.f_code.co_name] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def held_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """`fn()` and the bytes it allocated that are still held when it returns."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def tasks():
    return {n: build_task(parse_config(scale_config(n))) for n in (SMALL, LARGE)}


def test_the_engine_is_set_up_in_the_same_calls_and_memory_at_a_million_clients(tasks):
    engines, counts, held = {}, {}, {}
    for n in (SMALL, LARGE):
        cfg = parse_config(scale_config(n))
        counts[n] = calls(lambda: RoundEngine(cfg, task=tasks[n]))
        engines[n], held[n] = held_bytes(lambda: RoundEngine(cfg, task=tasks[n]))
    small, large = sum(counts[SMALL].values()), sum(counts[LARGE].values())
    assert large <= small + 50, f"set-up made {small} calls at {SMALL} clients, {large} at {LARGE}: " \
                                f"most made: {(counts[LARGE] - counts[SMALL]).most_common(5)}"
    assert held[LARGE] <= held[SMALL] + 1_000_000, f"set-up holds {held[SMALL]} bytes at {SMALL} clients, " \
                                                   f"{held[LARGE]} at {LARGE}"
    # and what it no longer holds per client is still every client's: the last one's work and profile
    clock = engines[LARGE].clock
    assert len(clock.full_work) == LARGE and clock.full_work[LARGE - 1] == 1
    assert len(clock.profiles) == LARGE and clock.profiles[LARGE - 1].slowdown == 1.0
    with pytest.raises(KeyError):
        clock.full_work[LARGE]


def test_a_round_costs_the_same_calls_at_a_million_registered_clients(tasks):
    rounds: dict[int, Counter] = {}
    for n in (SMALL, LARGE):
        engine = RoundEngine(parse_config(scale_config(n)), task=tasks[n])
        engine.train_round(1)   # first-use set-up (the client's model) left out
        rounds[n] = calls(lambda: engine.train_round(2))
        assert len(engine.sample(2)) == 10
    small, large = sum(rounds[SMALL].values()), sum(rounds[LARGE].values())
    # 10 sampled clients either way; their data sizes differ, which moves the count by a few percent
    assert large <= 1.2 * small, f"a round made {small} calls at {SMALL} clients, {large} at {LARGE}: " \
                                 f"most made: {(rounds[LARGE] - rounds[SMALL]).most_common(5)}"


def test_drawn_profiles_are_the_eager_ones_and_cost_nothing_until_asked(tmp_path):
    """`DeviceProfiles` draws client c's profile from its own streams when asked; the list of
    `device_profiles` is the same draws in order."""
    params = DevicesParams(slowdown={"dist": "lognormal", "median": 2.0, "sigma": 0.5},
                           uplink_mbps={"dist": "classes", "values": [1.0, 10.0]}, downlink_mbps=5.0)
    lazy = DeviceProfiles(params, seed=7, count=LARGE)
    eager = device_profiles(params, seed=7, count=50)
    assert [lazy[c] for c in range(50)] == eager
    assert lazy[-1 + LARGE] == DeviceProfiles(params, seed=7, count=LARGE)[LARGE - 1]
    drawn = calls(lambda: lazy[LARGE - 2])
    assert drawn["draw_attribute"] == 3   # one draw per attribute of the one client asked for
    with pytest.raises(IndexError):
        lazy[LARGE]
    with pytest.raises(ValueError, match="per_client"):   # a wrong-length list still fails at once
        DeviceProfiles(DevicesParams(slowdown={"dist": "per_client", "values": [1.0, 2.0]}), seed=0, count=3)


class CountingHomes(dict):
    """client id -> its host, counting the look-ups."""

    looks = 0

    def __contains__(self, cid: object) -> bool:
        self.looks += 1
        return super().__contains__(cid)


def test_a_dead_nodes_clients_are_left_out_without_walking_the_pool():
    """With a node dead, `live_pool` narrows a `range` pool through that node's own clients: the
    same ids in the same order as the walked list (so the same draw), after looking up only the
    dead node's clients."""
    count, per_node = 200_000, 50_000
    nodes = {f"client-proc{k}": SimpleNamespace(node_id=f"client-proc{k}") for k in range(4)}
    hosts = {n: list(range(k * per_node, (k + 1) * per_node)) for k, n in enumerate(nodes)}
    homes = CountingHomes((c, nodes[n]) for n, ids in hosts.items() for c in ids)
    homed = Counter({n: per_node for n in nodes})
    monitor = SimpleNamespace(unavailable_nodes=lambda: {"client-proc1"})
    reported = {7, 160_001}   # an edge's report: two clients of live nodes
    walked, walked_dead = live_pool(list(range(count)), 1000, dict(homes), monitor, reported)
    homes.looks = 0
    view, dead = live_pool(range(count), 1000, homes, monitor, reported, hosts, homed)
    assert homes.looks == per_node, f"{homes.looks} look-ups for a dead node of {per_node} clients"
    assert isinstance(view, Without) and dead == walked_dead == sorted([7, *range(per_node, 2 * per_node), 160_001])
    assert len(view) == len(walked) == count - per_node - 2
    picks = np.random.default_rng(0).integers(0, len(view), 2000).tolist() + [0, 6, 7, 49_998, 49_999, len(view) - 1]
    assert [view[i] for i in picks] == [walked[i] for i in picks]
    assert view[-1] == walked[-1] and view[49_990:50_010] == walked[49_990:50_010]
    with pytest.raises(IndexError):
        view[len(view)]
    # a host list that does not account for every client homed there: the walk, the same answer
    stale = live_pool(range(count), 1000, homes, monitor, reported, hosts, Counter({**homed, "client-proc1": per_node + 1}))
    assert list(stale[0]) == walked and stale[1] == walked_dead


def test_a_hierarchical_run_of_400000_clients_registers_through_its_edges(tmp_path):
    """Two edges of 200,000 clients each, their client processes registering every client with
    them: the run completes its round, each edge's registrations are recorded, and the server
    learns every client.  An edge that checked each registered id against its cluster as a list
    spent minutes on it (200,000 x 200,000 / 2 comparisons) and the run failed its registration
    timeout; with the membership a set it takes a second."""
    import sqlite3
    import subprocess

    text = _scale_text(400_000, processes=2, per_round=10, rounds=1, batch=True).replace(
        "[clients]", '[topology]\nkind = "hierarchical"\nedges = 2\n[clients]')
    (tmp_path / "exp.toml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    db = sqlite3.connect(tmp_path / "run" / "run.db")
    registered = db.execute("SELECT detail FROM events WHERE kind = 'registered' ORDER BY node").fetchall()
    rounds = db.execute("SELECT count(*) FROM rounds").fetchone()[0]
    db.close()
    assert rounds == 1
    assert [d for (d,) in registered if "edge" in d] and all("hosting 200000 clients" in d for (d,) in registered), registered
