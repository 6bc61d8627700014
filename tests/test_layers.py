"""The layers of docs/architecture.md, checked over the import graph of the source tree.

Every `import` and `from ... import` (at module level or inside a function: a deferred import is
still a dependency) is read with `ast` from the files as they are, so a new module that breaks a
rule fails here without being run.  The rules, lowest layer first:

- the wire (common/wire/, common/codec.py, common/ledger.py, common/methods.py) imports nothing
  above it: no transport, no algorithm, no task, no config;
- the fabric (common/transport/ and the modules that serve it) imports no algorithm and no task:
  it moves `Payload`s (common/wire/message.py), whatever computes them;
- among common/, only the round engine (common/rounds.py) and the registries (common/config.py,
  which resolves an algorithm by name) import common/algorithms;
- common/ imports no role and no launcher; a role imports no other role; no role imports
  torch.distributed or the torch transport (that lives under common/transport only).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = {"common": "fedhop.common", "server": "fedhop.server", "edge": "fedhop.edge",
            "client": "fedhop.client", "deploy": "fedhop.deploy", "api": "fedhop"}
ROLES = ("fedhop.server", "fedhop.edge", "fedhop.client")

WIRE = ("fedhop.common.wire", "fedhop.common.codec", "fedhop.common.ledger", "fedhop.common.methods")
FABRIC = WIRE + ("fedhop.common.transport", "fedhop.common.admission", "fedhop.common.security",
                 "fedhop.common.nodecred", "fedhop.common.addresses", "fedhop.common.liveness",
                 "fedhop.common.livebytes", "fedhop.common.control", "fedhop.common.torch_device")
ALGORITHM_IMPORTERS = ("fedhop.common.algorithms", "fedhop.common.rounds", "fedhop.common.config")


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


GRAPH = graph()


def violations(importers: tuple[str, ...] | str, forbidden: tuple[str, ...] | str,
               allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} imports {dep}" for m, deps in GRAPH.items()
                  if within(m, importers) and not within(m, allowed)
                  for dep in deps if within(dep, forbidden))


def test_the_graph_is_read():
    """The reader finds the modules and their imports (so the rules below are not vacuous)."""
    assert len(GRAPH) > 100
    assert "fedhop.common.wire.message" in GRAPH["fedhop.common.codec"]
    assert any(within(d, "fedhop.common.algorithms") for d in GRAPH["fedhop.common.rounds"])
    assert violations("fedhop.common.rounds", "fedhop.common.algorithms")   # the engine does import them


def test_the_wire_imports_nothing_above_it():
    above = ("fedhop.common.transport", "fedhop.common.algorithms", "fedhop.common.tasks",
             "fedhop.common.config", "fedhop.common.rounds", *ROLES, "fedhop.deploy")
    assert violations(WIRE, above) == []


def test_the_fabric_imports_no_algorithm_and_no_task():
    assert violations(FABRIC, ("fedhop.common.algorithms", "fedhop.common.tasks", "fedhop.common.rounds")) == []


def test_only_the_round_engine_and_the_registry_import_the_algorithms():
    assert violations("fedhop.common", "fedhop.common.algorithms", allowed=ALGORITHM_IMPORTERS) == []


def test_common_imports_no_role_and_no_launcher():
    assert violations("fedhop.common", (*ROLES, "fedhop.deploy")) == []


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_other_role(role):
    assert violations(role, tuple(r for r in ROLES if r != role)) == []


def test_no_role_imports_the_torch_transport():
    torch_plane = ("torch.distributed", "fedhop.common.transport.torchdist", "fedhop.common.transport.torch_groups")
    assert violations(ROLES, torch_plane) == []


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
    allowed = (ROOT / "common" / "topologies", ROOT / "common" / "transport")
    branches = [b for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
                if not any(a in path.parents for a in allowed) for b in _kind_branches(path)]
    assert branches == []
    inside = [b for a in allowed for path in sorted(a.rglob("*.py")) for b in _kind_branches(path)]
    assert inside   # the rule reads what it should: the specs do branch (so the scan is not vacuous)
