"""A topology driver from the user's package (issue 18, item 1): examples/plugin's round-robin
star, named by import path or entry point, runs over real processes and gives the model an
independent numpy FedAvg over its round-robin client sets gives; a path that does not load is
exit 2 with a one-line error before any process starts."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.topologies.plan import plan_processes
from fedhop.deploy.launch.launcher import run_local
from fedhop.server.driver import driver_class
from tests.helpers import numpy_fedavg_round, quadratic_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin"
ROUND_ROBIN = "fedhop_example.topologies:RoundRobinStar"
RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(5, 3))
CURV = RNG.uniform(0.5, 2.0, size=(5, 3))
SIZES = [4, 9, 6, 12, 3]


@pytest.fixture
def example_importable(monkeypatch):
    """The example package importable here and in the run's processes (forked or exec'd)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])))
    yield
    for name in [m for m in sys.modules if m.startswith("fedhop_example")]:
        del sys.modules[name]


def test_round_robin_driver_over_real_processes_equals_numpy_fedavg(tmp_path, example_importable):
    rounds, per_round, start = 4, 2, 1
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=per_round, processes=2, local_steps=3,
                            lr=0.2, topology=f'kind = "{ROUND_ROBIN}"\nstart = {start}')
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    assert run_local(str(cfg), [], str(tmp_path / "run"), quiet=True) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == ROUND_ROBIN
    # round r takes clients (start + (r-1) k + j) mod N: {1,2}, {3,4}, {0,1}, {2,3}
    want = [sorted((start + (r - 1) * per_round + j) % 5 for j in range(per_round)) for r in range(1, rounds + 1)]
    assert want == [[1, 2], [3, 4], [0, 1], [2, 3]]
    store = RunStore(tmp_path / "run" / "run.db", create=False)
    trained = {}   # the server's train calls in the ledger: whom each round really reached
    for m in store.messages():
        if m["method"] == "train" and m["role"] == "sender" and m["status"] == "ok":
            trained.setdefault(m["round"], []).append(int(m["dst"].removeprefix("client-")))
    assert [sorted(trained[r]) for r in range(1, rounds + 1)] == want
    w = np.zeros(3)
    for clients in want:
        w = numpy_fedavg_round(w, CENTERS, CURV, SIZES, clients, 3, 0.2, 1.0)
    model = load_file(str(tmp_path / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(model, w, rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(w) > 0.5   # it moved: the comparison is not vacuous


def test_entry_point_name_loads_the_driver_and_the_star_plan(tmp_path, monkeypatch, example_importable):
    """A package that registers the driver under `fedhop.topologies` (here a bare dist-info on sys.path)."""
    dist = tmp_path / "fedhop_example_topology-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedhop-example-topology\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[fedhop.topologies]\nround_robin_test = {ROUND_ROBIN}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_config('[topology]\nkind = "round_robin_test"\nstart = 3\n[clients]\ncount = 5\nprocesses = 2\n')
    assert cfg.topology.params.start == 3
    cls = driver_class("round_robin_test")
    assert f"{cls.__module__}:{cls.__qualname__}" == ROUND_ROBIN
    plan = plan_processes(cfg)
    assert [(p.node_id, p.parent, p.clients) for p in plan.processes[1:]] == [
        ("client-proc0", "server", (0, 1, 2)), ("client-proc1", "server", (3, 4))]


@pytest.mark.parametrize("kind,message", [
    ("nosuchpkg.topo:Driver", "fedhop run: override 'topology.kind=nosuchpkg.topo:Driver': config key 'topology.kind': cannot import 'nosuchpkg.topo:Driver': "
                              "ModuleNotFoundError: No module named 'nosuchpkg'"),
    ("fedhop.common.models.dense:MLP", "fedhop run: override 'topology.kind=fedhop.common.models.dense:MLP': config key 'topology.kind': 'fedhop.common.models.dense:MLP' is not a "
                                 "topology driver (a subclass of fedhop.server.driver.TopologyDriver)"),
    ("no_such_topology", "fedhop run: override 'topology.kind=no_such_topology': config key 'topology.kind': unknown topology 'no_such_topology' "
                         "(allowed: star, hierarchical, sequential, chain, relay"),
])
def test_bad_topology_plugin_is_exit_2_before_any_process_starts(tmp_path, capsys, monkeypatch, kind, message):
    monkeypatch.chdir(tmp_path)
    Path("c.toml").write_text("[run]\nrounds = 1\n")
    assert run_local("c.toml", [f"topology.kind={kind}"], str(tmp_path / "run"), quiet=True) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "run" / "logs").exists()   # no process was started
