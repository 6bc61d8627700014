"""`fedhop report RUN_DIR [RUN_DIR ...]`: compare runs (DESIGN.md section 6).

Reads each run directory's `summary.json` and `run.db`, prints an aligned table that fits
`TEXT_WIDTH` columns (the full table, with bytes per link, goes to `report.md`, the raw numbers
to `report.json`) and writes plots at print quality (`--format png|pdf|svg`; PNG at `--dpi`, 300
by default; 7 x 4.5 in, no text under 9 pt; `.pdf` or `.svg` for `.png` below with `--format`):

- `metric_vs_round.png`        the metric against the round,
- `metric_vs_bytes.png`        the metric against cumulative bytes (log x),
- `bytes_by_link.png`          bars of bytes per link per run,
- `metric_vs_sim_time.png`     the metric against simulated time, when the rounds table has it,
- `round_time_breakdown.png`   mean seconds per round in compute, communication, waiting, aggregation,
                                 evaluation (server/coordinator.py `time_breakdown`);
- with `--csv FILE_OR_DIR`, the per-round table of every run as CSV (`write_csv`): one row per run
  and round, every metric, and the cumulative messages and bytes (deploy/tools/runread.py);
- with `--tensorboard DIR`, TensorBoard event files, one directory per run (deploy/tools/tensorboard.py).

Conventions.  Round r in the rounds table means r rounds completed (round 0, where present, is
the model before training), so "rounds to target" is the first recorded round whose metric
meets the target, and "bytes to target" is the bytes of every message with round <= r (each
message counted once, see `RunStore`).  `rounds.sim_seconds` is the simulated duration of that
round; the simulated-time plot uses its running sum.  For metrics where lower is better (losses,
objectives, distances, errors) the target is met at metric <= target, otherwise at >= target.

Missing data (no run.db, no rounds, no messages) gives a note, never a crash.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sqlite3
import sys
import textwrap
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Sequence
from urllib.parse import quote

from fedhop.common.records.runstore import RunStore
from fedhop.common.util.cliparser import ArgumentParser
from fedhop.common.wire.ledger import BYTE_FIELDS, LINKS
from fedhop.deploy.launch.runfolder import new_folder
from fedhop.deploy.tools import runread
from fedhop.deploy.tools.ledgers import only_in_flight, stopped_agreement
from fedhop.server.agreement import Verdict, ledger_verdict

if TYPE_CHECKING:   # matplotlib is optional (the extra `report`): imported where a plot is drawn
    from matplotlib.typing import RcKeyType

LOWER_IS_BETTER_TOKENS: tuple[str, ...] = ("loss", "objective", "distance", "error", "gap", "regret", "norm",
                                           "subopt", "mse", "rmse")
BYTES_KINDS: dict[str, str] = {"tensor": "tensor_bytes", "payload": "payload_bytes", "framed": "framed_bytes"}


def lower_is_better(metric: str) -> bool:
    """Objective-like metrics (losses, objectives, distances, errors): smaller is better."""
    name = metric.lower()
    return any(tok in name for tok in LOWER_IS_BETTER_TOKENS)


#: metric names whose values are never negative (losses, distances, norms), and fractions in [0, 1]
NONNEGATIVE_TOKENS: tuple[str, ...] = ("loss", "distance", "norm", "mse", "rmse")
FRACTION_TOKENS: tuple[str, ...] = ("accuracy",)


def target_problem(target: float, metric: str) -> str | None:
    """Why `target` cannot be reached by `metric`'s values (a report would say "never" for every
    run), or None: not finite, an accuracy outside [0, 1], a loss-like value below 0."""
    name = metric.lower()
    if not math.isfinite(target):
        return f"--target-accuracy {target}: not a finite number"
    if any(tok in name for tok in FRACTION_TOKENS) and not 0.0 <= target <= 1.0:
        return f"--target-accuracy {target}: {metric} is a fraction; allowed 0 to 1"
    if any(tok in name for tok in NONNEGATIVE_TOKENS) and target < 0.0:
        return f"--target-accuracy {target}: {metric} is never negative; allowed 0 or more"
    return None


def meets(value: float, target: float, metric: str) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value <= target if lower_is_better(metric) else value >= target


def human_bytes(n: float | None) -> str:
    """Decimal (SI) units: 1 kB = 1000 B."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} PB"  # unreachable


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (x != x):
        return "nan"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4g}"


@dataclass
class RunData:
    """Everything the report reads from one run directory."""

    run_dir: Path
    name: str
    summary: dict[str, Any] = field(default_factory=dict)
    run_row: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    cumulative: dict[int, dict[str, int]] = field(default_factory=dict)
    cumulative_dir: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)   # "up" / "down" only
    by_link: dict[str, dict[str, int]] = field(default_factory=dict)  # no "total" key
    agreement: Verdict | None = None   # explained losses agree (server/agreement.py)
    has_messages: bool = False
    config: dict[str, Any] = field(default_factory=dict)   # config.toml flattened: {"run.seed": 0, ...}

    def ledger(self) -> tuple[str, str] | None:
        """The ledger check, as the table's word and its line: "agree"; "in flight" for a run that
        ended early (stopped, failed, no summary) whose ledgers differ only by messages one end
        recorded (deploy/tools/ledgers.py `stopped_agreement`, what `fedhop run` says after a stop);
        else "DISAGREE".  None without messages."""
        verdict = self.agreement
        if verdict is None:
            return None
        if verdict.ok:
            return "agree", verdict.summary()
        if self.field_("status") != "completed" and only_in_flight(verdict):
            return "in flight", stopped_agreement(verdict)
        return "DISAGREE", verdict.summary()

    @property
    def seed(self) -> int | None:
        seed = self.config.get("run.seed")
        return seed if isinstance(seed, int) and not isinstance(seed, bool) else None

    def field_(self, key: str) -> Any:
        return self.summary.get(key, self.run_row.get(key))

    def curve(self, metric: str) -> list[tuple[int, float]]:
        out = []
        for row in self.rounds:
            v = _num(row.get("metrics", {}).get(metric))
            if v is not None:
                out.append((int(row["round"]), v))
        return out

    def sim_curve(self, metric: str) -> list[tuple[float, float]]:
        out, clock = [], 0.0
        for row in self.rounds:
            sim = _num(row.get("sim_seconds"))
            if sim is None:
                continue
            clock += sim
            v = _num(row.get("metrics", {}).get(metric))
            if v is not None:
                out.append((clock, v))
        return out

    def has_sim_time(self) -> bool:
        return any(_num(r.get("sim_seconds")) is not None for r in self.rounds)

    def metric_names(self) -> set[str]:
        names = {k for r in self.rounds for k, v in r.get("metrics", {}).items() if _num(v) is not None}
        final = self.summary.get("final") or {}
        return names | {k for k, v in final.items() if _num(v) is not None}

    def total(self, kind: str) -> int | None:
        if not self.by_link:
            return None
        return sum(int(v.get(kind, 0)) for v in self.by_link.values())

    def bytes_upto(self, round_: int, kind: str, direction: str | None = None) -> int | None:
        """The `kind` bytes of every message up to `round_` (`direction` "up" or "down": only those)."""
        if not self.has_messages:
            return None
        table = self.cumulative if direction is None else self.cumulative_dir.get(direction, {})
        if round_ in table:
            return table[round_][kind]
        below = [r for r in table if r <= round_]
        return table[max(below)][kind] if below else 0


@dataclass
class RunRow:
    name: str
    run_dir: str
    seed: int | None
    algorithm: str
    topology: str
    transport: str
    status: str
    rounds: int | None
    final: float | None
    total_bytes: dict[str, int | None]
    by_link: dict[str, int]
    wall_seconds: float | None
    rounds_to_target: int | None = None
    bytes_to_target: int | None = None
    ledger: str = "-"
    epsilon: float | None = None   # [privacy]: epsilon at privacy.delta after the last round (docs/privacy.md)


@dataclass
class ReportResult:
    out_dir: Path
    metric: str | None
    target: float | None
    bytes_kind: str
    rows: list[RunRow]
    table: str
    markdown: str
    plots: list[Path]
    notes: list[str]
    csv: Path | None = None
    missing: str = ""          # what was asked for and could not be made (then the command exits 1)


# -- reading ------------------------------------------------------------------------------
def load_run(run_dir: Path, notes: list[str]) -> RunData | None:
    """Read one run directory; None (with a note) when it holds neither summary.json nor run.db."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        notes.append(f"{run_dir}: not a directory, skipped")
        return None
    data = RunData(run_dir=run_dir, name=run_dir.name)
    summary_path, db_path = run_dir / "summary.json", run_dir / "run.db"
    if summary_path.exists():
        try:   # bounded, and checked field by field (deploy/tools/runread.py): a crafted file is a note
            data.summary = runread.read_summary(run_dir)
        except OSError as exc:
            notes.append(f"{summary_path}: unreadable ({exc}), ignored")
        except ValueError as exc:
            notes.append(f"{exc}; ignored")
    else:
        notes.append(f"{run_dir}: no summary.json")
    if db_path.exists() and not db_path.is_file():
        notes.append(f"{db_path}: not a file, ignored")
        db_links = {}
    elif db_path.exists():
        try:
            with RunStore(db_path, create=False, read_only=True) as store:
                data.run_row = store.run() or {}
                data.rounds = store.rounds()
                links = store.bytes_by_link()
                total = links.pop("total")
                data.has_messages = total["messages"] > 0
                if data.has_messages:
                    data.cumulative = store.cumulative_bytes_by_round()
                    data.cumulative_dir = {d: store.cumulative_bytes_by_round(d) for d in ("up", "down")}
                    data.agreement = ledger_verdict(store)
                db_links = links
            _check_rounds(data.rounds, data.cumulative, db_links)
        except (sqlite3.DatabaseError, ValueError, RecursionError, TypeError, OverflowError, AttributeError,
                KeyError) as exc:   # a crafted file: JSON nested too deeply, text where a number belongs
            notes.append(f"{db_path}: unreadable ({type(exc).__name__}: {str(exc)[:200]}), ignored")
            data.run_row, data.rounds, data.cumulative, data.agreement = {}, [], {}, None
            data.cumulative_dir = {}
            data.has_messages = False
            db_links = {}
    else:
        notes.append(f"{run_dir}: no run.db (no per-round curves, no cumulative bytes)")
        db_links = {}
    if not data.summary and not db_path.exists():
        notes.append(f"{run_dir}: neither summary.json nor run.db, skipped")
        return None
    if not data.rounds and db_path.exists():
        notes.append(f"{run_dir}: run.db has no rounds")
    data.name = str(data.summary.get("name") or data.run_row.get("name") or run_dir.name)
    data.config = read_config(run_dir, notes)
    data.by_link = _summary_links(data.summary, notes, run_dir) or db_links
    if data.by_link and db_links and data.by_link != db_links:
        notes.append(f"{run_dir}: summary.json and run.db byte counts differ; the table uses summary.json")
    return data


CONFIG_LIMIT = 4 * 1024 * 1024    # a run's config.toml is a few kB; a larger one is not read


def read_config(run_dir: Path, notes: list[str]) -> dict[str, Any]:
    """The run's config.toml flattened to {"section.key": value} ({} where it is missing or unreadable)."""
    path = run_dir / "config.toml"
    try:
        if not path.is_file() or path.stat().st_size > CONFIG_LIMIT:
            return {}
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        notes.append(f"{path}: unreadable ({exc}), so the run is told apart by its folder only")
        return {}
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node
    walk(data, "")
    return flat


LABEL_SKIP = ("run.name",)         # what the name already says


def label_runs(runs: Sequence[RunData]) -> None:
    """Make every run's name tell it apart: runs that share a name get the config keys in which they
    differ ("fedavg-digits seed=1", "fedavg-digits lr=0.1, seed=0": the seed first, then the keys in
    order, each by its last part unless two keys share it), and runs with equal configs the folder."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.name, []).append(run)
    for name, group in groups.items():
        if len(group) < 2:
            continue
        keys = sorted({k for run in group for k in run.config} - set(LABEL_SKIP),
                      key=lambda k: (k != "run.seed", k))
        differ = [k for k in keys if len({repr(run.config.get(k)) for run in group}) > 1]
        last = [k.rsplit(".", 1)[-1] for k in differ]
        short = {k: (k.rsplit(".", 1)[-1] if last.count(k.rsplit(".", 1)[-1]) == 1 else k) for k in differ}
        for run in group:
            parts = [f"{short[k]}={_label_value(run.config.get(k))}" for k in differ]
            run.name = f"{name} {', '.join(parts)}" if parts else name
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:   # the same config run twice: tell them apart by folder
        if seen[run.name] > 1:
            run.name = f"{run.name} [{run.run_dir.name}]"


def _label_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _check_rounds(rounds: list[dict[str, Any]], cumulative: dict[int, dict[str, int]],
                  links: dict[str, dict[str, int]]) -> None:
    """ValueError where run.db holds what no run writes and the report would compute with: a round
    that is not a count, metrics that are not an object, byte counts that are not counts."""
    for row in rounds:
        if not runread._is_count(row.get("round")):
            raise ValueError(f"round {str(row.get('round'))[:40]!r} is not a count")
        if not isinstance(row.get("metrics"), dict):
            raise ValueError(f"round {row['round']}: metrics_json is not an object")
        for v in row["metrics"].values():
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1e300:   # float() would overflow
                raise ValueError(f"round {row['round']}: a metric of {str(v)[:40]} is out of range")
    for per in (*cumulative.values(), *links.values()):
        if not all(runread._is_count(v) for v in per.values()):
            raise ValueError("a byte count that is not a count below 2^63")


def _summary_links(summary: dict[str, Any], notes: list[str], run_dir: Path) -> dict[str, dict[str, int]]:
    by_link = (summary.get("bytes") or {}).get("by_link") if isinstance(summary.get("bytes"), dict) else None
    if not isinstance(by_link, dict):
        return {}
    out = {}
    for link, row in by_link.items():
        if link == "total" or not isinstance(row, dict):
            continue
        out[link] = {k: int(row.get(k, 0) or 0) for k in (*BYTE_FIELDS, "messages")}
    total = summary["bytes"].get("total")
    if isinstance(total, dict):
        for k in BYTE_FIELDS:
            if k in total and int(total[k]) != sum(r[k] for r in out.values()):
                notes.append(f"{run_dir}: summary.json bytes.total.{k} differs from the sum of bytes.by_link")
    return out


def choose_metric(runs: Sequence[RunData], notes: list[str]) -> str | None:
    names = set().union(*(r.metric_names() for r in runs)) if runs else set()
    for preferred in ("test_accuracy", "objective"):
        if preferred in names:
            return preferred
    if names:
        pick = sorted(names)[0]
        notes.append(f"no test_accuracy or objective in any run; using metric {pick!r}")
        return pick
    notes.append("no metric recorded in any run; no metric columns or curves")
    return None


# -- table --------------------------------------------------------------------------------
def make_row(run: RunData, metric: str | None, target: float | None, kind: str, notes: list[str]) -> RunRow:
    final = None
    if metric is not None:
        final = _num((run.summary.get("final") or {}).get(metric))
        curve = run.curve(metric)
        if final is None and curve:
            final = curve[-1][1]
    rounds = run.summary.get("rounds_completed")
    if rounds is None and run.rounds:
        rounds = max(int(r["round"]) for r in run.rounds)
    row = RunRow(
        name=run.name, run_dir=str(run.run_dir), seed=run.seed, algorithm=str(run.field_("algorithm") or "-"),
        topology=str(run.field_("topology") or "-"), transport=str(run.field_("transport") or "-"),
        status=str(run.field_("status") or "-"), rounds=int(rounds) if rounds is not None else None,
        final=final, total_bytes={k: run.total(k) for k in BYTE_FIELDS},
        by_link={link: int(v.get(kind, 0)) for link, v in sorted(run.by_link.items())},
        wall_seconds=_num(run.summary.get("wall_seconds")))
    judged = run.ledger()
    if judged is not None:
        row.ledger = judged[0]
    row.epsilon = run_epsilon(run)
    if target is not None and metric is not None:
        hit = next((r for r, v in run.curve(metric) if meets(v, target, metric)), None)
        row.rounds_to_target = hit
        if hit is not None:
            row.bytes_to_target = run.bytes_upto(hit, kind)
            if row.bytes_to_target is None:
                notes.append(f"{run.name}: no messages in run.db, bytes to target unknown")
        elif run.curve(metric):
            notes.append(f"{run.name}: never reached {metric} {'<=' if lower_is_better(metric) else '>='} {target}")
    return row


def run_epsilon(run: RunData) -> float | None:
    """A private run's epsilon after its last round (summary.json's privacy section, else the last
    round's `epsilon` metric); None for a run without [privacy] or without noise."""
    privacy = run.summary.get("privacy")
    if isinstance(privacy, dict) and _num(privacy.get("epsilon")) is not None:
        return _num(privacy.get("epsilon"))
    curve = run.curve("epsilon")
    return curve[-1][1] if curve else None


def table_cells(rows: Sequence[RunRow], metric: str | None, target: float | None,
                kind: str) -> tuple[list[str], list[list[str]]]:
    short = kind.replace("_bytes", "")
    private = any(r.epsilon is not None for r in rows)
    header = ["run", "seed", "algorithm", "topology", "rounds"]
    if metric is not None:
        header.append(f"final {metric}")
    if private:
        header.append("epsilon")
    header += ["tensor bytes", "framed bytes", f"{short} bytes by link", "wall s", "ledger"]
    if target is not None and metric is not None:
        header += ["rounds to target", f"{short} bytes to target"]
    body = []
    for r in rows:
        cells = [r.name, _fmt(r.seed), r.algorithm, r.topology, _fmt(r.rounds)]
        if metric is not None:
            cells.append(_fmt(r.final))
        if private:
            cells.append(_fmt(r.epsilon))
        links = "; ".join(f"{link} {human_bytes(b)}" for link, b in r.by_link.items()) or "-"
        cells += [human_bytes(r.total_bytes["tensor_bytes"]), human_bytes(r.total_bytes["framed_bytes"]), links,
                  "-" if r.wall_seconds is None else f"{r.wall_seconds:.1f}", r.ledger]
        if target is not None and metric is not None:
            cells += [_fmt(r.rounds_to_target), human_bytes(r.bytes_to_target)]
        body.append(cells)
    return header, body


TEXT_WIDTH = 100     # the printed report's lines, at most (report.md keeps the wide details)
MIN_CLIPPED = 8      # a clipped name column keeps at least this many characters


def text_tables(rows: Sequence[RunRow], metric: str | None, target: float | None, kind: str) -> str:
    """The printed table: one block of what each run is and what it cost (bytes per link only in
    report.md), and with a target a second block of rounds and bytes to it; each fits TEXT_WIDTH,
    the name columns clipped where needed.  A plug-in named by import path shows its attribute."""
    short = kind.replace("_bytes", "")
    private = any(r.epsilon is not None for r in rows)
    header = ["run", "seed", "algorithm", "topology", "rounds"] + ([metric] if metric is not None else [])
    header += ["epsilon"] if private else []
    header += [f"{short} bytes", "wall s", "ledger"]
    body = []
    for r in rows:
        cells = [r.name, _fmt(r.seed), r.algorithm.rpartition(":")[2], r.topology.rpartition(":")[2], _fmt(r.rounds)]
        cells += [_fmt(r.final)] if metric is not None else []
        cells += [_fmt(r.epsilon)] if private else []
        cells += [human_bytes(r.total_bytes[kind]), "-" if r.wall_seconds is None else f"{r.wall_seconds:.1f}",
                  r.ledger]
        body.append(cells)
    clip = {0, 2, 3} | ({5} if metric is not None else set())
    blocks = [render_text(header, body, TEXT_WIDTH, clip)]
    if target is not None and metric is not None:
        blocks.append(render_text(["run", "rounds to target", f"{short} bytes to target"],
                                  [[r.name, _fmt(r.rounds_to_target), human_bytes(r.bytes_to_target)] for r in rows],
                                  TEXT_WIDTH, {0}))
    return "\n\n".join(blocks)


def render_text(header: list[str], body: list[list[str]], max_width: int | None = None,
                clip: Collection[int] = ()) -> str:
    """An aligned table; with `max_width`, the widest of the `clip` columns narrowed one character at a
    time (to MIN_CLIPPED) until a line fits, their longer cells clipped by clip_distinct (different
    cells stay different; a legend under the table where only a number tells them apart)."""
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    numeric = [all(_looks_numeric(row[i]) for row in body) and bool(body) for i in range(len(header))]
    while max_width is not None and sum(widths) + 2 * (len(widths) - 1) > max_width:
        widest = max((i for i in clip if widths[i] > MIN_CLIPPED), key=lambda i: widths[i], default=None)
        if widest is None:
            break
        widths[widest] -= 1

    legend: list[str] = []
    columns = [clip_distinct([row[i] for row in body], w, legend) for i, w in enumerate(widths)]

    def line(fitted: list[str]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(fitted, widths, numeric)).rstrip()

    head = [h if len(h) <= w else h[:w - 1] + "~" for h, w in zip(header, widths)]
    rows = [line([col[j] for col in columns]) for j in range(len(body))]
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + rows + legend)


def clip_distinct(cells: Sequence[str], width: int, legend: list[str]) -> list[str]:
    """Each cell in at most `width` characters, cells that differ still differing once clipped.

    A cell longer than `width` keeps its head and ends in "~".  Where different cells would clip to
    the same text (runs labelled "fedavg-digits seed=0, lr=0.1" and "... seed=1, ..." differ past the
    head), each keeps instead what tells them apart: as much of the head as room leaves, "~", then
    the rest from the first column in which they differ ("fedav~0, lr=0.1"), or where that rest is
    too long, the part of it that fits between two "~" ("~0, lr=0.~").  Should even that leave two
    alike, each is shown as "[K]" and the line "[K]  FULL TEXT" appended to `legend` (K counts on from
    the legend's length), which render_text prints under the table."""
    def head(c: str) -> str:
        return c if len(c) <= width else c[:width - 1] + "~"

    def common(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    distinct = list(dict.fromkeys(cells))
    form = {c: head(c) for c in distinct}
    by_form: dict[str, list[str]] = {}
    for c in distinct:
        by_form.setdefault(form[c], []).append(c)
    for group in (g for g in by_form.values() if len(g) > 1):
        start = min(common(group[0], o) for o in group[1:])     # the group's first column that differs
        for c in group:
            tail = c[start:]
            if len(tail) <= width - 2:
                form[c] = c[:width - 1 - len(tail)] + "~" + tail
            else:                                               # the part from there, itself clipped
                form[c] = "~" + tail[:width - 2] + "~"
    if len(set(form.values())) < len(distinct):      # still alike: numbered, with a legend
        count: dict[str, int] = {}
        for c in distinct:
            count[form[c]] = count.get(form[c], 0) + 1
        for c in [c for c in distinct if count[form[c]] > 1]:
            legend.append(f"[{len(legend) + 1}]  {c}")
            form[c] = f"[{len(legend)}]"
    return [form[c] for c in cells]


# Markdown's and HTML's active characters in text from a run directory (a run's name, a metric's
# name, a path, a note quoting a crafted file): backslash-escaped (CommonMark escapes any ASCII
# punctuation) or, for < > &, written as entities, so a name renders as the text it is and never
# as a link, an image, emphasis, a table cell break or raw HTML.
_MD_ESCAPED = frozenset("\\`*_{}[]()!|~#")
_MD_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def md_text(text: Any) -> str:
    """`text` as literal Markdown text on one line: control characters (newlines included) as
    spaces, < > & as entities, Markdown punctuation backslash-escaped."""
    out = []
    for ch in str(text):
        if ch in _MD_ENTITIES:
            out.append(_MD_ENTITIES[ch])
        elif ch in _MD_ESCAPED:
            out.append("\\" + ch)
        elif ord(ch) < 32 or 127 <= ord(ch) < 160 or ch in "\u2028\u2029":
            out.append(" ")
        else:
            out.append(ch)
    return "".join(out)


def render_markdown(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table; every cell is literal text (`md_text`)."""
    esc = [[md_text(c) for c in row] for row in [header, *body]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in esc[1:]]
    return "\n".join(lines)


def _looks_numeric(cell: str) -> bool:
    head = cell.split(" ")[0]
    try:
        float(head)
        return True
    except ValueError:
        return cell == "-"


# -- plots --------------------------------------------------------------------------------
PLOT_FORMATS: tuple[str, ...] = ("png", "pdf", "svg")
FIGSIZE = (7.0, 4.5)    # inches: a page's text width
DPI = 300               # PNG pixels per inch: print quality (PDF and SVG are vector)
FONT_PT = 9             # the smallest text on a plot (annotations, legends, notes), in points
PLOT_STYLE: dict[RcKeyType, Any] = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": FONT_PT,
              "ytick.labelsize": FONT_PT, "legend.fontsize": FONT_PT, "svg.fonttype": "none", "pdf.fonttype": 42}


def _figure():
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=FIGSIZE, dpi=100)   # the saved resolution is `_save`'s dpi
    return fig, fig.add_subplot(1, 1, 1)


def _left_out(fig, left: Sequence[tuple[str, str]], notes: list[str], plot: str) -> None:
    """Say on the plot (and in the notes) which runs it leaves out and why."""
    if not left:
        return
    text = "left out: " + "; ".join(f"{name} ({why})" for name, why in left)
    fig.text(0.01, 0.005, text, fontsize=FONT_PT, color="dimgray", wrap=True, va="bottom")
    fig.subplots_adjust(bottom=0.2)
    notes.extend(f"{plot}: {name} left out ({why})" for name, why in left)


def _save(fig, path: Path, plots: list[Path], dpi: int = DPI) -> None:
    """Write `fig` in the format its suffix names (Agg for PNG, matplotlib's vector backends for
    PDF and SVG: a Figure without pyplot picks the canvas by format)."""
    fig.tight_layout(rect=(0, 0.08, 1, 1) if fig.texts else None)
    fig.savefig(path, format=path.suffix[1:], dpi=dpi, metadata=_METADATA.get(path.suffix[1:]))
    plots.append(path)


# no creation date in PDF and SVG files: the same runs give the same bytes
_METADATA = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


def _link_color(link: str, i: int) -> str:
    """The same link gets the same colour in every report."""
    return f"C{LINKS.index(link)}" if link in LINKS else f"C{(len(LINKS) + i) % 10}"


class PlotsUnavailable(RuntimeError):
    """The plots asked for cannot be made (matplotlib is missing): the report is written without
    them and `fedhop report` exits non-zero."""


def make_plots(runs: Sequence[RunData], metric: str | None, target: float | None, kind: str, out: Path,
               notes: list[str], fmt: str = "png", dpi: int = DPI) -> list[Path]:
    """Write the plots as `fmt` files (PLOT_FORMATS) into `out`; the paths written."""
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"report: format {fmt!r}; allowed: {', '.join(PLOT_FORMATS)}")
    try:
        import matplotlib
    except ImportError as exc:   # a dependency of fedhop: only a broken install lacks it
        raise PlotsUnavailable(f"no {fmt} plots: matplotlib cannot be imported ({exc}); reinstall fedhop "
                               f"(pip install --force-reinstall fedhop) or pip install matplotlib") from None

    matplotlib.use("Agg", force=False)
    plots: list[Path] = []
    with matplotlib.rc_context(PLOT_STYLE):
        _draw(runs, metric, target, kind, out, notes, plots, _Namer(fmt, dpi))
    return plots


@dataclass
class _Namer:
    """Each plot's file name in the chosen format, and the dpi it is saved at."""

    fmt: str
    dpi: int

    def __call__(self, stem: str) -> str:
        return f"{stem}.{self.fmt}"


def _draw(runs: Sequence[RunData], metric: str | None, target: float | None, kind: str, out: Path,
          notes: list[str], plots: list[Path], name: _Namer) -> None:
    from matplotlib.ticker import NullFormatter

    colors = [f"C{i % 10}" for i in range(len(runs))]
    short = kind.replace("_bytes", "")
    if metric is not None:
        curves = [(run, run.curve(metric), c) for run, c in zip(runs, colors)]
        if any(cv for _, cv, _ in curves):
            fig, ax = _figure()
            _left_out(fig, [(run.name, f"no per-round {metric}") for run, cv, _ in curves if not cv], notes,
                      name("metric_vs_round"))
            for run, cv, c in curves:
                if cv:
                    ax.plot([r for r, _ in cv], [v for _, v in cv], marker="o", markersize=3, color=c, label=run.name)
            if target is not None:
                ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
            _finish(fig, ax, "round", metric, f"{metric} against rounds", out / name("metric_vs_round"), plots, name.dpi)
        else:
            notes.append(f"no run has per-round {metric}; {name('metric_vs_round')} not written")

        for direction, stem, what in ((None, "metric_vs_bytes", ""), ("up", "metric_vs_upload_bytes", "upload "),
                                      ("down", "metric_vs_download_bytes", "download ")):
            _metric_against_bytes(curves, metric, target, kind, direction, stem, what, out, notes, plots, name)

        plot_against_epsilon(runs, metric, colors, out, plots, name)

        sim = [(run, run.sim_curve(metric), c) for run, c in zip(runs, colors) if run.has_sim_time()]
        if any(cv for _, cv, _ in sim):
            fig, ax = _figure()
            with_sim = {run.name for run, cv, _ in sim if cv}
            _left_out(fig, [(run.name, f"its {run.field_('topology') or '?'} rounds record no simulated time")
                            for run in runs if run.name not in with_sim], notes, name("metric_vs_sim_time"))
            for run, sim_cv, c in sim:
                if sim_cv:
                    ax.plot([t for t, _ in sim_cv], [v for _, v in sim_cv], marker="o", markersize=3, color=c,
                            label=run.name)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} against simulated time")
            ax.legend(fontsize=FONT_PT)
            ax.grid(alpha=0.3)
            _save(fig, out / name("metric_vs_sim_time"), plots, name.dpi)

    plot_time_breakdown(runs, out, plots, notes, name)

    links = sorted({link for run in runs for link in run.by_link})
    if links:
        fig, ax = _figure()
        positive = [float(v.get(kind, 0)) for run in runs for v in run.by_link.values() if v.get(kind, 0)]
        width = 0.8 / len(links)   # bars side by side on a log scale, each labelled: a 173 kB link stays visible
        for i, link in enumerate(links):
            xs = [k + (i - (len(links) - 1) / 2) * width for k in range(len(runs))]
            vals = [float(run.by_link.get(link, {}).get(kind, 0)) for run in runs]
            bars = ax.bar(xs, [v if v > 0 else float("nan") for v in vals], width, label=link,
                          color=_link_color(link, i))
            for bar, v in zip(bars, vals):
                if v > 0:
                    ax.annotate(human_bytes(v), (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=FONT_PT, rotation=90, xytext=(0, 2), textcoords="offset points")
        ax.set_yscale("log")
        if positive:   # every bar rises from well below the smallest one
            ax.set_ylim(min(positive) / 4, max(positive) * 4)
        ax.yaxis.set_major_formatter(_bytes_formatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(runs)), [run.name for run in runs])
        ax.set_ylabel(f"{short} bytes (log scale)")
        ax.set_title(f"{short} bytes per link")
        ax.legend(fontsize=FONT_PT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.tick_params(axis="x", labelrotation=20)
        _left_out(fig, [(run.name, "no byte counts") for run in runs if not run.by_link], notes, name("bytes_by_link"))
        _save(fig, out / name("bytes_by_link"), plots, name.dpi)
    else:
        notes.append(f"no byte counts in any run; {name('bytes_by_link')} not written")


def plot_against_epsilon(runs: Sequence[RunData], metric: str, colors: list[str], out: Path, plots: list[Path],
                         name: _Namer) -> None:
    """`metric` against epsilon (docs/privacy.md): each private run's rounds where both were recorded
    (epsilon after the round, the metric of that round); not written when no run is private."""
    curves = []
    for run, color in zip(runs, colors):
        eps = dict(run.curve("epsilon"))
        points = [(eps[r], v) for r, v in run.curve(metric) if r in eps]
        if points:
            curves.append((run, points, color))
    if not curves:
        return
    fig, ax = _figure()
    for run, points, color in curves:
        ax.plot([e for e, _ in points], [v for _, v in points], marker="o", markersize=3, color=color, label=run.name)
    _finish(fig, ax, "epsilon (at privacy.delta)", metric, f"{metric} against epsilon", out / name("metric_vs_epsilon"),
            plots, name.dpi)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path, plots: list[Path], dpi: int) -> None:
    """Label a line plot, give it its legend and grid, and save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=FONT_PT)
    ax.grid(alpha=0.3)
    _save(fig, path, plots, dpi)


TIME_PARTS = ("time_compute", "time_communication", "time_waiting", "time_aggregation", "time_evaluation")
OPTIONAL_PARTS = ("time_waiting",)   # absent in runs recorded before it existed: counted as 0


def _metric_against_bytes(curves: list, metric: str, target: float | None, kind: str, direction: str | None,
                          stem: str, what: str, out: Path, notes: list[str], plots: list[Path], name: "_Namer") -> None:
    """`metric` against the cumulative `kind` bytes of every message (`direction` None), or of the
    uploads ("up": what a compressor shrinks) or the downloads ("down") only."""
    short = kind.replace("_bytes", "")
    fig, ax = _figure()
    drawn = False
    left = []
    for run, cv, c in curves:
        pts = [(run.bytes_upto(r, kind, direction), v) for r, v in cv]
        pts = [(b, v) for b, v in pts if b is not None and b > 0]
        if pts:
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", markersize=3, color=c, label=run.name)
            drawn = True
        else:
            left.append((run.name, "no message bytes per round" if cv else f"no per-round {metric}"))
    if drawn:
        _left_out(fig, left, notes, name(stem))
        ax.set_xscale("log")   # first: setting the scale resets the axis' formatters
        ax.xaxis.set_major_formatter(_bytes_formatter())
        ax.xaxis.set_minor_formatter(_bytes_minor_formatter())
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(f"cumulative {what}{short} bytes")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against cumulative {what}{short} bytes")
        ax.legend(fontsize=FONT_PT)
        ax.grid(alpha=0.3, which="both")
        _save(fig, out / name(stem), plots, name.dpi)


def _bytes_formatter():
    """Axis ticks in the table's units (kB, MB), never an offset such as 1e7."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: human_bytes(v))


def _bytes_minor_formatter():
    """Minor ticks of a log byte axis: labelled where matplotlib's log formatter would label them
    (a few, when the axis spans less than a decade or two), but in the table's units, not 2x10^2."""
    from matplotlib.ticker import LogFormatter

    class BytesMinor(LogFormatter):
        def __call__(self, x, pos=None):
            return human_bytes(x) if super().__call__(x, pos) else ""

    return BytesMinor(labelOnlyBase=False)


def plot_time_breakdown(runs: Sequence[RunData], out: Path, plots: list[Path], notes: list[str],
                        name: _Namer = _Namer("png", DPI)) -> None:
    """Stacked bars of the mean seconds per round spent in each part (rounds table metrics)."""
    means = []
    for run in runs:
        rows = [r.get("metrics") or {} for r in run.rounds]
        rows = [m for m in rows if all(k in m for k in TIME_PARTS if k not in OPTIONAL_PARTS)]
        means.append([sum(m.get(k, 0.0) for m in rows) / len(rows) for k in TIME_PARTS] if rows else None)
    if not any(means):
        return
    fig, ax = _figure()
    _left_out(fig, [(run.name, f"its {run.field_('topology') or '?'} rounds record no time breakdown")
                    for run, m in zip(runs, means) if not m], notes, name("round_time_breakdown"))
    names = [run.name for run, m in zip(runs, means) if m]
    values = [m for m in means if m]
    bottom = [0.0] * len(values)
    for i, part in enumerate(TIME_PARTS):
        vals = [v[i] for v in values]
        label = part.removeprefix("time_")
        ax.bar(names, vals, bottom=bottom, label=label, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per round (mean)")
    ax.set_title("round-time breakdown")
    ax.legend(fontsize=FONT_PT)
    ax.tick_params(axis="x", labelrotation=20)
    _save(fig, out / name("round_time_breakdown"), plots, name.dpi)


# -- entry points -------------------------------------------------------------------------
def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path, target: float | None = None,
                 metric: str | None = None, bytes_kind: str = "tensor_bytes",
                 tensorboard: str | Path | None = None, fmt: str = "png", dpi: int = DPI,
                 csv_out: str | Path | None = None, metric_required: bool = False) -> ReportResult:
    """Read the runs, write report.md, report.json and the plots (`fmt`, PLOT_FORMATS) into
    `out_dir`, return the result.  With `tensorboard`, also event files there, one directory per
    run (deploy/tools/tensorboard.py); with `csv_out` (a .csv file, or a folder for rounds.csv), the
    per-round table of every run (`write_csv`)."""
    if bytes_kind not in BYTE_FIELDS:
        raise ValueError(f"report: bytes_kind={bytes_kind!r}; allowed: {', '.join(BYTE_FIELDS)}")
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"report: format {fmt!r}; allowed: {', '.join(PLOT_FORMATS)}")
    notes: list[str] = []
    runs = [r for r in (load_run(Path(d), notes) for d in run_dirs) if r is not None]
    label_runs(runs)
    if metric is None:
        metric = choose_metric(runs, notes)
    elif runs and not any(metric in r.metric_names() for r in runs):
        if metric_required:   # `fedhop report --metric`: a misspelt name is the user's to fix, before anything is written
            recorded = sorted(set().union(*(r.metric_names() for r in runs)))
            raise RuntimeError(f"--metric {metric}: recorded in none of the runs (recorded: "
                               f"{', '.join(recorded) or 'no metric'})")
        notes.append(f"metric {metric!r} is recorded in none of the runs")
    problem = None if target is None else target_problem(target, metric or "")
    if problem is not None:   # before anything is written
        raise RuntimeError(problem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [make_row(run, metric, target, bytes_kind, notes) for run in runs]
    header, body = table_cells(rows, metric, target, bytes_kind)
    table = text_tables(rows, metric, target, bytes_kind)
    ledgers = [(run.name, run.ledger()) for run in runs]
    judged = [(name, said[1]) for name, said in ledgers if said is not None]
    agreement = [f"{name}: {verdict}" for name, verdict in judged]
    md = ["# fedhop report", "", render_markdown(header, body), ""]
    if judged:
        md += ["## Ledger agreement", "", *[f"- {md_text(name)}: {md_text(verdict)}" for name, verdict in judged], ""]
    try:
        plots = make_plots(runs, metric, target, bytes_kind, out, notes, fmt, dpi) if runs else []
    except PlotsUnavailable as exc:
        plots, missing = [], str(exc)
        notes.append(missing)
    else:
        missing = ""
    if plots:   # a PDF is linked, not shown, by Markdown viewers
        md += ["## Plots", "", *[f"{'' if fmt == 'pdf' else '!'}[{p.stem}]({p.name})" for p in plots], ""]
    csv_path = write_csv(runs, csv_out, notes) if csv_out is not None else None
    if csv_path is not None:
        link = os.path.relpath(csv_path.resolve(), out.resolve())   # report.md's links are relative to its folder
        md += ["## Per-round table", "", f"[{md_text(csv_path.name)}]({quote(link)}): one row per run and "
                                         "round", ""]
    if tensorboard is not None and runs:
        from fedhop.deploy.tools.tensorboard import write_events
        dirs = write_events(runs, Path(tensorboard), bytes_kind)
        md += ["## TensorBoard", "", f"`tensorboard --logdir {tensorboard}`: {len(dirs)} runs", ""]
    if notes:
        md += ["## Notes", "", *[f"- {md_text(n)}" for n in notes], ""]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(
        {"metric": metric, "target": target, "bytes_kind": bytes_kind, "runs": [asdict(r) for r in rows],
         "agreement": agreement, "notes": notes}, indent=2), encoding="utf-8")
    disagree = [f"{name}: {said[1]}" for name, said in ledgers
                if said is not None and said[0] != "agree"]   # the agreeing ones: report.md
    return ReportResult(out_dir=out, metric=metric, target=target, bytes_kind=bytes_kind, rows=rows,
                        table="\n\n".join([table, *([wrap("\n".join(disagree))] if disagree else [])]),
                        markdown="\n".join(md), plots=plots, notes=notes, csv=csv_path, missing=missing)


CSV_NAME = "rounds.csv"   # the file `--csv DIR` writes in DIR


def csv_target(path: str | Path) -> Path:
    """`--csv`'s file: the path itself where it ends in .csv, else rounds.csv in that folder."""
    p = Path(path)
    return p if p.suffix.lower() == ".csv" else p / CSV_NAME


def write_csv(runs: Sequence[RunData], path: str | Path, notes: list[str]) -> Path:
    """The per-round table of every run (deploy/tools/runread.py `round_rows`: participants, sampled,
    failures, every metric, cumulative messages and bytes) as one CSV file: columns `run` (the
    report's name for it), `seed` and `run_dir`, then the round columns; a metric a run lacks is empty.
    Returns the file written."""
    target = csv_target(path)
    per_run: list[tuple[RunData, list[dict[str, Any]]]] = []
    for run in runs:
        if not (run.run_dir / "run.db").is_file():
            notes.append(f"{target.name}: {run.name} has no run.db, so no rows")
            continue
        try:
            rows = runread.read_run_db(run.run_dir)[0]
        except (sqlite3.DatabaseError, ValueError) as exc:   # ValueError: crafted content (runread)
            notes.append(f"{target.name}: {run.name}'s run.db is unreadable ({exc}), so no rows")
            continue
        per_run.append((run, rows))
    columns = ["run", "seed", "run_dir", *runread.columns([r for _, rows in per_run for r in rows])]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow([csv_inert(c) for c in columns])
        for run, rows in per_run:
            for row in rows:
                cells = {"run": run.name, "seed": run.seed, "run_dir": str(run.run_dir.resolve()), **row}
                writer.writerow([_csv_cell(cells.get(c)) for c in columns])
    return target


# What a spreadsheet reads as the start of a formula (OWASP "CSV Injection"): = + - @, and a tab
# or carriage return before one of them.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_inert(text: str) -> str:
    """`text` as a CSV cell no spreadsheet evaluates: one that starts like a formula gets a leading
    single quote (OWASP's rule), which spreadsheets show as text and do not display."""
    return "'" + text if text.startswith(FORMULA_START) else text


def _csv_cell(value: Any) -> Any:
    """A CSV cell: numbers as they are (floats in full precision), None empty, lists and dicts as
    JSON, text made inert (`csv_inert`: a run's name or a metric's value from a crafted run.db)."""
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return csv_inert(json.dumps(value))
    if isinstance(value, str):
        return csv_inert(value)
    return value


def wrap(text: str) -> str:
    """`text` with every line folded to TEXT_WIDTH, continuation lines indented (a path longer than
    a line is cut too: the full text is in report.md)."""
    return "\n".join(textwrap.fill(line, TEXT_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
                     for line in text.splitlines())


def default_out(base: Path | None = None) -> Path:
    """A new folder reports/report-YYYYmmdd-HHMMSS in the working directory (-2, -3, ... for reports
    made in the same second): outside runs/, so a `runs/*` glob never takes a report for a run, and
    never an earlier report's folder."""
    return new_folder((base or Path.cwd()) / "reports", f"report-{time.strftime('%Y%m%d-%H%M%S')}")


def check_out_dir(out: Path, force: bool) -> None:
    """An --out folder that holds an earlier report is replaced only with --force (RuntimeError)."""
    if (out / "report.md").exists() and not force:
        raise RuntimeError(f"--out {out}: holds an earlier report (report.md); name another folder, or replace it "
                           f"with --force")


def check_csv(given: str, force: bool) -> None:
    """An existing --csv file is replaced only with --force (RuntimeError), as an earlier report in --out."""
    target = csv_target(given)
    if os.path.lexists(target) and not force:
        where = "" if str(target) == given else f" ({target})"
        raise RuntimeError(f"--csv {given}{where}: a file is there; name another, or replace it with --force")


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="fedhop report", description="Compare fedhop runs: table and plots.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default=None, help="directory for report.md, report.json and the plots (default: "
                                                    "a new reports/report-YYYYmmdd-HHMMSS here); one that holds an "
                                                    "earlier report is refused unless --force")
    parser.add_argument("--force", action="store_true", help="replace an earlier report in --out and an existing "
                                                             "--csv file")
    parser.add_argument("--target-accuracy", "--target", dest="target", type=float, default=None,
                        help="target value of the metric (>= for accuracy-like, <= for loss/objective-like); "
                             "an accuracy's in 0 to 1, a loss's 0 or more")
    parser.add_argument("--metric", default=None, help="metric name (default: test_accuracy, else objective)")
    parser.add_argument("--bytes", dest="bytes_kind", choices=sorted(BYTES_KINDS), default="tensor",
                        help="byte count for the by-link, to-target and cumulative columns and plots")
    parser.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="also write TensorBoard event files here, one directory per run "
                             "(needs the tensorboard package: pip install 'fedhop[tensorboard]')")
    parser.add_argument("--csv", metavar="FILE_OR_DIR", default=None,
                        help=f"also write the per-round metrics and cumulative bytes of every run as CSV: this "
                             f"file (*.csv), or {CSV_NAME} in this folder; an existing file is refused unless "
                             f"--force")
    parser.add_argument("--format", dest="fmt", choices=PLOT_FORMATS, default="png",
                        help="plot file format (pdf and svg are vector graphics; default png)")
    parser.add_argument("--dpi", type=int, default=DPI, help=f"resolution of PNG plots (default {DPI})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not 50 <= args.dpi <= 1200:
        parser.error(f"--dpi {args.dpi}: allowed 50 to 1200")
    runs = [Path(d) for d in args.run_dirs]
    if not any(d.is_dir() and ((d / "run.db").is_file() or (d / "summary.json").is_file()) for d in runs):
        # nothing to report: one line, and no report folder made
        first = runs[0]
        why = ("no such folder" if not first.exists() else "a file, not a run folder" if not first.is_dir()
               else "not a run folder (no run.db or summary.json)")
        more = f" (and none of the other {len(runs) - 1} is a run folder)" if len(runs) > 1 else ""
        print(f"fedhop report: {first}: {why}{more}", file=sys.stderr)
        return 2
    odd_db = next((d / "run.db" for d in runs if (d / "run.db").exists() and not (d / "run.db").is_file()), None)
    if odd_db is not None:   # a folder or a pipe where a run's SQLite file belongs
        print(f"fedhop report: {odd_db}: not a file (a run's run.db is an SQLite file)", file=sys.stderr)
        return 2
    made: Path | None = None   # the default folder this command made (left empty by a refusal: removed)
    try:
        if args.out is not None:
            check_out_dir(Path(args.out), args.force)
        if args.csv is not None:
            check_csv(args.csv, args.force)
        out = Path(args.out) if args.out is not None else default_out()
        made = out if args.out is None else None
        result = build_report(args.run_dirs, out, target=args.target, metric=args.metric,
                              bytes_kind=BYTES_KINDS[args.bytes_kind], tensorboard=args.tensorboard, fmt=args.fmt,
                              dpi=args.dpi, csv_out=args.csv, metric_required=args.metric is not None)
    except RuntimeError as exc:
        print(f"fedhop report: {exc}", file=sys.stderr)
        if made is not None:
            for folder in (made, made.parent):   # reports/ too when this made it and it holds nothing else
                with contextlib.suppress(OSError):
                    folder.rmdir()
        return 2
    except OSError as exc:   # an output path that cannot be written (--out, --csv)
        print(f"fedhop report: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(result.table)
    for note in result.notes:
        print(wrap(f"note: {note}"))
    if not result.rows:
        print("fedhop report: none of the run directories could be read", file=sys.stderr)
        return 1
    print(wrap(f"wrote {result.out_dir / 'report.md'}" + "".join(f", {p.name}" for p in result.plots)))
    if result.csv is not None:
        print(wrap(f"wrote {result.csv}"))
    if result.missing:
        print(f"fedhop report: {result.missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
