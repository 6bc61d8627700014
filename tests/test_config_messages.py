"""Config errors a user can act on (issue 45, item 7): a misspelt key, section, algorithm, data set,
topology or choice gets "did you mean ...?", and an error in a `--set` override (or the API's
`set=`) names that override, not the file it was applied to.  Run as a user runs it: `fedhop run`
from a folder outside the checkout, one line on stderr, exit 2, no run folder made."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import ConfigError, load_config
from fedhop.common.util.suggest import did_you_mean

FEDHOP = [sys.executable, "-m", "fedhop.deploy.cli.cli"]


@pytest.mark.parametrize("word, names, hint", [
    ("rl", ["lr", "reg", "server_lr"], "lr"),                       # letters swapped
    ("fedvag", ["fedavg", "fedprox", "fedadam"], "fedavg"),          # two letters
    ("FedAvg", ["fedavg", "fedprox"], "fedavg"),                     # case
    ("digts", ["digits", "mnist", "npz"], "digits"),
    ("hierarchcal", ["star", "hierarchical", "sequential"], "hierarchical"),
    ("partiton", ["dataset", "partition", "alpha"], "partition"),
])
def test_close_names_are_proposed(word, names, hint):
    assert did_you_mean(word, names) == f" (did you mean '{hint}'?)"


@pytest.mark.parametrize("word, names", [("batch", ["lr", "reg", "seed"]), ("zzz", ["fedavg", "fedprox"]),
                                         ("lr", ["lr"])])
def test_nothing_is_proposed_when_nothing_is_close(word, names):
    assert did_you_mean(word, names) == ""


@pytest.mark.parametrize("text, fragment", [
    ("[run]\nrounds = 1\n[algorithm]\nrl = 0.1\n", "unknown config key 'algorithm.rl' = 0.1 (did you mean 'lr'?)"),
    ("[rnu]\nrounds = 1\n", "unknown config section '[rnu]' (did you mean 'run'?)"),
    ("[algorithm]\nname = \"fedvag\"\n", "unknown algorithm 'fedvag' (did you mean 'fedavg'?)"),
    ("[data]\ndataset = \"digts\"\n", "unknown data set 'digts' (did you mean 'digits'?)"),
    ("[topology]\nkind = \"hierarchcal\"\n", "unknown topology 'hierarchcal' (did you mean 'hierarchical'?)"),
    ("[security]\nnan_policy = \"rejet\"\n", "got 'rejet' (did you mean 'reject'?), allowed: reject, fail"),
])
def test_file_errors_name_the_file_and_propose_a_name(tmp_path, text, fragment):
    path = tmp_path / "my.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and fragment in str(err.value)


@pytest.mark.parametrize("overrides, blamed", [
    (["run.rounds=abc"], "override 'run.rounds=abc': config key 'run.rounds'"),
    (["run.rounds=3", "algorithm.lr=x"], "override 'algorithm.lr=x': config key 'algorithm.lr'"),
    (["rnu.rounds=3"], "override 'rnu.rounds=3': unknown config section '[rnu]'"),
    (["algorithm.rl=1"], "override 'algorithm.rl=1': unknown config key 'algorithm.rl'"),
    # a table the override made, and a table-valued override: still the override's, said once
    (["data.x.y=3"], "override 'data.x.y=3': unknown config key 'data.x'"),
    (["clients.count={a=1}"], "override 'clients.count={a=1}': config key 'clients.count': got {'a': 1} (dict)"),
    (["algorithm={lr=1}"], "override 'algorithm={lr=1}': the key must be SECTION.KEY"),
])
def test_override_errors_name_the_override(tmp_path, overrides, blamed):
    path = tmp_path / "my.toml"
    path.write_text("[run]\nrounds = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(err.value).startswith(blamed), str(err.value)
    assert str(err.value).count("override '") == 1, str(err.value)


def test_an_error_in_the_file_is_still_the_files_when_overrides_are_given(tmp_path):
    path = tmp_path / "my.toml"
    path.write_text("[run]\nrounds = \"two\"\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["algorithm.lr=0.1"])
    assert str(err.value).startswith(f"{path}: config key 'run.rounds'")


def test_fedhop_run_prints_one_line_with_the_override_and_the_hint(tmp_path):
    (tmp_path / "my.toml").write_text("[run]\nrounds = 2\n")
    res = subprocess.run(FEDHOP + ["run", "my.toml", "--set", "algorithm.rl=0.1", "--out", "runs/x"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("fedhop run: override 'algorithm.rl=0.1': unknown config key 'algorithm.rl' = 0.1 "
                                 "(did you mean 'lr'?)"), res.stderr
    assert not Path(tmp_path / "runs" / "x").exists()


def test_a_strict_upper_bound_reads_as_one_in_the_reference_and_the_error(tmp_path):
    """fedadam's beta1 must be < 1: the reference shows [0.0, 1.0) (it said [0.0, 1.0] and then
    "must be < 1"), and 1.0 is refused by the loader with the same bound."""
    from fedhop.common.algorithms.fedopt import FedAdamParams
    from fedhop.deploy.cli.configref import allowed_text
    beta1 = next(f for f in __import__("dataclasses").fields(FedAdamParams) if f.name == "beta1")
    assert allowed_text(float, beta1.metadata) == "[0.0, 1.0)"
    path = tmp_path / "my.toml"
    path.write_text("[algorithm]\nname = \"fedadam\"\nbeta1 = 1.0\n")
    with pytest.raises(ConfigError, match=r"'algorithm.beta1': got 1.0, must be < 1.0"):
        load_config(path)
    path.write_text("[algorithm]\nname = \"fedadam\"\nbeta1 = 0.999\n")
    assert load_config(path).algorithm.params.beta1 == 0.999


@pytest.mark.parametrize("text, fragment", [
    ('[topology]\nkind = "star"\nedges = 2\n', "config key 'topology.edges': got 2, but topology.kind = 'star' runs no "
                                               "edge servers (kinds with edges: hierarchical, sequential;"),
    ('[topology]\nkind = "gossip"\nedges = 1\n', "topology.kind = 'gossip' runs no edge servers"),
    ('[topology]\nkind = "star"\nassignment = "shuffled"\n', "config key 'topology.assignment': got 'shuffled', but "
                                                             "topology.kind = 'star' runs no edge servers"),
    ("[secure_aggregation]\ndegree = 4\n", "config key 'secure_aggregation.degree' = 4 is set, but "
                                           "secure_aggregation.enabled is not"),
    ("[secure_aggregation]\nquant_bits = 8\nclip = 2.0\n", "config key 'secure_aggregation.clip' = 2.0 is set"),
])
def test_a_key_the_config_makes_inert_is_refused(tmp_path, text, fragment):
    """A key the rest of the config never reads (edges on a kind without edge servers, a SecAgg+
    setting without secure_aggregation.enabled, as [privacy]'s keys with privacy.mode = "none"):
    the user believes it changed the run; one line naming it.  `enabled = false` written beside
    SecAgg+'s keys is a plain run meant as such (a comparison with the secure one) and loads."""
    (tmp_path / "c.toml").write_text("[run]\nrounds = 1\n[clients]\ncount = 4\n" + text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.toml")
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    # the same keys where they are read load: edges on hierarchical, SecAgg+'s with it enabled
    readable = (text.replace('"star"', '"hierarchical"').replace('"gossip"', '"hierarchical"')
                .replace("[secure_aggregation]\n", "[secure_aggregation]\nenabled = true\n")
                .replace("degree = 4", "degree = 2"))
    if "hierarchical" in readable and "edges" not in readable:
        readable += "edges = 2\n"
    (tmp_path / "ok.toml").write_text("[run]\nrounds = 1\n[clients]\ncount = 4\n" + readable +
                                      ("[algorithm]\nweighting = \"uniform\"\n" if "secure" in text else ""))
    load_config(tmp_path / "ok.toml")
    if "secure" in text:
        (tmp_path / "off.toml").write_text("[run]\nrounds = 1\n[clients]\ncount = 4\n" + text.replace(
            "[secure_aggregation]\n", "[secure_aggregation]\nenabled = false\n"))
        assert not load_config(tmp_path / "off.toml").secure_aggregation.enabled
