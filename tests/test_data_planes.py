"""Transports' data planes (common/transport/factory.py `planes`) and the edge's one HierFAVG loop.

The roles ask `data_plane(transport.kind, concept, topology.kind)` and never name a transport;
an edge's kappa2 iterations are one loop (edge/aggregator.py `EdgeAggregator.hierfavg`) whose
per-iteration exchange with the clients is the transport's EDGE_STEP plane.
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.transport import factory
from fedhop.common.transport.base import HandlerError
from fedhop.common.transport.factory import (
    EDGE_STEP,
    HIER_ROUND,
    PLANE_CONCEPTS,
    STAR_ROUND,
    TRANSPORTS,
    NoDataPlane,
    Transport,
    data_plane,
)
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import WEIGHT_KEY, Payload
from fedhop.edge.aggregator import ClusterFanout, EdgeAggregator
from fedhop.server.driver import RunFailed
from fedhop.server.sampled import ClientFanout, EdgeFanout
from fedhop.topologies.hierarchical.driver import HierarchicalDriver
from fedhop.topologies.sequential import EDGE_PATHS, SEQ_EDGE_PATH
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_every_builtin_transport_gives_a_class_for_every_concept(kind):
    for concept in PLANE_CONCEPTS:
        plane = data_plane(kind, concept, "star")
        assert isinstance(plane, type), (kind, concept)
    fanout = kind != "torch"   # the one transport whose tensors move outside its calls
    assert (data_plane(kind, STAR_ROUND, "star") is ClientFanout) == fanout
    assert (data_plane(kind, HIER_ROUND, "hierarchical") is EdgeFanout) == fanout
    assert (data_plane(kind, EDGE_STEP, "hierarchical") is ClusterFanout) == fanout


def test_a_new_transport_gets_the_fanout_planes_from_its_one_line(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "pigeon", Transport("tests.test_endpoint_factory:PigeonEndpoint",
                                                        "fedhop.common.transport.groups:FANOUT_WORLDS"))
    assert data_plane("pigeon", STAR_ROUND, "star") is ClientFanout
    assert data_plane("pigeon", EDGE_STEP, "hierarchical") is ClusterFanout
    # a topology's own planes (the sequential model path) by the transport's style: the fan-out's
    assert "pigeon" in factory.transports_with(SEQ_EDGE_PATH, EDGE_PATHS)
    assert data_plane("pigeon", SEQ_EDGE_PATH, "sequential", EDGE_PATHS).__name__ == "EdgeInlineModelPath"
    assert data_plane("torch", SEQ_EDGE_PATH, "sequential", EDGE_PATHS).__name__ == "GroupModelPath"
    with pytest.raises(NoDataPlane, match="does not run over transport.kind = 'pigeon'"):
        data_plane("pigeon", SEQ_EDGE_PATH, "sequential", {"group": EDGE_PATHS["group"]})


def test_a_transport_without_a_plane_fails_the_driver_in_one_line_naming_who_carries_it(monkeypatch):
    star_only = {STAR_ROUND: "fedhop.server.sampled:ClientFanout"}
    monkeypatch.setitem(TRANSPORTS, "pigeon", Transport("tests.test_endpoint_factory:PigeonEndpoint",
                                                        "fedhop.common.transport.groups:FANOUT_WORLDS", star_only))
    with pytest.raises(NoDataPlane) as exc:
        data_plane("pigeon", HIER_ROUND, "hierarchical")
    carriers = sorted(k for k in TRANSPORTS if k != "pigeon")
    assert str(exc.value) == (f"topology.kind = 'hierarchical' does not run over transport.kind = 'pigeon' "
                              f"(it runs over {', '.join(carriers)})")
    driver = HierarchicalDriver(SimpleNamespace(run=SimpleNamespace(cfg=SimpleNamespace(
        transport=SimpleNamespace(kind="pigeon")))))
    with pytest.raises(RunFailed, match="does not run over transport.kind = 'pigeon'"):
        driver.start()


def _transport_kind_constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in TRANSPORTS and id(n) not in docs]


def test_no_role_names_a_transport_kind():
    """No table or branch keyed by transport.kind in server/, edge/, client/ (messages may
    name one inside an f-string; docstrings are left out)."""
    found = [hit for folder in ("server", "edge", "client") for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in _transport_kind_constants(path)]
    assert found == []


# ----------------------------------------------------------------------------- the one HierFAVG loop
class RecordingPlane:
    """An EDGE_STEP plane that returns a given partial per iteration (None: no client answered)."""

    joins_groups = False

    def __init__(self, partials: list[Payload | None]) -> None:
        self.partials = partials
        self.seen: list[tuple[int, list[int], np.ndarray]] = []

    def step(self, round, step, clients, message):
        self.seen.append((step, list(clients), message.tensors["w"].numpy().copy()))
        failed = {clients[-1]: "gone"} if step == 0 else {}
        return self.partials[step], failed


def _edge(kappa2: int) -> EdgeAggregator:
    rng = np.random.default_rng(5)
    text = quadratic_config(rng.normal(size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3)), [3, 5, 7, 9],
                            topology=f'kind = "hierarchical"\nedges = 2\nkappa2 = {kappa2}')
    agg = EdgeAggregator(parse_config(text), InMemoryEndpoint(InMemoryNetwork(), "edge-0", Ledger()), "r", "",
                         parent="server")
    return agg


def _partial(mean_delta: np.ndarray, weight: float) -> Payload:
    return Payload(tensors={"w": torch.tensor(mean_delta * weight)}, scalars={WEIGHT_KEY: weight})


@pytest.mark.parametrize("fails_at", [None, 2, 1])
def test_the_edge_loop_steps_the_edge_model_by_each_partial_and_answers_its_change(fails_at):
    """HierFAVG (Liu et al. 2020, Algorithm 1): iteration k trains from w_k = w_0 + sum_{j<k}
    delta_j; the edge answers W_last * (w_last + delta_last - w_0), from the model its last
    partial was trained from, whichever iteration (if any) got no partial."""
    kappa2 = 3
    rng = np.random.default_rng(11)
    w0 = rng.normal(size=3)
    deltas = [rng.normal(size=3) for _ in range(kappa2)]
    weights = [7.0, 5.0, 3.0]
    partials = [_partial(d, w) if k != fails_at else None for k, (d, w) in enumerate(zip(deltas, weights))]
    agg = _edge(kappa2)
    agg._plane = plane = RecordingPlane(partials)
    sampled = list(agg.cluster)
    partial, failures = agg.hierfavg(4, sampled, Payload(tensors={"w": torch.tensor(w0)}))
    done = kappa2 if fails_at is None else fails_at          # iterations with a partial
    ran = kappa2 if fails_at is None else fails_at + 1       # iterations asked
    assert [s for s, _, _ in plane.seen] == list(range(ran))
    for k, (_, clients, w) in enumerate(plane.seen):
        np.testing.assert_allclose(w, w0 + sum(deltas[:k], np.zeros(3)), rtol=1e-12)
        assert clients == (sampled if k == 0 else sampled[:-1])   # a failed client is not asked again
    assert failures == {sampled[-1]: "gone"}
    expected = weights[done - 1] * sum(deltas[:done], np.zeros(3))
    np.testing.assert_allclose(partial.tensors["w"].numpy(), expected, rtol=1e-12)
    assert partial.scalars[WEIGHT_KEY] == weights[done - 1]


def test_the_edge_loop_has_no_partial_when_the_first_iteration_has_none():
    agg = _edge(2)
    agg._plane = RecordingPlane([None, None])
    partial, failures = agg.hierfavg(1, list(agg.cluster), Payload(tensors={"w": torch.zeros(3)}))
    assert partial is None and failures == {list(agg.cluster)[-1]: "gone"}
    assert len(agg._plane.seen) == 1


def test_a_fanout_edge_refuses_the_group_methods_typed():
    agg = _edge(1)
    assert isinstance(agg.plane, ClusterFanout)
    with pytest.raises(HandlerError) as exc:
        agg.group()
    assert exc.value.code == "BAD_REQUEST" and f"'{agg.cfg.transport.kind}' has no group data plane" in str(exc.value)
