"""The experiment config: TOML -> a validated `Config` (DESIGN.md section 7), and back.

    cfg = load_config("exp.toml", overrides=["run.rounds=5", "algorithm.mu=0.1"])

Errors are `ConfigError` and name the key, the bad value and what is allowed.  The package is
split by job; this `__init__` re-exports the public names, so `from fedhop.common.config import ...`
is the one import path:

- schema.py: the sections as dataclasses (each key's default, rules and help), `ConfigError`,
  `SECTIONS` and the values derived from a config; the modules below the loader import only this;
- validate.py: the dataclass validator (a value against its annotation and rules, a table into
  its dataclass);
- options.py: the option-schema registry (`register_options_schema`): the params dataclass of a
  section's choice-dependent keys (algorithm, data, topology, clients, transport);
- rules.py: the compatibility rules, the config's own and, called from there, those of their
  owners (`config_problem` of the robust rule, the transport, the algorithm; a topology kind's `check`);
- parse.py: TOML text or a file and `--set` overrides into a `Config` (`config_from_dict` runs the rest);
- write.py: the TOML writer (`config_to_toml` writes every key; reading it back gives an equal `Config`);
- parent.py: `parent_config`, the config a child process receives, with its processors installed.

The reference of every key is generated from the dataclasses: docs/config.md and `fedhop config
show` (deploy/cli/configref.py).  The loader resolves algorithms, topologies, data sets and processors
by name, so it sits above every other layer of common/ (tests/test_layers.py); importing it does
not import torch (what needs torch is imported where a check needs it).
"""
from __future__ import annotations

from fedhop.common.config.options import (
    _OPTION_SCHEMAS,
    options_chooser,
    options_schema,
    register_options_schema,
)
from fedhop.common.config.parent import parent_config
from fedhop.common.config.parse import apply_overrides, config_from_dict, load_config, parse_config
from fedhop.common.config.rules import FACTORY_DATASETS, FIXED_MODEL_DATASETS
from fedhop.common.config.schema import (
    SECTIONS,
    AlgorithmConfig,
    ClientsConfig,
    Config,
    ConfigError,
    DataConfig,
    EdgesConfig,
    ModelConfig,
    ProcessorConfig,
    RunConfig,
    SecurityConfig,
    TopologyConfig,
    TransportConfig,
    client_local_steps,
    resolve_clients_per_round,
    resolve_min_results,
)
from fedhop.common.config.validate import build_dataclass, check_value, eval_annotation, field_default
from fedhop.common.config.write import config_to_toml, shadowed_keys, toml_value

__all__ = [
    "FACTORY_DATASETS", "FIXED_MODEL_DATASETS", "SECTIONS", "AlgorithmConfig", "ClientsConfig", "Config",
    "ConfigError", "DataConfig", "EdgesConfig", "ModelConfig", "ProcessorConfig", "RunConfig", "SecurityConfig",
    "TopologyConfig", "TransportConfig", "_OPTION_SCHEMAS", "apply_overrides", "build_dataclass", "check_value",
    "client_local_steps", "config_from_dict", "config_to_toml", "eval_annotation", "field_default", "load_config",
    "options_chooser", "options_schema", "parent_config", "parse_config", "register_options_schema",
    "resolve_clients_per_round", "resolve_min_results", "shadowed_keys", "toml_value",
]
