"""The config reference (docs/config.md, `fedhop config show`) against the schema and the loader,
and the saved config.toml: every resolved key, read back to an equal Config."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedhop.common.algorithms import algorithm_class, registry
from fedhop.common.config import SECTIONS, ConfigError, config_to_toml, load_config, parse_config
from fedhop.common.engine.heterogeneity import DevicesParams
from fedhop.common.tasks import builtin_datasets, dataset_params_class
from fedhop.common.topologies.graphs import TOPOLOGY_PARAMS
from fedhop.deploy.cli import configref
from fedhop.transports.torch.dist import TorchParams

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _choice_schemas() -> list[tuple[str, str | None, type]]:
    """(section, choice, Params) for every built-in choice with keys of its own, found from the
    registries themselves (not from the generator)."""
    out = [("algorithm", name, cls.Params) for name, cls in sorted(registry().items())]
    out += [("topology", kind, cls) for kind, cls in TOPOLOGY_PARAMS.items()]
    out += [("data", name, dataset_params_class(name)) for name in builtin_datasets()]
    out += [("transport", "torch", TorchParams), ("clients", None, DevicesParams)]
    return [(s, c, cls) for s, c, cls in out if cls is not None and dataclasses.fields(cls)]


def _companions(section: str, choice: str | None) -> list[str]:
    """What a choice needs besides itself to load: a sequential algorithm runs on the sequential
    topology, which runs only such an algorithm; hierarchical and sequential topologies need edges;
    a minimax algorithm runs on a minimax task, which runs only such an algorithm."""
    if section == "algorithm" and choice and getattr(algorithm_class(choice), "sequential", False):
        return ["topology.kind=sequential", "topology.edges=2"]
    if section == "topology" and choice == "sequential":
        return ["topology.edges=2", "algorithm.name=fedchs"]
    if section == "topology" and choice == "hierarchical":
        return ["topology.edges=2"]
    if section == "algorithm" and choice in ("local_sgda", "local_sgda_plus", "fed_norm_sgda", "fed_norm_sgda_plus"):
        return ["data.dataset=minimax_quadratic"]   # a minimax algorithm runs on a minimax task, and only it there
    if section == "data" and choice in ("minimax_quadratic", "robust_digits", "fair_digits"):
        return ["algorithm.name=local_sgda"]
    return []


def _chooser(section: str) -> str:
    return {"algorithm": "name", "topology": "kind", "data": "dataset", "transport": "kind"}.get(section, "")


def _base(section: str, choice: str | None) -> list[str]:
    return ([f"{section}.{_chooser(section)}={choice}"] if choice else []) + _companions(section, choice)


def _doc_tables(text: str) -> dict[tuple[str, str | None], set[str]]:
    """(section, choice) -> keys in its table; choice None for the common keys, "*" for keys that
    apply to every choice."""
    tables: dict[tuple[str, str | None], set[str]] = {}
    section, choices = "", [None]
    for line in text.splitlines():
        if m := re.match(r"## \[(\w+)\]$", line):
            section, choices = m.group(1), [None]
        elif line.startswith("#### "):
            choices = re.findall(r"`([^`]+)`", line)
        elif line.startswith("### Further ["):
            choices = ["*"]
        elif m := re.match(r"\| `(\w+)` \|", line):
            for c in choices:
                tables.setdefault((section, c), set()).add(m.group(1))
    return tables


# ----------------------------------------------------------------------------- docs/config.md
def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == configref.markdown(), \
        f"docs/config.md is out of date with the schema; regenerate it: {configref.REGENERATE}"


def test_reference_lists_every_field_of_every_schema_dataclass():
    tables = _doc_tables(DOC.read_text())
    for name, cls in SECTIONS.items():
        keys = {f.name for f in dataclasses.fields(cls)} - {"options"}
        assert keys and keys <= tables[(name, None)], (name, keys - tables[(name, None)])
    schemas = _choice_schemas()
    assert {s for s, _, _ in schemas} == {"algorithm", "topology", "data", "transport", "clients"}
    assert sum(1 for s, _, _ in schemas if s == "algorithm") >= 15
    for section, choice, cls in schemas:
        keys = {f.name for f in dataclasses.fields(cls)}
        got = tables.get((section, choice if choice else "*"), set())
        assert keys <= got, (section, choice, keys - got)
    # the example: fedadam's own keys, under fedadam
    assert {"beta1", "beta2", "tau"} <= tables[("algorithm", "fedadam")]
    assert "beta1" not in tables[("algorithm", None)] and "beta1" not in tables.get(("algorithm", "fedprox"), set())


def test_every_key_has_a_description_type_and_default():
    keys = configref.all_keys()
    assert len(keys) >= 200
    missing = [k.name for k in keys if not k.help]
    assert not missing, f"keys without a description (add help= metadata to the field): {missing}"
    assert all(k.type for k in keys)


def test_allowed_values_are_what_the_loader_enforces(tmp_path):
    """Every numeric bound and choice list the reference states: a value just outside it is refused
    by load_config, naming the key; the bound itself (or each choice) is accepted."""
    checked = 0
    for section, choice, cls in [(s, None, c) for s, c in SECTIONS.items()] + _choice_schemas():
        base = _base(section, choice)
        for f in dataclasses.fields(cls):
            rules = f.metadata
            if f.name == "options" or not ({"min", "min_exclusive", "max", "choices"} & set(rules)):
                continue
            if f.name in {g.name for g in dataclasses.fields(SECTIONS[section])} and cls is not SECTIONS[section]:
                continue   # shadowed by a common key (see test_shadowed_keys_are_marked)
            key = f"{section}.{f.name}"
            bad = []
            if "choices" in rules:
                bad.append('"no-such-choice"')
            is_int = isinstance(_default(f), int) and not isinstance(_default(f), bool)
            if "min" in rules:
                bad.append(repr(rules["min"] - (1 if is_int else 0.5)))
            if "min_exclusive" in rules:
                bad.append(repr(rules["min_exclusive"] if not is_int else int(rules["min_exclusive"])))
            if "max" in rules:
                bad.append(repr(rules["max"] + (1 if is_int else 0.5)))
            for value in bad:
                with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
                    parse_config("", base + [f"{key}={value}"])
            checked += 1
    assert checked >= 80


def test_every_reference_key_set_to_its_default_is_accepted(tmp_path, monkeypatch):
    """A config file that sets every key of a choice to the reference's default loads, and gives
    the config that leaving the keys out gives."""
    monkeypatch.chdir(tmp_path)
    for section, choice, cls in [(s, None, c) for s, c in SECTIONS.items()] + _choice_schemas():
        common = {f.name for f in dataclasses.fields(SECTIONS[section])}
        docs = {k.key: k for k in configref.common_keys(section)}
        lines = [f"[{section}]"]
        for f in dataclasses.fields(cls):
            if f.name == "options" or (cls is not SECTIONS[section] and f.name in common):
                continue
            if f.name == _chooser(section) and choice:
                continue
            default = _default(f)
            if default is None:
                continue   # an optional key: unset is its default, and TOML has no null
            if cls is SECTIONS[section]:
                assert docs[f.name].default == default, f"{section}.{f.name}"
            lines.append(f"{f.name} = {configref.toml_value(default)}")
        Path("all.toml").write_text("\n".join(lines) + "\n")
        cfg = load_config("all.toml", _base(section, choice))
        assert cfg == parse_config("", _base(section, choice)), (section, choice)
        if cls is not SECTIONS[section]:
            assert getattr(cfg, section).params == cls(), (section, choice)


def test_shadowed_keys_are_marked():
    """A data set's key named like a common [data] key cannot be set (the common key takes it):
    the reference says so, and the saved config writes the key once."""
    marked = {(g.choices, k.key) for g in configref.groups("data") for k in g.keys if "shadowed" in k.help}
    expected = {((name,), f.name) for name in builtin_datasets() if dataset_params_class(name)
                for f in dataclasses.fields(dataset_params_class(name))
                if f.name in {g.name for g in dataclasses.fields(SECTIONS["data"])}}
    assert marked == expected
    for (name,), key in expected:
        text = config_to_toml(parse_config("", [f"data.dataset={name}"]))
        assert len(re.findall(rf"^{key} = ", text, re.M)) == 1


# ----------------------------------------------------------------------------- the saved config.toml
@pytest.mark.parametrize("section, choice, cls", _choice_schemas(), ids=lambda v: v if isinstance(v, str) else "")
def test_saved_config_holds_every_resolved_key_and_reads_back_equal(tmp_path, section, choice, cls):
    cfg = parse_config("", _base(section, choice))
    text = config_to_toml(cfg)
    raw = tomllib.loads(text)
    common = {f.name for f in dataclasses.fields(SECTIONS[section])}
    for f in dataclasses.fields(cls):
        if f.name in common:
            continue
        if _default(f) is None:
            assert re.search(rf"^# {f.name}: unset", text, re.M), f.name
        else:
            assert raw[section][f.name] == tomllib.loads(f"v = {configref.toml_value(_default(f))}")["v"], f.name
    for name, sec_cls in SECTIONS.items():
        assert {f.name for f in dataclasses.fields(sec_cls)} - {"options"} <= set(raw[name])
    path = tmp_path / "config.toml"
    path.write_text(text)
    again = load_config(path)
    assert again == cfg
    for name in SECTIONS:
        assert getattr(again, name).__dict__.get("params") == getattr(cfg, name).__dict__.get("params")
    assert config_to_toml(again) == text   # a resumed run's config digest matches the checkpoint's


def test_saved_config_keeps_given_values_and_fedadam_defaults():
    cfg = parse_config('[algorithm]\nname = "fedadam"\nbeta1 = 0.5\n[clients]\nslowdown = 2.0\n')
    raw = tomllib.loads(config_to_toml(cfg))
    assert raw["algorithm"]["beta1"] == 0.5 and raw["algorithm"]["beta2"] == 0.99 and raw["algorithm"]["tau"] == 1e-3
    assert raw["clients"]["slowdown"] == 2.0
    assert cfg.algorithm.options == {"beta1": 0.5}   # options: the keys that differ from their defaults
    assert parse_config(config_to_toml(cfg)) == cfg


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.toml")
                                            if p.name != "hosts.toml"))
def test_examples_round_trip(example):
    cfg = load_config(ROOT / "examples" / example)
    assert parse_config(config_to_toml(cfg)) == cfg


# ----------------------------------------------------------------------------- fedhop config show
def _fedhop(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    fedhop = Path(sys.executable).parent / "fedhop"
    cmd = [str(fedhop)] if fedhop.exists() else [sys.executable, "-m", "fedhop.deploy.cli.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, cwd=cwd)


def _show(capsys, *args: str) -> tuple[int, str, str]:
    """`fedhop config ...` in this process (the dispatch of deploy/cli/cli.py included)."""
    from fedhop.deploy.cli.cli import main
    code = main(["config", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_config_show_prints_every_key(capsys):
    code, out, err = _show(capsys, "show")
    assert code == 0, err
    for k in configref.all_keys():
        assert re.search(rf"^  {re.escape(k.key)} = {re.escape(k.default_text)} ", out, re.M), k.name
    for name in registry():
        assert name in out


def test_config_show_algorithm_from_another_folder(tmp_path):
    """The installed command, run as a user would, from a folder outside the repository."""
    done = _fedhop("config", "show", "fedadam", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "  beta1 = 0.9 " in done.stdout and "  beta2 = 0.99 " in done.stdout and "  tau = 0.001 " in done.stdout
    assert "lga_lambda" not in done.stdout and '  name = "fedadam"' in done.stdout
    assert "  lr = 0.05 " in done.stdout and "  rounds = 10 " in done.stdout   # the common keys too


def test_config_show_unknown_algorithm_is_one_line_and_exit_2(tmp_path):
    done = _fedhop("config", "show", "fedadamm", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "fedadamm" in lines[0] and "fedadam," in lines[0] and "scaffold" in lines[0]


@pytest.mark.parametrize("args", [("show", ""), ("show", "  "), ("show", "--toml", "")])
def test_config_show_an_empty_algorithm_is_refused_not_read_as_none(capsys, args):
    """`fedhop config show ""` (a script's unset variable) printed the common keys as if no
    algorithm had been named."""
    with pytest.raises(SystemExit) as stop:
        _show(capsys, *args)
    out = capsys.readouterr()
    assert stop.value.code == 2 and out.out == ""
    assert "empty" in out.err.strip().splitlines()[-1] and "ALGORITHM" in out.err


def test_config_show_toml_is_a_complete_loadable_config(tmp_path, capsys):
    for name in ("fedadam", "fedchs"):
        code, out, err = _show(capsys, "show", "--toml", name)
        assert code == 0, err
        Path(tmp_path / "exp.toml").write_text(out)
        cfg = load_config(tmp_path / "exp.toml")
        assert cfg.algorithm.name == name and cfg == parse_config("", _base("algorithm", name))
        raw = tomllib.loads(out)
        for f in dataclasses.fields(algorithm_class(name).Params):
            assert f.name in raw["algorithm"]
        lines = out.splitlines()
        for key in ("rounds", "lr"):   # each key under its description
            at = lines.index(next(line for line in lines if line.startswith(f"{key} = ")))
            assert lines[at - 1].startswith("# ") and len(lines[at - 1]) > 5
    with pytest.raises(SystemExit) as stop:
        _show(capsys, "show", "--toml")
    assert stop.value.code == 2 and "ALGORITHM" in capsys.readouterr().err


RUN_CONFIG = """
[run]
rounds = 2
[algorithm]
name = "fedadam"
beta1 = 0.5
local_steps = 2
batch_size = 0
[data]
dataset = "quadratic"
centers = [[1.0, 2.0], [3.0, -1.0]]
sizes = [1, 2]
[model]
init = "zeros"
[clients]
count = 2
processes = 1
"""


def test_a_run_folder_config_holds_the_algorithm_defaults_and_loads_back(tmp_path):
    """`fedhop run` from a user's folder: the run's config.toml (read by the server and client
    processes, which completed the run) names fedadam's defaults, and reads back to the config
    that ran, written the same again (what --resume compares with the checkpoint's digest)."""
    (tmp_path / "exp.toml").write_text(RUN_CONFIG)
    done = _fedhop("run", "exp.toml", "--out", "out", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = tmp_path / "out" / "config.toml"
    raw = tomllib.loads(saved.read_text())
    assert raw["algorithm"]["beta1"] == 0.5 and raw["algorithm"]["beta2"] == 0.99 and raw["algorithm"]["tau"] == 1e-3
    assert raw["data"]["noise"] == 0.0 and raw["clients"]["slowdown"] == 1.0   # the data set's and device defaults
    again = load_config(saved)
    assert config_to_toml(again) == saved.read_text()
    given = parse_config(RUN_CONFIG)
    for section in ("algorithm", "clients", "topology", "model"):
        assert getattr(again, section) == getattr(given, section)
        assert getattr(again, section).__dict__.get("params") == getattr(given, section).__dict__.get("params")
    assert again.data.params == given.data.params and again.data.options == given.data.options
