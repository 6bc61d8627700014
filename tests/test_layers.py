"""The layers of docs/architecture.md, checked over the import graph of the source tree.

Every `import` and `from ... import` (at module level or inside a function: a deferred import is
still a dependency) is read with `ast` from the files as they are, so a new module that breaks a
rule fails here without being run.  common/ is a stack of layer packages (`LAYERS`, lowest
first); a module imports only from its own layer and the layers below it:

- the wire and leaf helpers (common/wire/, common/util/, common/numerics/) import nothing above them;
- security (common/security/), then the payload processors (common/processors/), then the fabric
  (common/transport/), which moves `Payload`s and imports no algorithm and no task;
- the config schema (common/config/schema.py); data sets, models and tasks (common/data/,
  common/models/, common/tasks/);
  the topology specs and their graphs and plans (common/topologies/); the differential-privacy
  numerics and mechanism (common/privacy/);
- the round engine and the algorithms (common/engine/, common/algorithms/); the run records
  (common/records/: run.db, checkpoints);
- on top, the config loader (common/config/ but schema.py: parse, validate, options, rules, write,
  parent), the registry that resolves algorithms, topologies, data sets and processors by name;
- common/ imports no role and no launcher; a role imports no other role; torch.distributed is
  imported only by the torch transport's folder (transports/torch/);
- a topology or transport folder (topologies/<kind>/, transports/<kind>/) imports common/, its
  own modules and the roles' shared parts (`ROLE_SHARED`), never another folder, a launcher or a
  role's entry; common/ and the roles never import or name a folder, so a kind is added or
  removed with its folder.
- deploy/ is in sub-packages by job (docs/architecture.md): the front doors, the command line
  (deploy/cli/) and the Python API (deploy/api.py), stand on the benchmarks (deploy/bench/), which
  stand on the launchers and the tools (deploy/launch/, deploy/tools/); nothing imports a front door
  and only the command line imports the benchmarks (launch/ and tools/ do import each other).

Code named by a "package.module:attribute" string (a spec's driver, a transport's planes) is a
dependency too: `named_of` reads those strings, and every one must name a module that exists.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = {"common": "fedhop.common", "server": "fedhop.server", "edge": "fedhop.edge",
            "client": "fedhop.client", "deploy": "fedhop.deploy", "api": "fedhop", "topologies": "fedhop.topologies",
            "transports": "fedhop.transports"}
ROLES = ("fedhop.server", "fedhop.edge", "fedhop.client")

# common/'s layer packages, lowest first; a module's layer is its longest matching prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("wire and leaf helpers", ("fedhop.common.wire", "fedhop.common.util", "fedhop.common.numerics")),
    ("security", ("fedhop.common.security",)),
    ("fabric: the payload processors", ("fedhop.common.processors",)),
    ("fabric: the transports", ("fedhop.common.transport",)),
    ("config schema", ("fedhop.common.config.schema",)),
    ("data sets, models and tasks", ("fedhop.common.data", "fedhop.common.models", "fedhop.common.tasks")),
    ("topology specs", ("fedhop.common.topologies",)),
    ("privacy", ("fedhop.common.privacy",)),
    ("round engine and algorithms", ("fedhop.common.engine", "fedhop.common.algorithms")),
    ("run records", ("fedhop.common.records",)),
    ("config loader", ("fedhop.common.config",)),
]
WIRE = LAYERS[0][1]
FABRIC = tuple(p for _, packages in LAYERS[:4] for p in packages)
ALGORITHM_IMPORTERS = ("fedhop.common.algorithms", "fedhop.common.engine.rounds", "fedhop.common.config")
FOLDERS = ("fedhop.topologies", "fedhop.transports")
# what a topology folder may use of the roles: their parts written for every topology
ROLE_SHARED = ("fedhop.server.driver", "fedhop.server.sampled", "fedhop.server.group_rounds", "fedhop.edge.aggregator",
               "fedhop.edge.group_edge", "fedhop.client.host", "fedhop.client.group_worker", "fedhop.client.secagg")
NAMED = re.compile(r"^(fedhop(?:\.\w+)+):[\w.]+$")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every fedhop module (and torch.distributed) that `path` imports, wherever the import sits."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against this module's package
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)   # `from pkg import module`
    return {m for m in found if m.startswith(("fedhop", "torch.distributed"))}


def graph() -> dict[str, set[str]]:
    out = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "fedhop_pb2" in path.name:
                continue
            out[module_name(path)] = imports_of(path)
    return out


def within(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer (its longest matching package), None outside them."""
    best: tuple[int, int] | None = None
    for index, (_, packages) in enumerate(LAYERS):
        for package in packages:
            if within(module, package) and (best is None or len(package) > best[1]):
                best = (index, len(package))
    return best[0] if best else None


def named_of(path: Path) -> set[str]:
    """The fedhop modules that `path` names in "package.module:attribute" strings (imported by name)."""
    return {m.group(1) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := NAMED.match(node.value))}


def named_graph() -> dict[str, set[str]]:
    return {module_name(path): named_of(path) for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
            if "fedhop_pb2" not in path.name}


GRAPH = graph()
NAMED_GRAPH = named_graph()


def violations(importers: tuple[str, ...] | str, forbidden: tuple[str, ...] | str,
               allowed: tuple[str, ...] = (), graph_: dict[str, set[str]] | None = None) -> list[str]:
    """Every "m imports dep" (or names it, over NAMED_GRAPH) from `importers` to `forbidden`."""
    return sorted(f"{m} imports {dep}" for m, deps in (GRAPH if graph_ is None else graph_).items()
                  if within(m, importers) and not within(m, allowed)
                  for dep in deps if within(dep, forbidden))


def test_the_graph_is_read():
    """The reader finds the modules and their imports (so the rules below are not vacuous)."""
    assert len(GRAPH) > 100
    assert "fedhop.common.wire.message" in GRAPH["fedhop.common.wire.codec"]
    assert any(within(d, "fedhop.common.algorithms") for d in GRAPH["fedhop.common.engine.rounds"])
    assert violations("fedhop.common.engine.rounds", "fedhop.common.algorithms")   # the engine does import them


def test_every_module_of_common_sits_in_a_layer():
    """common/ holds the layer packages and its own __init__ only: a module dropped beside them
    would belong to no layer and escape the rule below."""
    outside = sorted(m for m in GRAPH if within(m, "fedhop.common") and m != "fedhop.common" and layer_of(m) is None)
    assert outside == []
    assert sorted(p.name for p in (ROOT / "common").glob("*.py")) == ["__init__.py"]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer to a higher one, as "module (layer) imports dep (layer)"."""
    return sorted(f"{m} ({LAYERS[lm][0]}) imports {dep} ({LAYERS[ld][0]})"
                  for m, deps in graph.items() if (lm := layer_of(m)) is not None
                  for dep in deps if (ld := layer_of(dep)) is not None and ld > lm)


def test_no_layer_imports_a_higher_one():
    assert upward_imports(GRAPH) == []


def test_the_layer_rule_is_not_vacuous():
    """The rule sees real edges across layers: the fabric imports the wire, the loader imports
    the engine's algorithms, and an edge the other way would be caught."""
    assert layer_of("fedhop.common.transport.fabric") == 3 and layer_of("fedhop.common.config.schema") == 4
    assert layer_of("fedhop.common.records.runstore") == len(LAYERS) - 2
    assert layer_of("fedhop.common.config") == len(LAYERS) - 1
    assert any(layer_of(d) == 0 for d in GRAPH["fedhop.common.transport.base"])
    assert any(within(d, "fedhop.common.algorithms") for d in GRAPH["fedhop.common.config.options"])
    assert layer_of("fedhop.common.config") > layer_of("fedhop.common.wire.codec")
    bad = {**GRAPH, "fedhop.common.wire.codec": GRAPH["fedhop.common.wire.codec"] | {"fedhop.common.transport.base"}}
    assert upward_imports(bad) == ["fedhop.common.wire.codec (wire and leaf helpers) imports "
                                   "fedhop.common.transport.base (fabric: the transports)"]


def test_the_wire_imports_nothing_above_it():
    above = ("fedhop.common.transport", "fedhop.common.algorithms", "fedhop.common.tasks",
             "fedhop.common.config", "fedhop.common.engine.rounds", *ROLES, "fedhop.deploy")
    assert violations(WIRE, above) == []


def test_the_fabric_imports_no_algorithm_and_no_task():
    assert violations(FABRIC, ("fedhop.common.algorithms", "fedhop.common.tasks", "fedhop.common.engine.rounds")) == []


def test_only_the_round_engine_and_the_registry_import_the_algorithms():
    assert violations("fedhop.common", "fedhop.common.algorithms", allowed=ALGORITHM_IMPORTERS) == []


def test_common_imports_no_role_and_no_launcher():
    assert violations("fedhop.common", (*ROLES, "fedhop.deploy")) == []


def test_every_named_module_exists():
    """A "module:attribute" string names a module of the tree (a stale one after a move fails
    here, not when a run first needs it)."""
    named = {dep for deps in NAMED_GRAPH.values() for dep in deps}
    assert "fedhop.topologies.chain.driver" in named   # the reader sees the specs' strings
    assert sorted(dep for dep in named if dep not in GRAPH) == []


def test_folders_stand_above_common_and_the_roles():
    """topologies/<kind>/ and transports/<kind>/ may import common/ and the roles' shared parts;
    common/ and the roles never import or name a folder (common/topologies `spec_for` and
    common/transport/factory.py scan the packages), so adding or removing a folder edits nothing else."""
    assert violations(("fedhop.common", *ROLES), FOLDERS) == []
    assert violations(("fedhop.common", *ROLES), FOLDERS, graph_=NAMED_GRAPH) == []
    assert "fedhop.topologies.chain" in GRAPH and "fedhop.transports.torch.dist" in GRAPH   # the folders are read


def test_a_folder_uses_common_itself_and_the_roles_shared_parts():
    """A folder imports and names common/, its own modules and `ROLE_SHARED` only: no other
    folder (a rule two kinds share lives in common/), no launcher, no role's entry."""
    folders = sorted({".".join(m.split(".")[:3]) for m in GRAPH if within(m, FOLDERS) and m not in FOLDERS})
    assert {"fedhop.topologies.star", "fedhop.topologies.asynchronous", "fedhop.transports.grpc",
            "fedhop.transports.torch", "fedhop.transports.inmemory"} <= set(folders)
    for own in folders:
        forbidden = (*FOLDERS, *ROLES, "fedhop.deploy")
        uses = [f"{m} -> {dep}" for graph_ in (GRAPH, NAMED_GRAPH) for m, deps in graph_.items() if within(m, own)
                for dep in deps if within(dep, forbidden) and not within(dep, (own, *ROLE_SHARED))]
        assert uses == [], own


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_other_role(role):
    assert violations(role, tuple(r for r in ROLES if r != role)) == []


def test_only_the_torch_transport_imports_torch_distributed():
    assert violations(("fedhop.common", *ROLES, *FOLDERS), "torch.distributed", allowed=("fedhop.transports.torch",)) == []
    assert violations("fedhop.transports.torch", "torch.distributed")   # the rule sees the import it allows


def _kind_branches(path: Path) -> list[str]:
    """Comparisons of a config's `transport.kind` or `topology.kind` (any object's
    `.transport.kind` / `.topology.kind`) with anything: a choice made by naming a kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if (isinstance(side, ast.Attribute) and side.attr == "kind" and isinstance(side.value, ast.Attribute)
                    and side.value.attr in ("transport", "topology")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_kind_choices_live_in_the_specs_and_the_transport_registry():
    """Issue 27: what depends on the topology or the transport is declared by the topology's spec
    (common/topologies/) or the transport's registration (common/transport/); nothing else branches
    on a kind's name."""
    allowed = (ROOT / "common" / "topologies", ROOT / "common" / "transport", ROOT / "topologies", ROOT / "transports")
    branches = [b for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
                if not any(a in path.parents for a in allowed) for b in _kind_branches(path)]
    assert branches == []
    inside = [b for a in allowed for path in sorted(a.rglob("*.py")) for b in _kind_branches(path)]
    assert inside   # the rule reads what it should: the specs do branch (so the scan is not vacuous)


# deploy/'s sub-packages by job, highest first: a package imports only from its own tier and those below
DEPLOY_TIERS: list[tuple[str, ...]] = [
    ("fedhop.deploy.cli", "fedhop.deploy.api"),        # the front doors: the command line, the Python API
    ("fedhop.deploy.bench",),                          # the benchmarks
    ("fedhop.deploy.launch", "fedhop.deploy.tools"),   # the launchers; the tools that work on runs
]


def deploy_tier(module: str) -> int | None:
    return next((i for i, packages in enumerate(DEPLOY_TIERS) if within(module, packages)), None)


def deploy_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {dep}" for m, deps in graph.items() if (tm := deploy_tier(m)) is not None
                  for dep in deps if (td := deploy_tier(dep)) is not None and td < tm)


def test_every_module_of_deploy_sits_in_a_sub_package_by_job():
    """deploy/ holds its sub-packages, api.py and its own __init__ only: a module dropped beside them
    would belong to no job and escape the rule below."""
    outside = sorted(m for m in GRAPH if within(m, "fedhop.deploy") and m != "fedhop.deploy" and deploy_tier(m) is None)
    assert outside == []
    assert sorted(p.name for p in (ROOT / "deploy").glob("*.py")) == ["__init__.py", "api.py"]


def test_deploy_sub_packages_import_no_tier_above_them():
    """Nothing in deploy/ imports the command line or the Python API, and only they import the
    benchmarks; the rule sees real edges (the command line imports every job) and would catch one
    the other way."""
    assert deploy_upward_imports(GRAPH) == []
    assert any(deploy_tier(d) == 2 for d in GRAPH["fedhop.deploy.cli.cli"])
    assert any(deploy_tier(d) == 1 for d in GRAPH["fedhop.deploy.cli.cli"])
    assert any(deploy_tier(d) == 2 for d in GRAPH["fedhop.deploy.bench.bench"])
    bad = {**GRAPH, "fedhop.deploy.launch.launcher": GRAPH["fedhop.deploy.launch.launcher"] | {"fedhop.deploy.bench.bench"}}
    assert deploy_upward_imports(bad) == ["fedhop.deploy.launch.launcher imports fedhop.deploy.bench.bench"]
