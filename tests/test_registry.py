"""One registry shape (issue 46, item 1): algorithms, data sets, models, compressors, processors,
topologies and transports each keep a common/util/registry.py `Registry`; a built-in and a
plug-in (written outside the checkout, named "package.module:Name") are found by the same
lookup; an unknown name is one error naming the family, the name and the available names; a
module is imported only when a name it declares is asked for (the names are read from the
sources), and the config loader imports no torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.algorithms import ALGORITHMS, algorithm_class, registry
from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.models import MODELS, build_model, model_kinds
from fedhop.common.models.dense import build_mlp
from fedhop.common.processors.compressors import COMPRESSORS, builtin_compressors, compressor_class
from fedhop.common.processors.compressors.sparse import TopK
from fedhop.common.processors.pipeline import PROCESSORS
from fedhop.common.tasks import DATASETS, NpzParams, builtin_datasets, dataset_params_class
from fedhop.common.topologies import TOPOLOGIES, builtin_specs, spec_for
from fedhop.common.transport.factory import TRANSPORT_KINDS, TRANSPORTS, transport
from fedhop.common.util.registry import Registry, UnknownName, declared_names

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

FAMILIES = {"algorithm": ALGORITHMS, "data set": DATASETS, "model": MODELS, "compressor": COMPRESSORS,
            "processor": PROCESSORS, "topology": TOPOLOGIES, "transport": TRANSPORT_KINDS}

# one plug-in of every family in one package of the user's, outside the checkout
PLUGIN = '''
import dataclasses
from typing import ClassVar

import numpy as np
import torch

from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.util.plugins import FederatedData
from fedhop.transports.inmemory import TRANSPORT as _INMEMORY


class MyAvg(FedAvg):
    name = "my_avg"


def load(request):
    rng = np.random.default_rng(request.seed)
    return FederatedData(clients=[(rng.normal(size=(4, 3)), np.arange(4) % 2) for _ in range(request.num_clients)])


def make_net(input_shape, n_outputs):
    return torch.nn.Linear(int(np.prod(input_shape)), n_outputs)


@dataclasses.dataclass(frozen=True)
class Halve:
    name: ClassVar[str] = "halve"
    unbiased: ClassVar[bool] = False

    def encode(self, v, rng):
        return {"v": v / 2}

    def decode(self, parts, numel):
        return parts["v"] * 2

    def encoded_bytes(self, numel, parts=None):
        return 4 * numel


class Count:
    def process(self, message, ctx):
        return message


class Driver:
    def run_round(self, round):
        return None


TRANSPORT = dataclasses.replace(_INMEMORY, listed=99)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The package `regplug` (module `regplug.things`) in a folder outside the checkout, importable."""
    folder = tmp_path / "outside"
    assert ROOT not in folder.resolve().parents
    (folder / "regplug").mkdir(parents=True)
    (folder / "regplug" / "__init__.py").write_text("")
    (folder / "regplug" / "things.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    yield "regplug.things"
    for name in ("regplug", "regplug.things"):
        sys.modules.pop(name, None)
    TRANSPORTS.pop("regplug.things:TRANSPORT", None)
    for registry_ in FAMILIES.values():
        for ref in [r for r in registry_.table if r.startswith("regplug.")]:
            registry_.table.pop(ref)


def test_every_family_keeps_one_registry_shape():
    assert all(isinstance(r, Registry) for r in FAMILIES.values())
    assert {r.family for r in FAMILIES.values()} == set(FAMILIES)
    assert {r.group for r in FAMILIES.values()} == {"algorithms", "datasets", "models", "compressors", "processors",
                                                     "topologies", "transports"}
    # the public functions read the registries
    assert registry() == ALGORITHMS.builtins() and model_kinds() == sorted(MODELS.builtins())
    assert builtin_compressors() == COMPRESSORS.builtins() and builtin_datasets() == sorted(DATASETS.builtins())
    assert builtin_specs() == TOPOLOGIES.builtins() and list(TRANSPORTS)[:3] == TRANSPORT_KINDS.names()


def test_a_builtin_and_a_plugin_of_every_family_are_found_by_the_same_lookup(plugin):
    mod = plugin
    assert ALGORITHMS.get("fedavg") is FedAvg is algorithm_class("fedavg")
    mine = ALGORITHMS.get(f"{mod}:MyAvg")
    assert mine.__module__ == mod and issubclass(mine, FedAvg) and algorithm_class(f"{mod}:MyAvg") is mine

    assert MODELS.get("mlp") is build_mlp
    net = build_model("ignored", (2, 3), 4, factory=f"{mod}:make_net", seed=5)
    assert MODELS.get(f"{mod}:make_net").__module__ == mod and tuple(net.weight.shape) == (4, 6)

    assert COMPRESSORS.get("topk") is TopK is compressor_class("topk")
    assert compressor_class(f"{mod}:Halve").name == "halve" and COMPRESSORS.get(f"{mod}:Halve").__module__ == mod

    assert PROCESSORS.builtins() == {} and PROCESSORS.get(f"{mod}:Count").__module__ == mod

    assert DATASETS.get("npz").params is NpzParams and dataset_params_class("npz") is NpzParams
    entry = DATASETS.get(f"{mod}:load")
    assert entry.params is None and f"{mod}:load" not in builtin_datasets()   # a plug-in is no built-in

    assert TOPOLOGIES.get("star") is spec_for("star") and spec_for("star").name == "star"
    spec = spec_for(f"{mod}:Driver")
    assert spec.name == f"{mod}:Driver" and spec.driver.__module__ == mod

    assert TRANSPORT_KINDS.get("grpc") is transport("grpc") is TRANSPORTS["grpc"]
    entry_t = transport(f"{mod}:TRANSPORT")
    assert entry_t.listed == 99 and TRANSPORTS[f"{mod}:TRANSPORT"] is entry_t
    assert f"{mod}:TRANSPORT" not in TRANSPORT_KINDS.names()


@pytest.mark.parametrize("family,name,near", [
    ("algorithm", "fedvag", "fedavg"), ("data set", "digts", "digits"), ("model", "mpl", "mlp"),
    ("compressor", "tpok", "topk"), ("processor", "count", None), ("topology", "gosip", "gossip"),
    ("transport", "grpcc", "grpc"),
])
def test_an_unknown_name_is_one_error_naming_the_family_the_name_and_the_available_names(family, name, near):
    registry_ = FAMILIES[family]
    with pytest.raises(UnknownName) as raised:
        registry_.get(name)
    text = str(raised.value)
    assert text.startswith(f"unknown {family} '{name}'") and "\n" not in text
    assert isinstance(raised.value, KeyError) and isinstance(raised.value, ValueError)
    assert (f"(did you mean '{near}'?)" in text) == (near is not None)
    listed = text.partition("(allowed: ")[2].partition("an import path")[0].removesuffix(", or ")
    names = [*registry_.also, *registry_.names()]   # every built-in, in the registry's order, then entry points
    assert (listed.split(", ") if listed else [])[:len(names)] == names and len(names) == len(set(names))
    assert f"an import path 'package.module:{registry_.what}'" in text and f"'fedhop.{registry_.group}'" in text


@pytest.mark.parametrize("section,key,value,message", [
    ("data", "dataset", "digts", "config key 'data.dataset': unknown data set 'digts' (did you mean 'digits'?)"),
    ("algorithm", "name", "fedvag", "config key 'algorithm.name': unknown algorithm 'fedvag' (did you mean 'fedavg'?)"),
    ("compression", "up", "tpok", "config key 'compression.up': unknown compressor 'tpok' (did you mean 'topk'?)"),
])
def test_an_unknown_name_in_a_config_is_exit_2_with_one_line(tmp_path, section, key, value, message):
    (tmp_path / "c.toml").write_text("[run]\nrounds = 1\n")
    done = subprocess.run([str(Path(PYTHON).parent / "fedhop"), "run", "c.toml", "--out", "run", "--set",
                           f"{section}.{key}={value}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0] and "(allowed: " in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_the_names_read_from_the_sources_are_the_names_the_modules_register():
    """The lazy table (names by `ast`, module docstring of common/util/registry.py) agrees with the
    imported modules, for every registry whose modules declare dicts."""
    for registry_ in (DATASETS, MODELS):
        sources = registry_.sources()
        assert sources and all(s.names for s in sources)   # every module names its entries literally
        for source in sources:
            module = __import__(source.module, fromlist=["REGISTER"])
            assert tuple(module.REGISTER) == source.names, source.module
    assert set().union(*(s.names for s in DATASETS.sources())) == set(builtin_datasets())
    from fedhop.common.tasks.leaf import KINDS
    assert set(KINDS) <= set(builtin_datasets())   # LEAF's table and its REGISTER name the same sets


def test_declared_names_reads_a_source_without_running_it():
    assert declared_names('import os\nos.system("false")\nREGISTER = {"a": 1, "b": f()}\n', "REGISTER") == ("a", "b")
    assert declared_names("X = 1\n", "REGISTER") == ()            # no registry module: never imported
    assert declared_names("REGISTER = [A, B]\n", "REGISTER") is None   # names known only by importing
    assert declared_names("REGISTER = {NAME: 1}\n", "REGISTER") is None
    assert declared_names("if x:\n    REGISTER = {'a': 1}\n", "REGISTER") is None
    multi = 'X = 1\nREGISTER = {\n    "a": (f, None),   # a comment\n    "b": (g, P),\n}\nY = 2\n'
    assert declared_names(multi, "REGISTER") == ("a", "b")   # the one statement parsed alone
    assert declared_names("REGISTER = {'a': 1}\nREGISTER['b'] = 2\n", "REGISTER") is None   # changed afterwards
    assert declared_names("REGISTER = {'a': 1}\nfor k in REGISTER:\n    pass\n", "REGISTER") is None
    assert declared_names("# REGISTER is below\nREGISTER = {'a': 1}\n", "REGISTER") == ("a",)   # a comment


@pytest.fixture
def package(tmp_path, monkeypatch):
    """make(name, {module: source}): a package of kinds in tmp_path, importable, forgotten afterwards."""
    made: list[str] = []

    def make(name: str, modules: dict[str, str]) -> str:
        (tmp_path / name).mkdir()
        for module, source in {"__init__": "", **modules}.items():
            (tmp_path / name / f"{module}.py").write_text(source)
        made.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in [m for m in sys.modules if m.partition(".")[0] in made]:
        sys.modules.pop(name)


def test_a_module_is_imported_only_when_a_name_it_declares_is_asked_for(package):
    kinds: Registry[object] = Registry("kind", package("lazykinds", {
        "cheap": "REGISTER = {'one': 1, 'two': 2}\n",
        "heavy": "raise RuntimeError('heavy imported')\nREGISTER = {'three': 3}\n",
        "helpers": "raise RuntimeError('a module without REGISTER imported')\n",
        "listed": "class K:\n    name = 'four'\nREGISTER = [K]\n"}), "models")
    assert kinds.get("two") == 2 and "lazykinds.heavy" not in sys.modules
    found = kinds.find("four")   # a list: its module is imported to know its names
    assert getattr(found, "name", None) == "four" and "lazykinds.listed" in sys.modules
    assert "lazykinds.heavy" not in sys.modules and "lazykinds.helpers" not in sys.modules
    with pytest.raises(RuntimeError, match="heavy imported"):
        kinds.names()   # the full list imports every registry module


def test_a_name_two_modules_register_is_an_error(package):
    kinds: Registry[int] = Registry("kind", package("twicekinds", {"a": "REGISTER = {'same': 1}\n",
                                                                   "b": "REGISTER = {'same': 2}\n"}), "models")
    with pytest.raises(RuntimeError, match="kind 'same' registered twice"):
        kinds.names()


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([PYTHON, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT.parent)
    return set(out.stdout.split())


def test_the_config_loader_imports_no_torch_and_a_data_set_imports_only_its_module():
    assert "torch" not in _imported_after("import fedhop.common.config")
    after = _imported_after("from fedhop.common.tasks import dataset_params_class; dataset_params_class('lasso')")
    task_modules = {m for m in after if m.startswith("fedhop.common.tasks.")}
    assert "fedhop.common.tasks.sparse" in task_modules
    assert not task_modules & {"fedhop.common.tasks.images", "fedhop.common.tasks.torchvision",
                               "fedhop.common.tasks.leaf", "fedhop.common.tasks.sent140",
                               "fedhop.common.tasks.crossdevice", "fedhop.common.tasks.minimax"}


def test_a_kept_plugin_is_still_checked_against_the_allow_list(plugin):
    from fedhop.common.util.plugins import PluginRefused, restrict, unrestricted
    ref = f"{plugin}:load"
    assert DATASETS.get(ref) is DATASETS.get(ref)   # kept
    restrict(["someone_else"])
    try:
        with pytest.raises(PluginRefused, match="regplug"):
            DATASETS.get(ref)
    finally:
        unrestricted()
