"""Every run config the package ships (examples/, `fedhop examples`) gives the same model bit for bit
and the same bytes for every message in both engines (`fedhop run --engine processes` and
`--engine inprocess`, deploy/launch/inprocess.py).

The examples are found in the folder, not listed here: a new example is checked without a line
added, and one this test cannot run fails it.  Each runs as a user runs it, the real command from a
folder of the user's with relative paths, for two rounds; the data sets read from files (LEAF,
CIFAR-10) are small files generated in their real formats (common/data/fakedata.py) with client
counts to match.  The messages are compared by each sender record's round, ends, method, tensor,
payload and framed bytes, but the messages that name an address or carry a config's text only by
round, ends and method: those differ between the engines by nature (a registration names its
sender's address, its reply carries the parent's config text, and the calls that tell a node
its peers name their addresses: `seq_round`, `gossip_send`, `walk_visit`), and an edge's `probe`,
whose run id is there only once the edge is registered itself; tests/test_inprocess_engine.py
compares the registrations' bytes too, less those fields, where the server is the parent.
"""
from __future__ import annotations

import shutil
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.data import fakedata
from fedhop.common.records.runstore import RunStore
from tests.test_engines import HEARTBEATS
from tests.test_inprocess_engine import ENGINES, fedhop

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TWO_ROUNDS = ["run.rounds=2", "run.eval_every=2"]
FEW_CLIENTS = ["clients.count=4", "clients.per_round=2", "clients.processes=2"]
#: the plug-in example by import paths (its package is found beside its config, FEDHOP_PLUGIN_PATH)
PLUGIN_BY_PATH = ["model.factory=fedhop_example.models:small_cnn",
                  "data.dataset=fedhop_example.data:digits_two_labels",
                  "algorithm.name=fedhop_example.algorithms:FedAvgM",
                  "topology.kind=fedhop_example.topologies:RoundRobinStar"]
#: the methods whose messages name an address or carry a config's text (module docstring), and
#: an edge's `probe` of a registering client's address: it carries the run's id only once the
#: edge has its own registration's reply (edge/runtime.py), which the processes' start order
#: decides in either engine (50 or 74 bytes for fedchs_digits under load)
ADDRESSED = {"register", "register.reply", "seq_round", "gossip_send", "walk_visit", "probe"}


def run_configs() -> list[str]:
    """Every shipped config with a [run] table (not a sweep's spec, not a hosts file), by its path
    under examples/."""
    return sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.toml")
                  if "run" in tomllib.loads(p.read_text()) and "__pycache__" not in p.parts
                  and p.name != "pyproject.toml")


def prepare(name: str, folder: Path) -> list[str]:
    """The data files `name` reads, generated in `folder` (its data_dir is relative), and the
    overrides that fit its client count to them."""
    data = tomllib.loads((EXAMPLES / name).read_text()).get("data", {})
    dataset, data_dir = data.get("dataset", ""), folder / data.get("data_dir", "data")
    if dataset == "femnist":   # FEMNIST's layout, with LEAF's writers or the niid generator's (data.path)
        folder_name = data.get("path") or "femnist"
        if folder_name == "femnist":
            fakedata.femnist(data_dir / folder_name, writers=8, mean=12, std=3, per_file=3)
        else:
            fakedata.femnist_niid(data_dir / folder_name, writers=8, mean=12, per_file=4)
        return FEW_CLIENTS
    if dataset == "shakespeare":
        fakedata.shakespeare(data_dir / "shakespeare", roles=6, mean=20, per_file=4)
        return FEW_CLIENTS
    if dataset == "sent140":
        fakedata.sent140(data_dir / "sent140", users=8, mean=12, per_file=4)
        return FEW_CLIENTS
    if dataset == "cifar10":
        fakedata.cifar10(data_dir, per_batch=12, n_test=20)
        return FEW_CLIENTS
    if name.startswith("plugin/"):
        return PLUGIN_BY_PATH
    return []


def sent(run_dir: Path) -> Counter:
    """The multiset of every message but heartbeats, from its sender's record (module docstring)."""
    store = RunStore(run_dir / "run.db", create=False)
    assert store.check_agreement().ok
    out: Counter = Counter()
    for r in store.messages():
        if r["role"] != "sender" or r["method"] in HEARTBEATS:
            continue
        sizes = () if r["method"] in ADDRESSED else (r["tensor_bytes"], r["payload_bytes"], r["framed_bytes"])
        out[(r["round"], r["src"], r["dst"], r["method"], *sizes)] += 1
    return out


def test_the_examples_are_found():
    """The folder's configs are what the test runs: the ones of every kind the package ships."""
    names = run_configs()
    assert {"fedavg_digits.toml", "hierfavg_digits.toml", "gossip_digits.toml", "fedchs_digits.toml",
            "femnist_fedavg.toml", "plugin/plugin_digits.toml", "claims/lasso_small.toml"} <= set(names)
    assert "hosts.toml" not in names and not any(n.startswith("claims/fedli_tuning") for n in names)


@pytest.mark.parametrize("name", run_configs())
def test_every_example_gives_the_same_model_and_bytes_in_both_engines(name, tmp_path):
    user = tmp_path / "me"
    shutil.copytree(EXAMPLES, user / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    sets = [*TWO_ROUNDS, *prepare(name, user)]
    config = f"examples/{name}"
    for engine in ENGINES:
        res = fedhop(["run", config, "--out", engine, "--engine", engine, "--quiet",
                      *[a for s in sets for a in ("--set", s)]], user, timeout=600)
        assert res.returncode == 0, f"{engine}: {res.stderr[-2000:]}"
    models = {e: load_file(str(user / e / "model.safetensors")) for e in ENGINES}
    a, b = models.values()
    assert a.keys() == b.keys() and a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    processes, inprocess = sent(user / "processes"), sent(user / "inprocess")
    assert {key[3] for key in processes} - ADDRESSED - {"shutdown", "shutdown.reply"}   # the rounds' own messages
    assert inprocess == processes
