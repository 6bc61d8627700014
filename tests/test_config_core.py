"""Config loading: every bad input names its key; overrides; TOML round trip."""
from __future__ import annotations

import pytest

from fedhop.common.config import (
    ConfigError,
    client_local_steps,
    config_to_toml,
    load_config,
    parse_config,
    resolve_clients_per_round,
    resolve_min_results,
)


@pytest.mark.parametrize("text,key", [
    ("[run]\nroundz = 3", "run.roundz"),
    ("[run]\nrounds = 2.5", "run.rounds"),
    ("[run]\nrounds = true", "run.rounds"),
    ("[run]\nrounds = 0", "run.rounds"),
    ("[algorithm]\nlr = \"fast\"", "algorithm.lr"),
    ("[algorithm]\nlr = -0.1", "algorithm.lr"),
    ("[data]\npartition = \"random\"", "data.partition"),
    ("[data]\nalpha = 0", "data.alpha"),
    ("[clients]\ncount = 5\nper_round = 6", "clients.per_round"),
    ("[clients]\nper_round = 1.5", "clients.per_round"),
    ("[clients]\ncolor = 1", "clients.color"),
    ("[algorithm]\nmu = 0.1", "algorithm.mu"),
    ("[algorithm]\nname = \"nosuch\"", "algorithm.name"),
    ("[data]\ndataset = \"quadratic\"\nfoo = 1", "data.foo"),
    ("[topology]\nkind = \"hierarchical\"", "topology.edges"),
    ("[clients]\ncount = 3\n[algorithm]\nlocal_steps = [1, 2]", "algorithm.local_steps"),
    ("[clients]\ncount = 4\n[topology]\nkind = \"hierarchical\"\nedges = 2\nassignment = [[0, 1], [1, 3]]",
     "topology.assignment"),
    ("[nosection]\na = 1", "[nosection]"),
])
def test_bad_values_name_the_key(text, key):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert key in str(err.value)


def test_defaults_and_fraction_resolution():
    cfg = parse_config("[clients]\ncount = 50\nper_round = 0.25\n[run]\nmin_results = 0.5")
    assert resolve_clients_per_round(cfg) == 13
    assert resolve_min_results(cfg, 13) == 7
    assert cfg.algorithm.name == "fedavg" and cfg.algorithm.params is not None


def test_overrides_typed_and_bare_strings():
    cfg = parse_config("[run]\nrounds = 3", ["run.rounds=7", "algorithm.lr=0.5", "data.partition=iid",
                                             "model.hidden=[8, 4]"])
    assert cfg.run.rounds == 7 and cfg.algorithm.lr == 0.5 and cfg.data.partition == "iid"
    assert cfg.model.hidden == [8, 4]
    with pytest.raises(ConfigError, match="run.rounds"):
        parse_config("", ["run.rounds=-1"])
    with pytest.raises(ConfigError, match="SECTION.KEY"):
        parse_config("", ["rounds=3"])


def test_int_widened_to_float_and_local_steps_list():
    cfg = parse_config("[algorithm]\nlr = 1\nlocal_steps = [1, 2, 3]\n[clients]\ncount = 3\nper_round = 3")
    assert isinstance(cfg.algorithm.lr, float)
    assert [client_local_steps(cfg, i) for i in range(3)] == [1, 2, 3]


def test_toml_round_trip_with_options(tmp_path):
    text = """
[run]
name = "a \\"quoted\\" name"
[data]
dataset = "quadratic"
centers = [[1.0, -2.5], [3.0, 4.0]]
sizes = [1, 2]
noise = 1e-05
[clients]
count = 2
per_round = 2
[topology]
kind = "hierarchical"
edges = 2
assignment = [[0], [1]]
kappa2 = 3
"""
    cfg = parse_config(text)
    assert cfg.data.params.centers == [[1.0, -2.5], [3.0, 4.0]] and cfg.topology.params.kappa2 == 3
    again = parse_config(config_to_toml(cfg))
    assert again == cfg and again.data.options == cfg.data.options
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.toml")
