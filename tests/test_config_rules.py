"""The compatibility rules that live with their owner (common/config/rules.py calls them): each is
still enforced through `load_config` with the same one-line error, and the owner's
`config_problem` (or the algorithm's `edge_step_problem`) gives exactly that line.

A rule's owner is what the key it refuses chooses: the algorithm (common/algorithms/__init__.py),
the robust aggregation (common/engine/robust.py), the transport (common/transport/factory.py).
"""
from __future__ import annotations

import importlib
import tomllib

import pytest

from fedhop.common.config import ConfigError, load_config
from fedhop.common.topologies import builtin_specs

# one config per moved rule: (owner "module:function", TOML text, the error line it must give)
SEQUENTIAL = ", ".join(k for k, s in builtin_specs().items() if s.sequential_algorithms)
ROBUST_KINDS = " or ".join(f"'{k}'" for k, s in builtin_specs().items() if s.robust is not None)
RULES = {
    "sequential algorithm on a round topology": (
        "fedhop.common.algorithms:config_problem",
        '[algorithm]\nname = "fedchs"\n',
        "config key 'topology.kind': got 'star', but algorithm 'fedchs' walks one model over the edges and has no "
        f"server step (allowed: {SEQUENTIAL})"),
    "edge steps without an edge step": (
        "fedhop.common.algorithms:edge_step_problem",
        '[algorithm]\nname = "fednova"\n[topology]\nkind = "hierarchical"\nedges = 2\nkappa2 = 3\n',
        "config key 'topology.kappa2': got 3, but algorithm 'fednova' defines no edge step between server rounds; "
        "use kappa2 = 1"),
    "robust rule over an algorithm's own reduction": (
        "fedhop.common.algorithms:config_problem",
        '[algorithm]\nname = "fedlga"\n[security]\naggregation = "median"\n',
        "config key 'security.aggregation': 'median' replaces the weighted mean, but algorithm 'fedlga' reduces its "
        "replies its own way; use 'mean'"),
    "a composite term for an algorithm without one": (
        "fedhop.common.algorithms:config_problem",
        '[algorithm]\nname = "fedprox"\nregularizer = "nuclear"\nreg = 0.1\n',
        "config key 'algorithm.regularizer': got 'nuclear', but algorithm 'fedprox' has no composite term R(w) and "
        "would ignore it (one with: c_fedda, fast_fedda, fedda, fedmid, mc_fedda)"),
    "a composite weight for an algorithm without one": (
        "fedhop.common.algorithms:config_problem",
        '[algorithm]\nname = "scaffold"\nreg = 0.25\n',
        "config key 'algorithm.reg': got 0.25, but algorithm 'scaffold' has no composite term R(w) and would ignore "
        "it (one with: c_fedda, fast_fedda, fedda, fedmid, mc_fedda)"),
    "robust rule on a topology without groups": (
        "fedhop.common.engine.robust:config_problem",
        '[topology]\nkind = "gossip"\n[security]\naggregation = "krum"\n',
        f"config key 'security.aggregation': 'krum' works in topology.kind = {ROBUST_KINDS}, got 'gossip'"),
    "robust rule on a summing transport": (
        "fedhop.common.engine.robust:config_problem",
        '[transport]\nkind = "torch"\n[security]\naggregation = "trimmed_mean"\n',
        "config key 'security.aggregation': 'trimmed_mean' needs every update apart, but transport.kind = 'torch' "
        "sums them in a collective; use transport.kind = 'grpc'"),
    "compression on a summing transport": (
        "fedhop.common.transport.factory:config_problem",
        '[transport]\nkind = "torch"\n[algorithm]\ncompress = "qsgd"\n',
        "config key 'algorithm.compress': got 'qsgd', but transport.kind = 'torch' reduces uploads as raw float sums "
        "in a collective (allowed there: 'none'); use transport.kind = 'grpc' for QSGD"),
}


def owner(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("rule", list(RULES))
def test_a_moved_rule_is_enforced_by_the_loader_with_its_line(tmp_path, rule):
    ref, text, line = RULES[rule]
    path = tmp_path / "exp.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {line}"
    assert "\n" not in str(err.value)


#: per rule, the overrides that set its offending key back to the default: the config then loads
FIXES = {
    "sequential algorithm on a round topology": ["algorithm.name=fedavg"],
    "edge steps without an edge step": ["topology.kappa2=1"],
    "robust rule over an algorithm's own reduction": ["security.aggregation=mean"],
    "robust rule on a topology without groups": ["security.aggregation=mean"],
    "a composite term for an algorithm without one": ["algorithm.regularizer=none", "algorithm.reg=0"],
    "a composite weight for an algorithm without one": ["algorithm.reg=0"],
    "robust rule on a summing transport": ["security.aggregation=mean"],
    "compression on a summing transport": ["algorithm.compress=none"],
}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_moved_rule_is_its_owners(tmp_path, rule):
    """The owner's function finds no problem in the config with the offending key at its default,
    and gives exactly the loader's line once that key is set as the refused config sets it."""
    ref, text, line = RULES[rule]
    path = tmp_path / "exp.toml"
    path.write_text(text)
    cfg = load_config(path, FIXES[rule])
    assert owner(ref)(cfg) is None
    for section, table in tomllib.loads(text).items():   # break the rule again on the loaded config
        for key, value in table.items():
            obj = getattr(cfg, section)
            setattr(obj if hasattr(obj, key) else obj.params, key, value)
    assert owner(ref)(cfg) == line
