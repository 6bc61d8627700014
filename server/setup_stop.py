"""The records of a run stopped while its server built the run's task and model.

The build (a user's model factory, a data set read) may take any time, so a stop signal cuts it
(common/util/procexit.py `stops_raised`) instead of waiting for it; no round ran and no model
exists, so the records say only that: config.toml, run.db with the run's row "stopped" and a
`run_stopped` event, and a summary.json with the keys every run has (`Coordinator.finalize`),
no final metrics and no parameters.  A resumed run's folder is left as it was: its records are
the earlier attempt's, and `fedhop run --resume` can try again.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from fedhop.common.config import Config, config_to_toml, resolve_clients_per_round
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.procexit import ignore_stops, stop_reason


def stopped_in_setup(cfg: Config, run_dir: Path, exc: BaseException, resume: bool, wall_seconds: float) -> tuple[int, str]:
    """A stop (`exc`: KeyboardInterrupt or Stopped) cut the build: later stops ignored, a new run
    recorded stopped (`record_stopped_in_setup`), a resumed one left as it was.  Returns the exit
    status a shell reports for the signal and the line saying so."""
    ignore_stops()
    reason, code = stop_reason(exc)
    if resume:
        return code, f"{reason} while the run's task and model were built; the run's records are as they were"
    record_stopped_in_setup(cfg, run_dir, reason, wall_seconds)
    return code, f"{reason} while the run's task and model were built; the run is recorded as stopped"


def record_stopped_in_setup(cfg: Config, run_dir: Path, reason: str, wall_seconds: float) -> dict:
    """Write a new run's records as stopped before its first round, by `reason` ("stopped by
    SIGINT (Ctrl-C)"); returns the summary written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_toml = config_to_toml(cfg)
    (run_dir / "config.toml").write_text(config_toml)
    run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
    error = f"{reason} while the run's task and model were built, before its first round"
    summary = {
        "status": "stopped",
        "error": error,
        "run_id": run_id,
        "name": cfg.run.name,
        "algorithm": cfg.algorithm.name,
        "topology": cfg.topology.kind,
        "transport": cfg.transport.kind,
        "engine": cfg.run.engine,
        "rounds_completed": 0,
        "rounds_planned": cfg.run.rounds,
        "final": {},
        "bytes": {"total": None, "by_link": {}},
        "failures": 0,
        "clients_dropped": 0,
        "round_retries": 0,
        "rounds_skipped": 0,
        "wall_seconds": wall_seconds,
        "num_parameters": None,   # the model was never built
        "exchanged_parameters": None,
        "num_clients": cfg.clients.count,
        "clients_per_round": resolve_clients_per_round(cfg),
    }
    store = RunStore(run_dir / "run.db")
    try:
        store.start_run(run_id=run_id, name=cfg.run.name, algorithm=cfg.algorithm.name, topology=cfg.topology.kind,
                        transport=cfg.transport.kind, config_toml=config_toml, started=time.time() - wall_seconds)
        store.add_event("run_stopped", node="server", detail=error, round=0)
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run_dir / "summary.json")
        store.finish_run("stopped")   # last: what `fedhop report` and the launcher read as "over"
    finally:
        store.close()
    return summary
