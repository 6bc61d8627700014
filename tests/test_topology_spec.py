"""A topology is one spec (issue 27, item 1) in one folder (issue 46): each built-in kind is a
folder topologies/<kind>/ whose package defines its `TopologySpec`; every registry (params, config checks, process plan, server driver,
edge role, client handlers, the live page) reads it; a plug-in provides the same spec type; and
no role or common module outside common/topologies/ branches on a kind's name."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.client.host import ClientHost
from fedhop.common.config import ConfigError, options_schema, parse_config
from fedhop.common.topologies import TopologySpec, builtin_specs, spec_for
from fedhop.common.topologies.graphs import TOPOLOGY_PARAMS
from fedhop.common.topologies.plan import plan_processes
from fedhop.deploy.tools.dashboard import _graph
from fedhop.server.driver import driver_class
from tests.helpers import quadratic_config
from tests.test_fedchs import fedchs_config

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("star", "hierarchical", "sequential", "chain", "relay", "gossip")
RNG = np.random.default_rng(27)
CENTERS = RNG.normal(0, 1, size=(6, 2))


def kind_config(kind: str):
    """A valid config of each built-in kind (Fed-CHS's own for sequential)."""
    if kind == "sequential":
        return parse_config(fedchs_config())
    topology = f'kind = "{kind}"' + ("\nedges = 2" if kind == "hierarchical" else "")
    return parse_config(quadratic_config(CENTERS, np.ones_like(CENTERS), [3] * 6, processes=2, topology=topology))


# written out here, not read from the specs: what each kind adds beyond the common roles
BASE_CLIENT_METHODS = {"train", "ping", "shutdown", "state_get", "state_set"}   # the torch transport adds its own
EXTRA_CLIENT_METHODS = {"chain": {"walk_visit", "walk_handoff"},
                        "gossip": {"gossip_step", "gossip_send", "gossip_share", "gossip_mix"}}
DRIVERS = {"star": "fedhop.topologies.star.driver:StarDriver",
           "hierarchical": "fedhop.topologies.hierarchical.driver:HierarchicalDriver",
           "sequential": "fedhop.topologies.sequential.driver:SequentialDriver",
           "chain": "fedhop.topologies.chain.driver:WalkDriver", "relay": "fedhop.topologies.relay.driver:RelayDriver",
           "gossip": "fedhop.topologies.gossip.driver:GossipDriver"}
WITH_EDGES = {"hierarchical", "sequential"}
PEER_LINKS = {"sequential": "edge-edge", "chain": "client-client", "gossip": "client-client"}


def test_every_built_in_kind_is_one_folder():
    """Each built-in kind is a folder topologies/<kind>/ whose package defines its SPEC; the paper
    kinds come first in the order error messages list them in, the other folders after them."""
    specs = builtin_specs()
    assert tuple(specs)[:len(KINDS)] == KINDS
    assert set(specs) == {p.name for p in (ROOT / "topologies").iterdir() if (p / "__init__.py").is_file()}
    for kind in specs:
        module = importlib.import_module(f"fedhop.topologies.{kind}")
        # another test may have replaced a field (register_plan, replace_spec): the kind and driver stay
        assert specs[kind].driver == module.SPEC.driver and isinstance(module.SPEC, TopologySpec) and module.SPEC.name == kind
        assert spec_for(kind) is specs[kind]
        assert module.SPEC.params is None or dataclasses.is_dataclass(module.SPEC.params)
    with pytest.raises(KeyError, match="unknown topology 'no_such_kind'"):
        spec_for("no_such_kind")


@pytest.mark.parametrize("kind", KINDS)
def test_every_registry_reads_the_spec(kind):
    spec, cfg = builtin_specs()[kind], kind_config(kind)
    # params: the options schema, TOPOLOGY_PARAMS and the validated config
    assert options_schema("topology", kind) is spec.params is TOPOLOGY_PARAMS[kind]
    assert type(cfg.topology.params) is spec.params
    # the server's driver
    cls = driver_class(kind)
    assert f"{cls.__module__}:{cls.__qualname__}" == DRIVERS[kind] and cls.kind == kind
    # the process plan: the spec's function, edges exactly where the spec says
    plan = plan_processes(cfg)
    assert plan == spec.plan_fn()(cfg, None)
    assert bool(plan.edges) == spec.edges == (kind in WITH_EDGES)
    # the edge's role beside its aggregator
    role = spec.edge_role_class()
    assert (None if role is None else f"{role.__module__}:{role.__qualname__}") == \
        {"sequential": "fedhop.topologies.sequential.edge:SequentialEdge",
         "hierarchical": "fedhop.topologies.hierarchical.secagg_edge:SecAggEdge"}.get(kind)
    # the client's handlers: the common ones and the kind's own, nothing else
    host = ClientHost(cfg, "client-proc0", [0, 1], run_id="")
    assert {str(m) for m in host.router.methods} == BASE_CLIENT_METHODS | EXTRA_CLIENT_METHODS.get(kind, set())
    # the live page: edge tiers and peer links
    graph = _graph({"topology": {"kind": kind, "edges": 2}, "clients": {"count": 6}}, [], {})
    assert any(n["id"] == "edge-0" for n in graph["nodes"]) == (kind in WITH_EDGES)
    assert {lk["link"] for lk in graph["links"]} & {"edge-edge", "client-client"} == \
        ({PEER_LINKS[kind]} if kind in PEER_LINKS else set())


PLUGIN = '''
from dataclasses import dataclass, field

from fedhop.common.topologies.plan import Placement, build_plan
from fedhop.common.topologies import TopologySpec
from fedhop.common.topologies.graphs import topology_params


@dataclass
class GroupParams:
    group: int = field(default=1, metadata={"min": 1})   # logical clients per client process


def check(cfg):
    group, count = topology_params(cfg).group, cfg.clients.count
    if group > count:
        raise ValueError(f"topology.group: got {group}, more than clients.count = {count}")


def plan(cfg, placement):
    n = cfg.clients.count
    return build_plan([], [Placement(tuple(range(n)), -(-n // cfg.topology.params.group))])


SPEC = TopologySpec(name="grouped", params=GroupParams, check=check, plan=plan,
                    driver="fedhop.topologies.star.driver:StarDriver")
'''


@pytest.fixture
def plugin_spec(tmp_path, monkeypatch):
    (tmp_path / "hA_grouped_topology.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hA_grouped_topology:SPEC"
    sys.modules.pop("hA_grouped_topology", None)


def test_a_plugin_spec_is_checked_and_planned_as_a_built_in_one(plugin_spec):
    def text(group: int, extra: str = "") -> str:
        return quadratic_config(CENTERS[:5], np.ones_like(CENTERS[:5]), [3] * 5, processes=1,
                                topology=f'kind = "{plugin_spec}"\ngroup = {group}') + extra

    cfg = parse_config(text(2))
    spec = spec_for(plugin_spec)
    assert spec.name == plugin_spec and type(cfg.topology.params) is spec.params and cfg.topology.params.group == 2
    plan = plan_processes(cfg)   # ceil(5 / 2) = 3 processes of near-equal blocks under the server
    sizes = [len(p.clients) for p in plan.clients]
    assert len(sizes) == math.ceil(5 / 2) and max(sizes) - min(sizes) <= 1
    assert sorted(c for p in plan.clients for c in p.clients) == list(range(5))
    assert {p.parent for p in plan.clients} == {"server"} and plan.edges == ()
    assert driver_class(plugin_spec).__qualname__ == "StarDriver"
    # its own check, worded as every config error
    with pytest.raises(ConfigError) as exc:
        parse_config(text(9))
    assert str(exc.value) == "config key 'topology.group': got 9, more than clients.count = 5"
    # what the spec leaves out is refused as for any kind without it
    with pytest.raises(ConfigError, match="works in topology.kind = 'star' or 'hierarchical'"):
        parse_config(text(2, '\n[security]\naggregation = "median"\n'))


def test_an_object_that_is_no_spec_and_no_driver_is_refused(tmp_path, monkeypatch):
    (tmp_path / "hA_not_a_topology.py").write_text("THING = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="is not a topology driver .* or a fedhop.common.topologies.TopologySpec"):
            parse_config('[topology]\nkind = "hA_not_a_topology:THING"\n')
    finally:
        sys.modules.pop("hA_not_a_topology", None)


# Kind names that may stay as string literals outside common/topologies/ and the folders, with why:
# (file, literal) -> how many times
ALLOWED_LITERALS = {
    ("common/algorithms/__init__.py", "sequential"): 1,   # getattr(algorithm, "sequential"): the algorithm's attribute
    ("common/config/schema.py", "star"): 1,      # the default of topology.kind
}


def kind_literals() -> dict[tuple[str, str], int]:
    """Every str constant equal to a built-in kind in server/, edge/, client/, common/ outside
    common/topologies/, docstrings left out."""
    found: dict[tuple[str, str], int] = {}
    for folder in ("server", "edge", "client", "common"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("common/topologies/") or "fedhop_pb2" in rel:
                continue
            tree = ast.parse(path.read_text(), rel)
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in KINDS and id(node) not in docs:
                    found[rel, node.value] = found.get((rel, node.value), 0) + 1
    return found


def test_no_kind_name_is_branched_on_outside_the_specs():
    found = kind_literals()
    assert found.get(("common/config/schema.py", "star"), 0) >= 1   # the reader sees the literals it must
    extra = {k: n for k, n in found.items() if n > ALLOWED_LITERALS.get(k, 0)}
    assert extra == {}, f"kind names outside common/topologies/ (put them in the kind's spec): {extra}"


FOLDER_INIT_IMPORTS = {"fedhop.common.topologies.spec", "fedhop.common.topologies.checks", "fedhop.common.wire.methods"}


def module_level_imports(path: Path) -> set[str]:
    """The fedhop modules `path` imports at module level (not inside a function)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedhop"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fedhop"))
    return out


def test_the_specs_sit_below_what_reads_them():
    """No import cycle: the modules of common/topologies/ and the folders' `__init__`s
    (topologies/<kind>/__init__.py) import at module level only common/topologies/
    and the leaf helpers below them (common/util/: seeded streams, node ids; common/numerics/: the
    row sums of a graph's weights; common/wire/methods.py:
    the method table a spec declares its own methods into); role code and the
    helpers of their checks are named by reference or imported when called; and the plug-in
    loader (common/util/plugins.py) imports no fedhop module at all, so common/topologies imports
    it, not the reverse (tests/test_layers.py checks every layer)."""
    folders = sorted((ROOT / "topologies").glob("*/__init__.py"))   # scanned by builtin_specs: the same rule
    assert len(folders) >= 7
    for path in sorted((ROOT / "common" / "topologies").glob("*.py")):
        assert all(m.startswith(("fedhop.common.topologies", "fedhop.common.util", "fedhop.common.numerics"))
                   or m == "fedhop.common.wire.methods"
                   for m in module_level_imports(path)), path.name
    # a folder is imported while graphs.py (which scans them at import) may be half made: not graphs, not plan
    for path in folders:
        assert all(m.startswith("fedhop.common.util") or m in FOLDER_INIT_IMPORTS
                   for m in module_level_imports(path)), path
    assert module_level_imports(ROOT / "common" / "topologies" / "plan.py")   # the reader sees imports
    every_import = {m for node in ast.walk(ast.parse((ROOT / "common" / "util" / "plugins.py").read_text()))
                    for m in ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                              [a.name for a in node.names] if isinstance(node, ast.Import) else [])}
    assert "importlib" in every_import   # the reader sees its imports, inside functions too
    assert not {m for m in every_import if m.startswith("fedhop")}