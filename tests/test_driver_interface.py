"""The narrow driver interface (issue 46, item 3): what a topology's server part may use of the run.

- every driver in topologies/ uses only `DriverContext`'s six members and, under `run`, `model`,
  `nodes` and `records`, only their protocols' members (read from the source with `ast`, the
  allowed names from the protocols themselves, so the test follows the protocol);
- docs/architecture.md's table lists every member;
- a plug-in written against the flat names of before (`ctx.cfg`, `ctx.client_home`,
  `ctx.complete_round`, ...) still gets the Coordinator's member, with a DeprecationWarning naming
  the new path; over real processes, a star plug-in that reads `ctx.cfg` and `ctx.client_home`
  gives numpy's FedAvg model and the warning lands in the server's log.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.wire.ledger import Ledger
from fedhop.server.context import LEGACY
from fedhop.server.coordinator import Coordinator
from fedhop.server.driver import DriverContext, Nodes, Records, RunFacts, ServerModel
from fedhop.server.sampled import SampledRounds
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork
from tests.helpers import numpy_fedavg_round, quadratic_config

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = Path(sys.executable).with_name("fedhop")
GROUPS = {"run": RunFacts, "model": ServerModel, "nodes": Nodes, "records": Records}


def members(protocol: type) -> set[str]:
    """A protocol's members: its annotated attributes, properties and methods."""
    return set(vars(protocol).get("__annotations__", {})) | {n for n in vars(protocol) if not n.startswith("_")}


def context_uses(source: str) -> list[tuple[int, str]]:
    """Every use of a driver context in `source` outside the narrow protocol, as (line, 'ctx.x' or
    'ctx.group.x').  A context is `self.ctx`, a name `ctx`, or a parameter annotated `DriverContext`."""
    tree = ast.parse(source)
    names = {"ctx"} | {a.arg for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for a in node.args.args + node.args.kwonlyargs
                       if isinstance(a.annotation, ast.Name) and a.annotation.id == "DriverContext"}

    def is_context(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id in names)
                or (isinstance(node, ast.Attribute) and node.attr == "ctx"
                    and isinstance(node.value, ast.Name) and node.value.id == "self"))

    top = members(DriverContext)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if is_context(node.value) and node.attr not in top:
            bad.append((node.lineno, f"ctx.{node.attr}"))
        inner = node.value
        if (isinstance(inner, ast.Attribute) and is_context(inner.value) and inner.attr in GROUPS
                and node.attr not in members(GROUPS[inner.attr])):
            bad.append((node.lineno, f"ctx.{inner.attr}.{node.attr}"))
    return bad


def used_members(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "ctx"} | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                          and isinstance(n.value, ast.Name) and n.value.id == "ctx"}


def test_the_interface_is_six_members_grouped_by_job():
    assert members(DriverContext) == {"run", "model", "nodes", "fabric", "records", "clock"}
    assert members(RunFacts) == {"cfg", "run_id", "run_dir", "task", "algorithm"}
    assert members(ServerModel) == {"state", "client_message", "group_message", "reply_limits"}
    assert members(Nodes) == {"children", "client_home", "unavailable", "sample"}
    assert members(Records) == {"store", "ledger", "summary_hooks", "restored_topology", "round_metrics",
                                "record_round"}
    # what only server/sampled.py's rounds use is the engine's, not the context's
    assert members(SampledRounds) == {"streams", "note_failures", "is_short", "short_round", "complete_round"}
    assert not members(SampledRounds) & (members(DriverContext) | set().union(*map(members, GROUPS.values())))


def test_the_checker_finds_uses_outside_the_protocol():
    """The scan below could miss: it reports flat names, unknown members of a group, and
    contexts under other names (a parameter annotated DriverContext)."""
    source = textwrap.dedent('''
        class D:
            def run_round(self, round):
                self.ctx.records.record_round(self.ctx.cfg)
                ctx = self.ctx
                ctx.records.complete_round(round)
                ctx.nodes.sample(round)
        def plane(coord: DriverContext):
            return coord.client_home, coord.fabric, coord.run.limiter
    ''')
    assert sorted(context_uses(source)) == [(4, "ctx.cfg"), (6, "ctx.records.complete_round"),
                                            (9, "ctx.client_home"), (9, "ctx.run.limiter")]


def test_built_in_drivers_use_only_the_narrow_protocol():
    files = sorted((ROOT / "topologies").rglob("*.py"))
    drivers = [f for f in files if f.name == "driver.py"]
    assert {f.parent.name for f in drivers} >= {"star", "hierarchical", "sequential", "chain", "gossip", "relay",
                                                "asynchronous"}
    bad = {str(f.relative_to(ROOT)): uses for f in files if (uses := context_uses(f.read_text()))}
    assert bad == {}
    # not vacuous: the drivers together use every member of the context
    used = set().union(*(used_members(f.read_text()) for f in files))
    assert used >= members(DriverContext)


def test_architecture_doc_lists_every_member():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## The driver interface"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1].split("(")[0] for line in rows}
    want = {f"ctx.{m}" for m in members(DriverContext) if m not in GROUPS}
    want |= {f"ctx.{g}.{m}" for g, p in GROUPS.items() for m in members(p)}
    want |= {f"rounds.{m}" for m in members(SampledRounds)}
    assert want - listed == set()


@pytest.fixture
def coordinator(tmp_path):
    cfg = parse_config("[clients]\ncount = 4\nprocesses = 1\n[run]\nrounds = 1\n")
    ledger = Ledger()
    coord = Coordinator(cfg, tmp_path / "run", InMemoryEndpoint(InMemoryNetwork(), "server", ledger), ledger)
    yield coord
    coord.store.close()


def test_flat_names_forward_with_a_deprecation_warning_naming_the_new_path(coordinator):
    ctx = coordinator.context
    assert set(LEGACY) == {"cfg", "run_id", "run_dir", "task", "algorithm", "state", "client_message",
                           "group_message", "limiter", "children", "client_home", "unavailable", "sample", "store",
                           "ledger", "summary_hooks", "restored_topology", "round_metrics", "record_round",
                           "streams", "note_failures", "is_short", "short_round", "complete_round"}
    for name, path in LEGACY.items():
        with pytest.warns(DeprecationWarning, match=rf"ctx\.{name} is deprecated .* use ctx\.{path.split()[0]}"):
            old = getattr(ctx, name)
        assert old == getattr(coordinator, name), name   # the Coordinator's member, as before
        group, _, member = path.split()[0].partition(".")
        if group in GROUPS:   # the new path exists, and an attribute is the very same object
            new = getattr(getattr(ctx, group), member)
            if not callable(new) or name == "restored_topology":
                assert new is old, name
    # a name that never was the context's is an AttributeError naming the members
    with pytest.raises(AttributeError, match="no 'engine'.*run, model, nodes, fabric, records, clock"):
        ctx.engine
    # the new paths read the Coordinator when used: a resume's state and topology are seen
    coordinator.restored_topology = {"kind": "chain"}
    assert ctx.records.restored_topology == {"kind": "chain"}
    assert ctx.model.reply_limits([0, 1]).results == 2


PLUGIN = '''
"""A star written against the context's flat names of before."""
from fedhop.common.config import resolve_clients_per_round
from fedhop.topologies.star.driver import StarDriver


class OldStar(StarDriver):
    def sample(self, round):
        cfg = self.ctx.cfg                        # now ctx.run.cfg
        k = resolve_clients_per_round(cfg)
        home = self.ctx.client_home               # now ctx.nodes.client_home
        return sorted(home)[(round - 1) % 2::2][:k]
'''


def test_a_plugin_on_the_flat_names_still_runs_and_is_warned(tmp_path):
    rng = np.random.default_rng(5)
    centers, curv, sizes = rng.normal(0, 2, size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3)), [5, 8, 3, 6]
    folder = tmp_path / "outside"   # the user's package, outside the checkout
    assert ROOT not in folder.resolve().parents
    (folder / "oldstar").mkdir(parents=True)
    (folder / "oldstar" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    text = quadratic_config(centers, curv, sizes, rounds=3, per_round=2, processes=2, local_steps=3, lr=0.2,
                            topology='kind = "oldstar:OldStar"')
    (folder / "c.toml").write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_ALLOW_PLUGINS")}
    env.update(PYTHONPATH=str(folder), PYTHONWARNINGS="always::DeprecationWarning")
    done = subprocess.run([str(FEDHOP), "run", "c.toml", "--out", "run"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((folder / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    # rounds take clients {0, 2}, {1, 3}, {0, 2}: numpy's FedAvg over those sets
    w = np.zeros(3)
    for r in range(1, 4):
        w = numpy_fedavg_round(w, centers, curv, sizes, [0, 2] if r % 2 else [1, 3], 3, 0.2, 1.0)
    model = load_file(str(folder / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(model, w, rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(w) > 0.5
    logs = "".join(p.read_text() for p in (folder / "run" / "logs").glob("server*"))
    assert "ctx.cfg is deprecated and goes in the next release; use ctx.run.cfg" in logs
    assert "ctx.client_home is deprecated and goes in the next release; use ctx.nodes.client_home" in logs
