"""A run whose processes note what they measure (benchmarks/stage_cpu.py, benchmarks/round_timeline.py).

`fedhop run CONFIG --engine ENGINE` (processes by default) in a temporary folder, its processes
forked from this one after `install(folder)` has wrapped what they measure: each process writes
its figures as a JSON file in `folder` when it ends, and `forked_run` returns them.  The
processes must fork (a process started by exec has no wrappers: `run.torch_threads = 1` and CPU,
deploy/launch/forkstart.py; the in-process engine's workers likewise, deploy/launch/workers.py
`can_fork`), so `install` imports grpcio's modules in each child only, after the fork
(`os.register_at_fork`)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def forked_run(fedhop_main: Callable[[list[str]], int], config: str, install: Callable[[Path], None], name: str,
               summarise: Callable[[list[dict[str, Any]]], dict[str, Any]], engine: str = "processes"
               ) -> tuple[int, dict[str, Any]]:
    """(exit code, `summarise` of the JSON bodies the run's processes wrote); `fedhop_main` is the
    command line's `main` (deploy/cli/cli.py, a tier above this one: the script passes it in).  A code other than 0
    is fedhop's (2 for a config it refused, with its one line), or 1 where `summarise` raises
    ValueError (what does not hold); either is said on stderr as `name`'s."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "figures"
        folder.mkdir()
        install(folder)
        code = fedhop_main(["run", config, "--out", str(Path(tmp) / "run"), "--quiet", "--engine", engine])
        if code != 0:
            print(f"{name}: fedhop run exited {code}", file=sys.stderr)
            return code, {}
        bodies = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    try:
        return 0, summarise(bodies)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1, {}
