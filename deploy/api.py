"""The Python API: `fedhop.run(config, set=..., out=...)` and `fedhop.load(RUN_DIR)` (docs/api.md).

`run` plays the run as `fedhop run` does (it calls `run_local`, quiet, without the final table:
separate OS processes, or every role in this process with run.engine = "inprocess") and returns a `RunResult`: plain Python objects read back from the run directory
(summary.json, and run.db read-only through deploy/tools/runread.py), the same object `load` returns for
that directory later.

Errors are exceptions, not exit codes: a bad config (or a run folder `fedhop run` would refuse)
raises `ConfigError`; a run that ends other than completed raises `RunFailed`, which carries the
`RunResult` of what was recorded (None where the run wrote nothing readable); `check=False`
returns that result instead.  Ctrl-C stops every process, merges their ledgers, and raises
KeyboardInterrupt.
"""
from __future__ import annotations

import io
import os
import sqlite3
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhop.common.config import ConfigError, config_from_dict, config_to_toml, load_config
from fedhop.deploy.tools import runread

PANDAS_HINT = "pip install pandas (or pip install 'fedhop[pandas]')"


@dataclass(repr=False)
class RunResult:
    """What one run recorded.  `rounds` has one dict per recorded round: round, participants,
    sampled, failures, clients_dropped, wall_seconds, sim_seconds, every metric of the round, and
    cumulative_messages / cumulative_{tensor,payload,framed}_bytes (every message with round <= it,
    each counted once).  `totals` and `by_link` are the ledger's messages and bytes, overall and per
    link."""

    run_dir: Path
    status: str
    summary: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    by_link: dict[str, dict[str, int]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.summary.get("name") or self.config.get("run", {}).get("name") or self.run_dir.name)

    @property
    def final(self) -> dict[str, Any]:
        """The final evaluation (summary.json `final`)."""
        return dict(self.summary.get("final") or {})

    @property
    def columns(self) -> list[str]:
        """The per-round table's columns, in order (deploy/tools/runread.py `columns`)."""
        return runread.columns(self.rounds)

    def to_pandas(self):
        """The per-round table as a pandas DataFrame, one row per round (needs pandas)."""
        try:
            import pandas
        except ImportError:
            raise ImportError(f"RunResult.to_pandas() needs pandas, which is not installed: {PANDAS_HINT}") from None
        return pandas.DataFrame(self.rounds, columns=self.columns)

    rounds_frame = to_pandas

    def __repr__(self) -> str:
        final = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.final.items())
        return (f"RunResult({self.name!r}, status={self.status!r}, rounds={len(self.rounds)}, "
                f"framed_bytes={self.totals.get('framed_bytes', 0)}, final={{{final}}}, run_dir='{self.run_dir}')")


class RunFailed(RuntimeError):
    """A run that ended other than completed.  `result` holds what it recorded (or None where it
    wrote nothing readable), `exit_code` the status `fedhop run` would have exited with."""

    def __init__(self, message: str, result: RunResult | None, exit_code: int) -> None:
        super().__init__(message)
        self.result = result
        self.exit_code = exit_code


def load(run_dir: str | os.PathLike) -> RunResult:
    """The `RunResult` of a run directory (finished, failed or still going), read without writing
    to it.  FileNotFoundError where it holds neither summary.json nor run.db; ValueError naming the
    file where summary.json, run.db or config.toml cannot be read as one."""
    d = Path(run_dir).resolve()
    if not d.is_dir():
        raise FileNotFoundError(f"fedhop.load: {d} is not a directory")
    summary = runread.read_summary(d)
    has_db = (d / "run.db").is_file()
    if not summary and not has_db:
        raise FileNotFoundError(f"fedhop.load: {d} holds neither summary.json nor run.db; is it a run directory?")
    rows: list[dict[str, Any]] = []
    totals = runread.zero_totals()
    by_link: dict[str, dict[str, int]] = {}
    status = str(summary.get("status") or "")
    if has_db:
        rows, totals, by_link = runread.read_run_db(d)
        status = status or runread.run_status(d) or "unknown"
    config: dict[str, Any] = {}
    config_path = d / "config.toml"
    if config_path.is_file():
        try:
            config = tomllib.loads(config_path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_path}: not valid TOML ({exc})") from None
    return RunResult(run_dir=d, status=status or "unknown", summary=summary, rounds=rows, totals=totals,
                     by_link=by_link, config=config)


def _overrides(values: Mapping[str, Any] | Iterable[str] | None) -> list[str]:
    """`set=` as `--set` strings: {"run.seed": 1} -> ["run.seed=1"]; strings "K=V" pass as given."""
    if values is None:
        return []
    if isinstance(values, str):
        raise ConfigError(f"set={values!r}: give a dict such as {{'run.seed': 1}} or a list of 'SECTION.KEY=VALUE'")
    if isinstance(values, Mapping):
        from fedhop.common.config import toml_value  # the config's own TOML writer: strings quoted
        return [f"{key}={toml_value(value, str(key))}" for key, value in values.items()]
    return [str(v) for v in values]


class _Tee(io.TextIOBase):
    """sys.stderr for the length of a run: the text is kept, so that an error `run_local` prints
    becomes the exception's message, and passed on to `inner` (None: nothing printed)."""

    def __init__(self, inner) -> None:
        self.inner, self.text = inner, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.inner.write(s) if self.inner is not None else len(s)

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()

    def isatty(self) -> bool:   # the progress bar checks it
        return self.inner is not None and self.inner.isatty()

    def last_message(self, lines: int) -> str:
        kept = [ln for ln in self.text.getvalue().splitlines() if ln.strip()][-lines:]
        return "\n".join(kept).removeprefix("fedhop run: ")


def run(config: str | os.PathLike | Mapping[str, Any], *, set: Mapping[str, Any] | Iterable[str] | None = None,
        out: str | os.PathLike | None = None, force: bool = False, quiet: bool = True,
        check: bool = True) -> RunResult:
    """Run an experiment as `fedhop run CONFIG --set ... --out OUT` does and return its `RunResult`.

    `config`: a TOML file, or a dict of sections ({"run": {...}, "algorithm": {...}}).  `set`:
    overrides, {"run.seed": 1} or ["run.seed=1"].  `out`: the run directory, relative to the
    current folder (default: a new runs/NAME-seedS-YYYYmmdd-HHMMSS there); one that holds an earlier run
    is refused (ConfigError) unless `force`, which replaces it.  `quiet=False` shows the progress
    bar.  `check=False` returns the result of a failed run instead of raising RunFailed."""
    from fedhop.deploy.launch.launcher import export_plugin_path
    overrides = _overrides(set)
    with tempfile.TemporaryDirectory(prefix="fedhop-config-") as tmp:
        if isinstance(config, Mapping):
            path = Path(tmp) / "config.toml"
            export_plugin_path(path)   # a plug-in named in the dict: looked for in the working directory
            path.write_text(config_to_toml(config_from_dict(_plain(config))), encoding="utf-8")
        else:
            path = Path(config).expanduser().resolve()
        export_plugin_path(path)       # as `fedhop run` does: the config's folder, then the working directory
        load_config(path, overrides)   # raises ConfigError, with the message `fedhop run` prints
        chosen: list[Path] = []        # the run folder, as `fedhop run` chose it (default: a new runs/NAME-...)
        code, message = _run_local(str(path), overrides, None if out is None else str(out), quiet, force,
                                   chosen.append)
    if code == 2:   # refused before anything ran (the run folder, if one was taken, given back)
        raise ConfigError((message or "fedhop run refused the config").replace("with --force", "with force=True"))
    run_dir = chosen[0] if chosen else Path(out or ".").expanduser().resolve()
    if code == 130:
        raise KeyboardInterrupt(message)
    try:
        result: RunResult | None = load(run_dir)
    except (FileNotFoundError, ValueError, sqlite3.Error):   # nothing readable: RunFailed says so
        result = None
    if code == 0 and result is not None and result.status == "completed":
        return result
    if not check and result is not None:
        return result
    status = result.status if result is not None else "no records"
    error = (result.summary.get("error") if result is not None else "") or message
    raise RunFailed(f"run in {run_dir} ended with status {status!r}" + (f": {error}" if error else ""), result,
                    code or 1)


def _run_local(config_path: str, overrides: list[str], out: str | None, quiet: bool, force: bool,
               on_run_dir: Callable[[Path], None]) -> tuple[int, str]:
    from fedhop.deploy.launch.launcher import run_local
    tee = _Tee(None if quiet else sys.stderr)   # quiet: its errors are the exception's message, not printed
    saved, sys.stderr = sys.stderr, tee
    try:
        code = run_local(config_path, overrides, out, quiet=quiet, show_table=False, force=force,
                         on_run_dir=on_run_dir)
    finally:
        sys.stderr = saved
    return code, tee.last_message(1 if code == 2 else 15) if code != 0 else ""


def _plain(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a (possibly nested) mapping as plain dicts, so validating it changes nothing of the caller's."""
    return {k: _plain(v) if isinstance(v, Mapping) else (list(v) if isinstance(v, tuple) else v)
            for k, v in data.items()}
