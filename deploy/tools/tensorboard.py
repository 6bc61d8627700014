"""`fedhop report RUN... --tensorboard DIR`: TensorBoard event files of the runs (optional).

One sub-directory per run (its report name), holding, per round r:

- `metrics/NAME`: every numeric metric the rounds table records (accuracy, losses, objective,
  the round-time breakdown's `time_*` parts, heterogeneity counters);
- `bytes/cumulative_KIND`: the bytes of every message with round <= r (KIND: the report's
  `--bytes` choice), so TensorBoard's step axis is rounds, the y axis bytes;
- `time/round_wall_seconds` and, when the run has a virtual clock, `time/sim_seconds` (that
  round) and `time/cumulative_sim_seconds`.

Writing uses torch.utils.tensorboard, which needs the `tensorboard` package (the extra
`fedhop[tensorboard]`, also in `dev`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from fedhop.deploy.tools.report import RunData, _num


def run_dir_name(name: str) -> str:
    """A run's report name as a directory name (TensorBoard shows it as the run)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def write_events(runs: Sequence[RunData], out: Path, bytes_kind: str) -> list[Path]:
    """Write one event-file directory per run under `out`; returns the directories."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:   # torch's module imports the tensorboard package
        raise RuntimeError("--tensorboard needs the tensorboard package: pip install 'fedhop[tensorboard]' "
                           f"({exc})") from None
    written = []
    for run in runs:
        logdir = out / run_dir_name(run.name)
        writer = SummaryWriter(log_dir=str(logdir))
        try:
            sim_clock = 0.0
            for row in run.rounds:
                r = int(row["round"])
                for key, value in sorted((row.get("metrics") or {}).items()):
                    v = _num(value)
                    if v is not None:
                        writer.add_scalar(f"metrics/{key}", v, r)
                wall = _num(row.get("wall_seconds"))
                if wall is not None:
                    writer.add_scalar("time/round_wall_seconds", wall, r)
                sim = _num(row.get("sim_seconds"))
                if sim is not None:
                    sim_clock += sim
                    writer.add_scalar("time/sim_seconds", sim, r)
                    writer.add_scalar("time/cumulative_sim_seconds", sim_clock, r)
                sent = run.bytes_upto(r, bytes_kind)
                if sent is not None:
                    writer.add_scalar(f"bytes/cumulative_{bytes_kind}", sent, r)
        finally:
            writer.close()
        written.append(logdir)
    return written
