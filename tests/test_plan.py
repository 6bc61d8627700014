"""The process plan (common/topologies/plan.py): one rule for which processes a config starts.

- the launcher, the hosts launcher, compose's layout, netsim's default hosts and the in-memory
  cluster all start the plan's processes;
- a topology can register its own plan.
"""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.topologies.plan import (
    Placement,
    PlannedProcess,
    ProcessPlan,
    plan_processes,
    register_plan,
    star_plan,
)
from tests.helpers import quadratic_config

RNG = np.random.default_rng(5)


# ----------------------------------------------------------------------------- the plan itself
def star_text(count=5, processes=2, topology='kind = "star"'):
    c = RNG.normal(0, 1, size=(count, 2))
    return quadratic_config(c, np.ones_like(c), [2] * count, processes=processes, topology=topology)


def test_star_plan_is_contiguous_blocks_under_the_server():
    plan = plan_processes(parse_config(star_text(count=5, processes=2)))
    assert [(p.node_id, p.kind, p.parent, p.clients) for p in plan.processes] == [
        ("server", "server", None, ()),
        ("client-proc0", "client", "server", (0, 1, 2)),
        ("client-proc1", "client", "server", (3, 4))]
    assert plan.edges == () and plan.server.node_id == "server"
    # more processes than clients: one client each
    assert [p.clients for p in plan_processes(parse_config(star_text(count=3, processes=8))).clients] == \
        [(0,), (1,), (2,)]


def test_chain_plan_is_the_star_plan():
    chain = plan_processes(parse_config(star_text(count=4, processes=2, topology='kind = "chain"')))
    star = plan_processes(parse_config(star_text(count=4, processes=2)))
    assert chain == star


def test_hierarchical_plan_splits_each_cluster_over_its_share_of_processes():
    text = star_text(count=6, processes=4, topology='kind = "hierarchical"\nedges = 2')
    plan = plan_processes(parse_config(text))
    assert [(e.node_id, e.parent, e.clients) for e in plan.edges] == [("edge-0", "server", (0, 1, 2)),
                                                                      ("edge-1", "server", (3, 4, 5))]
    # processes // edges = 2 per edge: (0,1),(2) under edge-0, (3,4),(5) under edge-1
    assert [(p.node_id, p.parent, p.clients, p.edge) for p in plan.clients] == [
        ("client-proc0", "edge-0", (0, 1), 0), ("client-proc1", "edge-0", (2,), 0),
        ("client-proc2", "edge-1", (3, 4), 1), ("client-proc3", "edge-1", (5,), 1)]
    # every logical client is hosted exactly once
    hosted = sorted(c for p in plan.clients for c in p.clients)
    assert hosted == list(range(6))


def test_placement_groups_split_per_parent_within_each_group():
    """What the hosts launcher asks for: clients placed on hosts, `per_parent` processes each."""
    text = star_text(count=6, processes=1, topology='kind = "hierarchical"\nedges = 2')
    plan = plan_processes(parse_config(text), [Placement((0, 3, 4), 1), Placement((1, 2, 5), 2)])
    assert [(p.node_id, p.parent, p.clients, p.group) for p in plan.clients] == [
        ("client-proc0", "edge-0", (0,), 0), ("client-proc1", "edge-1", (3, 4), 0),
        ("client-proc2", "edge-0", (1,), 1), ("client-proc3", "edge-0", (2,), 1),
        ("client-proc4", "edge-1", (5,), 1)]


def test_a_topology_can_register_its_own_plan():
    def one_per_client(cfg, placement):
        base = star_plan(cfg, [Placement(tuple(range(cfg.clients.count)), cfg.clients.count)])
        return ProcessPlan(base.processes)

    register_plan("chain", one_per_client)
    try:
        plan = plan_processes(parse_config(star_text(count=3, processes=1, topology='kind = "chain"')))
        assert [p.clients for p in plan.clients] == [(0,), (1,), (2,)]
    finally:
        register_plan("chain", star_plan)
    with pytest.raises(ValueError, match="register_plan"):
        register_plan("", star_plan)


def test_plan_rejects_a_process_plan_that_does_not_host_every_client():
    def lossy(cfg, placement):
        return ProcessPlan((PlannedProcess("server", "server", None),
                            PlannedProcess("client-proc0", "client", "server", (0,))))

    register_plan("chain", lossy)
    try:
        with pytest.raises(ValueError, match="logical clients"):
            plan_processes(parse_config(star_text(count=3, processes=1, topology='kind = "chain"')))
    finally:
        register_plan("chain", star_plan)
