"""The config a child process (a client host, an edge) receives from its parent."""
from __future__ import annotations

from typing import Any

from fedhop.common.config.parse import parse_config


def parent_config(text: str, node_id: str, parent: str, role: str = "") -> Any:
    """The run's config as a client's or edge's parent sent it, parsed here, and its processors
    for `role` (edge, client) installed in this process's chains (common/processors/pipeline.py `configure`).
    A config this process cannot use (one naming a plug-in it was not started with: refused by
    `check_allowed`, common/util/plugins.py, before any import) is one RuntimeError line; the role then exits with status 2."""
    from fedhop.common.processors.pipeline import configure  # local: the chain imports torch; parsing does not
    try:
        cfg = parse_config(text)
        if role:
            configure(cfg, role)
        return cfg
    except (ValueError, KeyError) as exc:   # ConfigError, PluginError and PluginRefused
        raise RuntimeError(f"{node_id}: refusing the run's config from {parent}: {exc}") from None
    except RecursionError:   # TOML nested deeper than the parser's recursion allows
        raise RuntimeError(f"{node_id}: refusing the run's config from {parent}: its TOML is nested too deeply "
                           f"to parse") from None
