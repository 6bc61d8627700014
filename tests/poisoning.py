"""A model-poisoning client process and a run harness for it (tests/test_poisoning.py).

    python -m tests.poisoning client --scale -20 [fedhop.client arguments]

runs `python -m fedhop.client` with every FedAvg reply's tensors multiplied by `scale` (a
sign-flipped, boosted update: the classic "model replacement" attack, within its honest
weight, so nothing but robust aggregation can catch it).  `poisoned_run` starts a server
process, an honest client process and the poisoner, and returns the summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _poisoned_main(argv: list[str]) -> int:
    scale = float(argv[argv.index("--scale") + 1])
    rest = [a for i, a in enumerate(argv) if a != "--scale" and (i == 0 or argv[i - 1] != "--scale")]
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.algorithms.fedavg import FedAvg
    honest = FedAvg.client_update

    def poisoned(self, ctx, message):
        reply = honest(self, ctx, message)
        return Payload(tensors={k: v * scale for k, v in reply.tensors.items()}, scalars=reply.scalars)

    FedAvg.client_update = poisoned
    from fedhop.client.__main__ import main
    return main(rest)


def poisoned_run(cfg_file: Path, run_dir: Path, honest_ids: str, poison_ids: str | None, scale: float,
                 overrides: list[str] = (), timeout: float = 600.0) -> dict:
    """Server + one honest client process (+ one poisoner) as OS processes; the run's summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    port = run_dir / "port"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sets = [x for o in overrides for x in ("--set", o)]
    py = sys.executable
    procs = [subprocess.Popen([py, "-m", "fedhop.server", "--config", str(cfg_file), "--run-dir", str(run_dir),
                               "--port-file", str(port), *sets], env=env,
                              stdout=open(logs / "server.log", "wb"), stderr=subprocess.STDOUT)]
    common = ["--parent-file", str(port), "--ledger-dir", str(run_dir / "ledger")]
    procs.append(subprocess.Popen([py, "-m", "fedhop.client", "--clients", honest_ids, "--node-id", "client-proc0",
                                   *common], env=env, stdout=open(logs / "client-proc0.log", "wb"),
                                  stderr=subprocess.STDOUT))
    if poison_ids:
        procs.append(subprocess.Popen([py, "-m", "tests.poisoning", "client", "--scale", str(scale), "--clients",
                                       poison_ids, "--node-id", "client-proc1", *common], env=env,
                                      stdout=open(logs / "client-proc1.log", "wb"), stderr=subprocess.STDOUT))
    try:
        procs[0].wait(timeout)
        for p in procs[1:]:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    deadline = time.monotonic() + 5
    while not (run_dir / "summary.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads((run_dir / "summary.json").read_text())


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "client":
        print("usage: python -m tests.poisoning client --scale S [fedhop.client arguments]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_poisoned_main(sys.argv[2:]))
