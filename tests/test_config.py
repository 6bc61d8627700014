"""Config loader (common/config/__init__.py): typed validation, cross-field checks, overrides, the
options-schema hook and the TOML writer.  Complements tests/test_config_core.py."""
from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field

import pytest

import fedhop.common.config as config_module
from fedhop.common.config import (
    ConfigError,
    client_local_steps,
    config_to_toml,
    load_config,
    parse_config,
    register_options_schema,
    resolve_clients_per_round,
    resolve_min_results,
)
from fedhop.common.config.schema import Config


# ----------------------------------------------------------------------------- a dummy algorithm schema
@dataclass
class DummyParams:
    mu: float = field(default=0.0, metadata={"min": 0.0})
    rounds_between: int = field(default=1, metadata={"min": 1, "max": 10})
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    sizes: list[int] = field(default_factory=list)
    matrix: list = field(default_factory=list)
    table: dict = field(default_factory=dict)
    tag: str = ""
    flag: bool = False


@pytest.fixture
def dummy_algorithms(monkeypatch):
    """Register ("algorithm", "name") -> DummyParams for name "dummy", None for "bare"; records lookups.

    monkeypatch restores the real algorithm registration after the test."""
    calls: list[str] = []

    def lookup(name: str):
        calls.append(name)
        if name == "dummy":
            return DummyParams
        if name == "bare":
            return None
        raise KeyError(f"algorithm.name: unknown algorithm '{name}' (allowed: bare, dummy)")

    monkeypatch.setitem(config_module._OPTION_SCHEMAS, "algorithm", config_module._OPTION_SCHEMAS["algorithm"])
    register_options_schema("algorithm", "name", lookup)
    return calls


def error_of(text: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(text, overrides)
    return str(err.value)


# ----------------------------------------------------------------------------- unknown keys and sections
def test_defaults_equal_the_schema_defaults():
    assert parse_config("") == Config()


def test_unknown_key_names_key_value_and_allowed_keys():
    msg = error_of("[run]\nroundz = 3")
    assert "'run.roundz'" in msg and "3" in msg
    for allowed in ("rounds", "seed", "eval_every", "min_results"):
        assert allowed in msg
    msg = error_of("[model]\nwidth = 8")       # model has no options field: no extra keys at all
    assert "'model.width'" in msg and "hidden" in msg


def test_unknown_section_and_top_level_key():
    msg = error_of("[runn]\nrounds = 3")
    assert "[runn]" in msg and "run" in msg and "transport" in msg
    msg = error_of("seed = 3")
    assert "'seed'" in msg and "section" in msg


def test_clients_extra_key_rejected_without_a_schema():
    msg = error_of("[clients]\ncolour = \"red\"")
    assert "'clients.colour'" in msg and "per_round" in msg


# ----------------------------------------------------------------------------- types
@pytest.mark.parametrize("text,key,fragment", [
    ("[run]\nrounds = 2.0", "run.rounds", "expected an int"),
    ("[run]\nrounds = true", "run.rounds", "(bool)"),
    ("[run]\nrounds = \"5\"", "run.rounds", "(str)"),
    ("[algorithm]\nlr = \"abc\"", "algorithm.lr", "got 'abc' (str), expected a float"),
    ("[algorithm]\nlr = false", "algorithm.lr", "(bool)"),
    ("[algorithm]\nlr = nan", "algorithm.lr", "finite"),
    ("[model]\nhidden = 64", "model.hidden", "expected a list"),
    ("[model]\nhidden = [64, 0]", "model.hidden", ">= 1"),
    ("[model]\nhidden = [64, 1.5]", "model.hidden", "ints"),
    ("[data]\nstandardize = 1", "data.standardize", "expected a bool"),
    ("[topology]\nassignment = 3", "topology.assignment", "expected a str or a list"),
    ("[clients]\nper_round = \"all\"", "clients.per_round", "expected an int or a float"),
    ("[run]\nmin_results = true", "run.min_results", "(bool)"),
])
def test_wrong_types_name_the_key(text, key, fragment):
    msg = error_of(text)
    assert f"'{key}'" in msg and fragment in msg


def test_accepted_types_and_widening():
    cfg = parse_config("[algorithm]\nlr = 1\nserver_lr = 2\n[clients]\ncount = 8\nper_round = 4\n"
                       "[run]\nmin_results = 0.5\n[topology]\nkind = \"hierarchical\"\nedges = 2\n"
                       "assignment = [[0, 1, 2, 3], [4, 5, 6, 7]]")
    assert type(cfg.algorithm.lr) is float and cfg.algorithm.lr == 1.0
    assert type(cfg.algorithm.server_lr) is float
    assert type(cfg.clients.per_round) is int and cfg.clients.per_round == 4   # int | float keeps int
    assert type(cfg.run.min_results) is float and cfg.run.min_results == 0.5   # ... and float
    assert cfg.topology.assignment == [[0, 1, 2, 3], [4, 5, 6, 7]]               # str | list: a list
    assert parse_config("[topology]\nkind = \"hierarchical\"\nedges = 2\nassignment = \"shuffled\"").topology.assignment == "shuffled"


# ----------------------------------------------------------------------------- ranges and choices
@pytest.mark.parametrize("text,key,fragment", [
    ("[run]\nrounds = -3", "run.rounds", "got -3, must be >= 1"),
    ("[run]\nrounds = 0", "run.rounds", ">= 1"),
    ("[run]\nround_timeout = 0.0", "run.round_timeout", "must be > 0.0"),
    ("[data]\ntest_fraction = 0.91", "data.test_fraction", "must be <= 0.9"),
    ("[clients]\nstraggler_fraction = 1.5", "clients.straggler_fraction", "<= 1.0"),
    ("[transport]\nchunk_bytes = 1023", "transport.chunk_bytes", ">= 1024"),
    ("[run]\ntorch_threads = 100000", "run.torch_threads", "got 100000, must be <= 1024"),
    ("[run]\nmin_results = -1", "run.min_results", ">= 0"),
])
def test_out_of_range_values(text, key, fragment):
    msg = error_of(text)
    assert f"'{key}'" in msg and fragment in msg


def test_range_boundaries_are_inclusive_or_exclusive_as_declared():
    cfg = parse_config("[run]\nrounds = 1\n[data]\ntest_fraction = 0.9\nalpha = 1e-9\n"
                       "[clients]\nstraggler_fraction = 1.0")
    assert cfg.run.rounds == 1 and cfg.data.test_fraction == 0.9 and cfg.data.alpha == 1e-9
    assert "'data.alpha'" in error_of("[data]\nalpha = 0.0")


def test_bad_choice_lists_the_allowed_values():
    msg = error_of("[data]\npartition = \"foo\"")
    assert msg == "config key 'data.partition': got 'foo', allowed: iid, dirichlet, shards, natural, lognormal, pareto"
    msg = error_of("[topology]\nkind = \"ring\"")
    assert "'topology.kind'" in msg and "star, hierarchical, sequential, chain" in msg


# ----------------------------------------------------------------------------- cross-field checks
@pytest.mark.parametrize("per_round,ok", [(0, False), (1, True), (5, True), (6, False),
                                          (0.0, False), (0.01, True), (1.0, True), (1.01, False)])
def test_per_round_bounds(per_round, ok):
    text = f"[clients]\ncount = 5\nper_round = {per_round!r}"
    if ok:
        assert parse_config(text).clients.per_round == per_round
    else:
        assert "'clients.per_round'" in error_of(text)


@pytest.mark.parametrize("min_results,ok", [(0, True), (7, True), (-1, False),
                                            (0.0, False), (0.5, True), (1.0, True), (1.5, False)])
def test_min_results_bounds(min_results, ok):
    text = f"[run]\nmin_results = {min_results!r}"
    if ok:
        assert parse_config(text).run.min_results == min_results
    else:
        assert "'run.min_results'" in error_of(text)


@pytest.mark.parametrize("steps,ok", [("[1, 2, 3]", True), ("[0, 0, 7]", True), ("[1, 2]", False),
                                      ("[1, 2, 3, 4]", False), ("[1, -1, 2]", False), ("[1, 2.0, 3]", False),
                                      ("[1, true, 3]", False), ("-1", False), ("4", True)])
def test_local_steps_list_has_one_non_negative_int_per_client(steps, ok):
    text = f"[clients]\ncount = 3\n[algorithm]\nlocal_steps = {steps}"
    if ok:
        cfg = parse_config(text)
        expected = tomllib.loads(f"v = {steps}")["v"]
        expected = expected if isinstance(expected, list) else [expected] * 3
        assert [client_local_steps(cfg, i) for i in range(3)] == expected
    else:
        assert "'algorithm.local_steps'" in error_of(text)


@pytest.mark.parametrize("kind", ["hierarchical", "sequential"])
def test_edges_required_for_edge_topologies(kind):
    walker = '[algorithm]\nname = "fedchs"\n' if kind == "sequential" else ""   # its model walks the edges
    assert "'topology.edges'" in error_of(f"{walker}[topology]\nkind = \"{kind}\"\nedges = 0")
    assert parse_config(f"{walker}[topology]\nkind = \"{kind}\"\nedges = 1").topology.edges == 1
    assert parse_config("[topology]\nkind = \"star\"\nedges = 0").topology.edges == 0


@pytest.mark.parametrize("assignment,ok", [
    ("[[0, 2], [1, 3]]", True),
    ("[[3, 2, 1], [0]]", True),
    ("[[0, 1], [1, 3]]", False),      # 1 twice, 2 missing
    ("[[0, 1], [2]]", False),         # 3 missing
    ("[[0, 1], [2, 3, 4]]", False),   # 4 is not a client
    ("[[0, 1, 2, 3]]", False),        # one list for two edges
    ("[[0, 1], [2, 3], []]", False),  # three lists for two edges
    ("[[0, 1], 2]", False),           # an entry that is not a list
    ("[[0, 1], [2, \"3\"]]", False),  # a client id that is not an int
    ("\"nearest\"", False),           # an unknown strategy
])
def test_explicit_assignment_covers_each_client_once(assignment, ok):
    text = f"[clients]\ncount = 4\n[topology]\nkind = \"hierarchical\"\nedges = 2\nassignment = {assignment}"
    if ok:
        assert parse_config(text).topology.assignment == tomllib.loads(f"v = {assignment}")["v"]
    else:
        assert "'topology.assignment'" in error_of(text)


# ----------------------------------------------------------------------------- resolution helpers
@pytest.mark.parametrize("per_round,count", [(0.25, 50), (0.1, 7), (0.001, 10), (1.0, 9), (3, 9), (1, 1)])
def test_resolve_clients_per_round(per_round, count):
    cfg = parse_config(f"[clients]\ncount = {count}\nper_round = {per_round!r}")
    expected = max(1, math.ceil(per_round * count)) if isinstance(per_round, float) else per_round
    assert resolve_clients_per_round(cfg) == expected


@pytest.mark.parametrize("min_results,sampled,expected", [(0, 5, 0), (3, 5, 3), (8, 5, 5), (0.5, 5, 3),
                                                           (0.01, 5, 1), (1.0, 5, 5), (0.4, 10, 4)])
def test_resolve_min_results(min_results, sampled, expected):
    cfg = parse_config(f"[run]\nmin_results = {min_results!r}")
    assert resolve_min_results(cfg, sampled) == expected


def test_min_results_defaults_to_one_result_per_round():
    """The documented default (docs/faults.md section 2, README "Configuration"): a round counts
    when one sampled client's result arrived, whatever the number sampled."""
    cfg = parse_config("[clients]\ncount = 10\nper_round = 0.3\n")
    assert cfg.run.min_results == 1
    assert [resolve_min_results(cfg, n) for n in (1, 3, 10)] == [1, 1, 1]


# ----------------------------------------------------------------------------- overrides
def test_overrides_typed_quoted_and_bare():
    cfg = parse_config("[run]\nrounds = 3\nname = \"x\"",
                       ["run.rounds=5", "algorithm.lr = 0.25", "data.partition=\"iid\"", "data.dataset=quadratic",
                        "run.name=2024", "data.standardize=false", "model.hidden=[8, 4]"])
    assert cfg.run.rounds == 5 and cfg.algorithm.lr == 0.25
    assert cfg.data.partition == "iid" and cfg.data.dataset == "quadratic"
    assert cfg.run.name == "2024"            # a str field keeps the text even when it reads as a number
    assert cfg.data.standardize is False and cfg.model.hidden == [8, 4]


def test_later_override_wins_and_file_is_not_needed_for_the_section():
    cfg = parse_config("", ["run.rounds=5", "run.rounds=6", "clients.count=4", "clients.per_round=2"])
    assert cfg.run.rounds == 6 and cfg.clients.count == 4 and cfg.clients.per_round == 2


@pytest.mark.parametrize("override,fragment", [
    ("run.rounds=0", "'run.rounds'"),
    ("run.rounds=many", "'run.rounds'"),
    ("run.roundz=3", "'run.roundz'"),
    ("algorithm.lr=[1, 2", "'algorithm.lr'"),
    ("data.partition=foo", "'data.partition'"),
    ("nosection.key=1", "[nosection]"),
    ("rounds=3", "SECTION.KEY"),
    ("run.rounds", "SECTION.KEY=VALUE"),
])
def test_bad_overrides_name_the_key(override, fragment):
    assert fragment in error_of("", [override])


def test_extra_key_overrides_land_in_options(dummy_algorithms):
    cfg = parse_config("[algorithm]\nname = \"dummy\"", ["algorithm.mu=0.1", "algorithm.mode=b",
                                                         "algorithm.sizes=[1, 2]"])
    assert cfg.algorithm.options == {"mu": 0.1, "mode": "b", "sizes": [1, 2]}
    assert cfg.algorithm.params == DummyParams(mu=0.1, mode="b", sizes=[1, 2])


def test_load_config_with_overrides_and_path_in_errors(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text("[run]\nrounds = 3\n[clients]\ncount = 4\n")
    cfg = load_config(path, ["clients.per_round=2"])
    assert cfg.run.rounds == 3 and cfg.clients.per_round == 2
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["clients.per_round=5"])
    assert str(err.value).startswith("override 'clients.per_round=5': ") and "'clients.per_round'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["clients.per_round=2", "run.rounds=-1"])
    assert str(err.value).startswith("override 'run.rounds=-1': ")
    path.write_text("[run]\nrounds = -1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["clients.per_round=2"])
    assert str(err.value).startswith(f"{path}: ") and "'run.rounds'" in str(err.value)
    path.write_text("[run\nrounds = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


# ----------------------------------------------------------------------------- options schemas
def test_options_validated_against_the_chosen_params(dummy_algorithms):
    cfg = parse_config("[algorithm]\nname = \"dummy\"\nmu = 1\nrounds_between = 10\nsizes = [3, 4]\n"
                       "table = {a = 1}\nflag = true")
    assert cfg.algorithm.params == DummyParams(mu=1.0, rounds_between=10, sizes=[3, 4], table={"a": 1}, flag=True)
    assert type(cfg.algorithm.params.mu) is float
    assert cfg.algorithm.options == {"mu": 1, "rounds_between": 10, "sizes": [3, 4], "table": {"a": 1}, "flag": True}
    assert dummy_algorithms == ["dummy"]     # the lookup ran at validation time, once


@pytest.mark.parametrize("extra,key,fragment", [
    ("nu = 0.1", "algorithm.nu", "its own keys: flag, matrix, mode, mu, rounds_between, sizes, table, tag"),
    ("mu = -0.5", "algorithm.mu", ">= 0.0"),
    ("mu = \"big\"", "algorithm.mu", "expected a float"),
    ("rounds_between = 11", "algorithm.rounds_between", "<= 10"),
    ("rounds_between = 2.5", "algorithm.rounds_between", "expected an int"),
    ("mode = \"c\"", "algorithm.mode", "allowed: a, b"),
    ("sizes = 3", "algorithm.sizes", "expected a list"),
    ("sizes = [1, 2.5]", "algorithm.sizes[1]", "expected an int"),
    ("flag = 1", "algorithm.flag", "expected a bool"),
])
def test_algorithm_specific_keys_checked(dummy_algorithms, extra, key, fragment):
    msg = error_of(f"[algorithm]\nname = \"dummy\"\n{extra}")
    assert f"'{key}'" in msg and fragment in msg



def test_an_unknown_clients_key_names_the_clients_keys_not_a_choice():
    """[clients] has one options schema whatever its count: the message lists its keys and names
    no "choice" (it once read "for clients.count = '50'")."""
    msg = error_of("[clients]\ncount = 50\nnonsense = 2")
    assert "'clients.nonsense'" in msg and "clients.count" not in msg and "its own keys" not in msg
    assert "the [clients] option keys: " in msg and "straggler_mode" in msg and "per_round" in msg

def test_choice_without_params_takes_no_extra_keys(dummy_algorithms):
    cfg = parse_config("[algorithm]\nname = \"bare\"")
    assert cfg.algorithm.params is None and cfg.algorithm.options == {}
    msg = error_of("[algorithm]\nname = \"bare\"\nmu = 0.1")
    assert "'algorithm.mu'" in msg and "no extra keys" in msg


def test_unknown_choice_is_a_config_error_naming_the_chooser(dummy_algorithms):
    msg = error_of("[algorithm]\nname = \"nosuch\"")
    assert "'algorithm.name'" in msg and "nosuch" in msg and "dummy" in msg


def test_register_options_schema_rejects_bad_sections(monkeypatch):
    monkeypatch.setattr(config_module, "_OPTION_SCHEMAS", dict(config_module._OPTION_SCHEMAS))
    with pytest.raises(ValueError, match="nosuch"):
        register_options_schema("nosuch", "kind", lambda k: None)
    with pytest.raises(ValueError, match="model"):
        register_options_schema("model", "kind", lambda k: None)           # no options field
    with pytest.raises(ValueError, match="clients.kind"):
        register_options_schema("clients", "kind", lambda k: None)         # no such chooser key
    assert config_module._OPTION_SCHEMAS.get("clients", ("count",))[0] == "count"   # nothing was replaced


def test_fedavg_takes_no_algorithm_specific_keys():
    pytest.importorskip("fedhop.common.algorithms.fedavg")
    from fedhop.common.algorithms import registry
    fields = [f.name for f in dataclasses.fields(registry()["fedavg"].Params)]
    for name in ("mu", "lr"):
        assert name not in fields
    msg = error_of("[algorithm]\nname = \"fedavg\"", ["algorithm.mu=0.1"])
    assert "'algorithm.mu'" in msg
    msg = error_of("[algorithm]\nname = \"no_such_algorithm\"")
    assert "'algorithm.name'" in msg and "fedavg" in msg          # the registry's list of names
    assert isinstance(parse_config("").algorithm.params, registry()["fedavg"].Params)


# ----------------------------------------------------------------------------- TOML writer
ROUND_TRIP = r'''
[run]
name = "tab\there \"quoted\" back\\slash \u00e9\u4e2d bell\u0007 del\u007f cr\r end"
seed = 3
min_results = 0.5
[clients]
count = 4
per_round = 2
[algorithm]
name = "dummy"
lr = 1e-05
server_lr = 1e+20
local_steps = [1, 0, 3, 2]
mu = -0.0
matrix = [[1.5, -2], [], [[3], ["x"]], [true, 1e-300]]
table = {plain = 1, "needs quoting" = [1, 2], "é" = {deep = "yes"}}
tag = ""
[topology]
kind = "hierarchical"
edges = 2
assignment = [[0, 3], [1, 2]]
[model]
hidden = [16, 8]
'''


def test_round_trip_with_nested_lists_and_options(dummy_algorithms):
    cfg = parse_config(ROUND_TRIP)
    text = config_to_toml(cfg)
    again = parse_config(text)
    assert again == cfg
    assert again.algorithm.options == cfg.algorithm.options and again.algorithm.params == cfg.algorithm.params
    assert "params" not in text and "options" not in text
    raw = tomllib.loads(text)
    # every field of every section is written, and the options flat in their section
    for name in ("run", "topology", "algorithm", "data", "model", "clients", "transport"):
        fields = [f.name for f in dataclasses.fields(getattr(cfg, name)) if f.name != "options"]
        assert set(fields) <= set(raw[name])
    assert raw["algorithm"]["matrix"] == [[1.5, -2], [], [[3], ["x"]], [True, 1e-300]]
    assert raw["algorithm"]["table"]["needs quoting"] == [1, 2]
    assert raw["run"]["name"] == cfg.run.name and "\x07" in raw["run"]["name"]
    assert "lr = 1e-05" in text.splitlines()


def test_round_trip_default_config():
    cfg = parse_config("")
    assert parse_config(config_to_toml(cfg)) == cfg


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_writer_rejects_non_finite_floats(bad):
    cfg = parse_config("")
    cfg.algorithm.options["x"] = [1.0, bad]
    with pytest.raises(ConfigError, match="algorithm.x"):
        config_to_toml(cfg)


def test_writer_rejects_unwritable_values():
    cfg = parse_config("")
    cfg.data.options["thing"] = object()
    with pytest.raises(ConfigError, match="data.thing"):
        config_to_toml(cfg)


@pytest.mark.parametrize("name, refused", [("scaffold", True), ("fednova", True), ("fedmid", True),
                                           ("local_sgda", True), ("fedavg", False), ("fedadam", False)])
def test_kappa2_above_one_is_refused_at_load_for_algorithms_without_an_edge_step(name, refused):
    text = (f'[algorithm]\nname = "{name}"\n[topology]\nkind = "hierarchical"\nedges = 2\nkappa2 = 2\n'
            f'[clients]\ncount = 10\n')
    if name == "local_sgda":   # a minimax algorithm runs on a minimax task
        text += '[data]\ndataset = "minimax_quadratic"\ndim = 2\n'
    if refused:
        with pytest.raises(ConfigError, match=f"topology.kappa2.*'{name}'"):
            parse_config(text)
    else:
        assert parse_config(text).topology.params.kappa2 == 2
    assert parse_config(text.replace("kappa2 = 2", "kappa2 = 1")).topology.params.kappa2 == 1


@pytest.mark.parametrize("extra, named", [("bogus = 1", "topology.bogus"), ('kappa2 = "x"', "topology.kappa2")])
def test_a_bad_topology_key_is_a_config_error_before_the_kinds_own_checks(extra, named):
    """The kind's checks (hierarchical's edges_per_round, the kappa2 edge-step rule) read its
    validated params, so a bad key is one ConfigError naming it, never a TypeError from them."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_config(f'[topology]\nkind = "hierarchical"\nedges = 2\n{extra}\n[algorithm]\nname = "scaffold"\n')


def test_a_byte_order_mark_before_the_toml_is_ignored(tmp_path):
    """Some editors save UTF-8 with a byte order mark: the config reads as without it (tomllib
    refused it as 'Invalid statement (at line 1, column 1)')."""
    text = '[run]\nrounds = 7\nseed = 3\n[clients]\ncount = 12\n'
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "plain.toml").write_text(text)
    assert load_config(tmp_path / "bom.toml") == load_config(tmp_path / "plain.toml")
    assert load_config(tmp_path / "bom.toml").run.rounds == 7


@pytest.mark.parametrize("text, key", [
    ('[data]\ndata_dir = "da\\u0000ta"', "data.data_dir"),
    ('[security]\ncerts_dir = "ce\\u0000rts"', "security.certs_dir"),
    ('[data]\ndataset = "npz"\npath = "mine\\u0000.npz"', "data.path"),
    ('[data]\ndataset = "femnist"\npath = "le\\u0000af"', "data.path"),
])
def test_a_nul_in_a_path_valued_key_is_a_config_error_naming_the_key(text, key):
    """A NUL cannot be in a file name: refused as the config loads, not as a ValueError of os later."""
    msg = error_of(text)
    assert msg.startswith(f"config key '{key}': ") and "must not hold a NUL character" in msg
