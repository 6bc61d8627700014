"""Plug-ins (issue 18, item 1): a user's model factory, data set and algorithm, named by import path
or by entry point; a path that does not import is exit 2 before any process starts; the example
package under examples/plugin, installed into a fresh venv, runs over real processes."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms import algorithm_class
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.tasks import build_task
from fedhop.common.util.plugins import PluginError, load_plugin
from fedhop.deploy.launch.launcher import run_local

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin"
BY_PATH = ["model.factory=fedhop_example.models:small_cnn", "data.dataset=fedhop_example.data:digits_two_labels",
           "algorithm.name=fedhop_example.algorithms:FedAvgM", "topology.kind=fedhop_example.topologies:RoundRobinStar"]


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))   # the example package, importable without installing it
    yield
    for name in [m for m in sys.modules if m.startswith("fedhop_example")]:
        del sys.modules[name]


def test_a_package_in_the_plugin_search_path_imports_without_changing_sys_path(tmp_path, monkeypatch):
    """FEDHOP_PLUGIN_PATH (set by `fedhop run` to the config's folder and the cwd): a package found
    there imports with its submodules; sys.path is left as it was; a missing one names the path."""
    pkg = tmp_path / "fh_searchpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub.impl import value\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "impl.py").write_text("def value():\n    return 41 + 1\n")
    monkeypatch.setenv("FEDHOP_PLUGIN_PATH", os.pathsep.join([str(tmp_path / "nothing-here"), str(tmp_path)]))
    before = list(sys.path)
    try:
        assert load_plugin("fh_searchpkg.sub.impl:value", "models")() == 42
        assert load_plugin("fh_searchpkg:value", "models")() == 42   # re-exported from a submodule: defined there
        assert sys.modules["fh_searchpkg"].__file__ == str(pkg / "__init__.py")
        assert sys.path == before
        with pytest.raises(PluginError, match=f"No module named 'fh_nosuch'.*search path .*{tmp_path}"):
            load_plugin("fh_nosuch:x", "models")
    finally:
        for name in [m for m in sys.modules if m.startswith("fh_searchpkg")]:
            del sys.modules[name]


def test_load_plugin_by_import_path_and_its_errors():
    assert load_plugin("fedhop.common.models.dense:MLP", "models").__name__ == "MLP"
    with pytest.raises(PluginError, match=r"cannot import 'nosuchpkg\.models:net': ModuleNotFoundError: No module named 'nosuchpkg'"):
        load_plugin("nosuchpkg.models:net", "models")
    with pytest.raises(PluginError, match="module 'fedhop.common.models.dense' has no attribute 'Nope'"):
        load_plugin("fedhop.common.models.dense:Nope", "models")
    with pytest.raises(LookupError):
        load_plugin("no_such_entry_point", "datasets")
    with pytest.raises(ValueError, match="unknown group"):
        load_plugin("a:b", "widgets")


@pytest.mark.parametrize("key,value,message", [
    ("model.factory", "nosuchpkg.models:net", "config key 'model.factory': cannot import 'nosuchpkg.models:net': "
                                              "ModuleNotFoundError: No module named 'nosuchpkg'"),
    ("data.dataset", "nosuchpkg.data:load", "config key 'data.dataset': cannot import 'nosuchpkg.data:load': "
                                            "ModuleNotFoundError"),
    ("algorithm.name", "nosuchpkg.algos:Algo", "config key 'algorithm.name': cannot import 'nosuchpkg.algos:Algo': "
                                               "ModuleNotFoundError"),
    ("algorithm.name", "fedhop.common.models.dense:MLP", "is not a subclass of fedhop.common.algorithms.base.Algorithm"),
])
def test_bad_plugin_is_exit_2_before_any_process_starts(tmp_path, capsys, key, value, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nrounds = 1\n")
    out = tmp_path / "run"
    assert run_local(str(cfg), [f"{key}={value}"], str(out), quiet=True) == 2
    assert message in capsys.readouterr().err
    assert not (out / "logs").exists()   # no process was started


def test_factory_on_a_task_with_its_own_model_is_a_config_error():
    with pytest.raises(ConfigError, match="data.dataset = 'quadratic' defines its own model"):
        parse_config('[data]\ndataset = "quadratic"\n[model]\nfactory = "fedhop.common.models.dense:MLP"\n')


def linear_net(input_shape, n_outputs, bias=True):
    """A model factory for the test below."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), n_outputs, bias=bias))


def test_factory_replaces_model_kind_on_a_built_in_data_set():
    cfg = parse_config('[data]\ndataset = "digits"\n[model]\nfactory = "tests.test_plugins:linear_net"\n'
                       'factory_args = {bias = false}\n[clients]\ncount = 4\n')
    model = build_task(cfg).build_model()   # digits: 64 features, 10 classes, no bias: 640 parameters
    assert isinstance(model, torch.nn.Sequential) and sum(p.numel() for p in model.parameters()) == 640


def test_dataset_plugin_builds_the_task_it_describes(example_on_path):
    cfg = parse_config("[clients]\ncount = 10\n", BY_PATH)
    task = build_task(cfg)
    hist = task.label_histograms()
    assert hist.shape == (10, 10)
    for i, row in enumerate(hist):   # client i holds classes i and i + 1 (mod 10) only
        assert set(np.flatnonzero(row)) == {i % 10, (i + 1) % 10}
    assert hist.sum() + len(task.y_test) == 1797 and len(task.y_test) == round(0.25 * 1797)
    model = task.build_model()   # the factory's model: closed-form parameter count C*9 + C + C*16*10 + 10
    assert sum(p.numel() for p in model.parameters()) == 8 * 9 + 8 + 8 * 16 * 10 + 10
    again = build_task(parse_config("[clients]\ncount = 10\n", BY_PATH)).build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_algorithm_plugin_is_fedavg_with_server_momentum(example_on_path):
    cfg = parse_config("[algorithm]\nbeta = 0.5\nserver_lr = 1.0\n", BY_PATH)
    cls = algorithm_class(cfg.algorithm.name)
    algo = cls(cfg.algorithm, cfg.algorithm.params)
    state = algo.init_state({"w": torch.zeros(2)})
    for d in ([1.0, 2.0], [3.0, -1.0]):   # aggregates with weight 1: the mean delta is d
        algo.server_update(state, Payload(tensors={"w": torch.tensor(d)}, scalars={"weight": 1.0}), 1)
    # v1 = d1, w1 = d1; v2 = 0.5 d1 + d2, w2 = w1 + v2
    assert torch.allclose(state.params["w"], torch.tensor([1 + 0.5 + 3, 2 + 1 - 1.0]))


def test_example_package_installed_in_a_venv_runs_over_real_processes(tmp_path):
    """pip-install fedhop and the example package into a fresh venv (dependencies from this
    environment), run the example config by entry-point names, then by import paths: the same
    seed gives the same final model either way."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # this environment's packages, base environments first: a venv layered on another through a .pth
    # (as in this repository's worktrees) carries an older setuptools of its own, without bdist_wheel
    own = sysconfig.get_paths()["purelib"]
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir() and p != own] + [own]
    (site / "fedhop-deps.pth").write_text("\n".join(deps) + "\n")
    # this environment's pip installs into the venv; setuptools (the build backend) comes through the .pth
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
           "--no-build-isolation"]
    source = shutil.copytree(EXAMPLE, tmp_path / "plugin-src")   # pip builds in the source tree: not in the repo's
    for target in (["-e", str(ROOT)], [str(source)]):
        done = subprocess.run(pip + target, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_START")}
    models = []
    for name, sets in (("entry-points", []), ("import-paths", BY_PATH)):
        cmd = [str(venv / "bin" / "fedhop"), "run", str(EXAMPLE / "plugin_digits.toml"), "--out", str(tmp_path / name),
               "--quiet", "--set", "run.rounds=3"] + [a for s in sets for a in ("--set", s)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds_completed"] == 3
        assert summary["num_parameters"] == 8 * 9 + 8 + 8 * 16 * 10 + 10 and summary["ledger_agreement"]["ok"]
        models.append(load_file(str(tmp_path / name / "model.safetensors")))
    assert models[0].keys() == {"conv.weight", "conv.bias", "head.weight", "head.bias"}
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_a_plugin_that_exits_as_it_is_imported_is_a_plugin_error_not_this_processs_exit(tmp_path, monkeypatch):
    """A module that calls sys.exit() at import (`fedhop config show` of it printed nothing and
    exited 0): the import fails as a PluginError naming the reference and the call."""
    (tmp_path / "fh_exits.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(PluginError, match=r"cannot import 'fh_exits:A': the module called sys.exit\(0\)"):
            load_plugin("fh_exits:A", "algorithms")
    finally:
        sys.modules.pop("fh_exits", None)
