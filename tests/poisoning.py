"""A model-poisoning client process and a run harness for it (tests/test_poisoning.py).

    python -m tests.poisoning client --scale -20 [fedhop.client arguments]

runs `python -m fedhop.client` with every FedAvg reply's tensors multiplied by `scale` (a
sign-flipped, boosted update: the classic "model replacement" attack, within its honest
weight, so nothing but robust aggregation can catch it).  `poisoned_run` starts a server
process, an honest client process and the poisoner (hierarchical, `edges`: an edge process per
cluster, each with a client process of its honest clients and one of its poisoned ones), and
returns the summary.

    python -m tests.poisoning table [--rounds 12]

prints the poisoning table of docs/faults.md (clean and poisoned test accuracy per rule, star and
hierarchical with 2 edges; real processes).
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


def _ids(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def poisoned_run(cfg_file: Path, run_dir: Path, honest_ids: str, poison_ids: str | None, scale: float,
                 overrides: list[str] = (), timeout: float = 600.0, edges: list[list[int]] | None = None) -> dict:
    """Server + one honest client process (+ one poisoner) as OS processes; the run's summary.
    `edges` (hierarchical): the clients of each edge; the ids in `poison_ids` poison, wherever
    they sit."""
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
    ledger = ["--ledger-dir", str(run_dir / "ledger")]
    groups = [(port, honest_ids, poison_ids)]   # (parent's port file, honest ids, poisoned ids)
    if edges:
        poisoned = {int(i) for i in (poison_ids or "").split(",") if i}
        groups = []
        for e, cluster in enumerate(edges):
            edge_port = run_dir / f"edge-{e}.port"
            procs.append(subprocess.Popen([py, "-m", "fedhop.edge", "--parent-file", str(port), "--node-id",
                                           f"edge-{e}", "--port-file", str(edge_port), *ledger], env=env,
                                          stdout=open(logs / f"edge-{e}.log", "wb"), stderr=subprocess.STDOUT))
            groups.append((edge_port, _ids([c for c in cluster if c not in poisoned]),
                           _ids([c for c in cluster if c in poisoned])))
    k = 0
    for parent, honest, poison in groups:
        for module, ids in (("fedhop.client", honest), ("tests.poisoning", poison)):
            if not ids:
                continue
            extra = ["client", "--scale", str(scale)] if module == "tests.poisoning" else []
            procs.append(subprocess.Popen([py, "-m", module, *extra, "--clients", ids, "--node-id", f"client-proc{k}",
                                           "--parent-file", str(parent), *ledger], env=env,
                                          stdout=open(logs / f"client-proc{k}.log", "wb"), stderr=subprocess.STDOUT))
            k += 1
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


def table(rounds: int, out: Path) -> list[tuple[str, str, float | None]]:
    """(topology, rule, final test accuracy) for the clean run and each rule with client 9 poisoned."""
    from tests.test_poisoning import CFG, SCALE
    cfg = out / "exp.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(CFG.replace("rounds = 12", f"rounds = {rounds}"))
    rows = []
    for topo, edges, sets in (("star", None, []),
                              ("hierarchical", [list(range(5)), list(range(5, 10))],
                               ["topology.kind=hierarchical", "topology.edges=2"])):
        for rule in ("clean", "mean", "median", "trimmed_mean", "krum"):
            agg = "mean" if rule == "clean" else rule
            summary = poisoned_run(cfg, out / f"{topo}-{rule}", "0-9" if rule == "clean" else "0-8",
                                   None if rule == "clean" else "9", 1.0 if rule == "clean" else SCALE,
                                   [f"security.aggregation={agg}", *sets], edges=edges)
            acc = summary.get("final", {}).get("test_accuracy") if summary.get("status") == "completed" else None
            rows.append((topo, rule, acc))
            print(f"{topo:13s} {rule:13s} {acc if acc is None else round(acc, 3)}", flush=True)
    return rows


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "table":
        import argparse
        import tempfile
        ap = argparse.ArgumentParser(prog="python -m tests.poisoning table")
        ap.add_argument("--rounds", type=int, default=12)
        args = ap.parse_args(sys.argv[2:])
        with tempfile.TemporaryDirectory() as tmp:
            table(args.rounds, Path(tmp))
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] != "client":
        print("usage: python -m tests.poisoning client --scale S [fedhop.client arguments] | table [--rounds N]",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_poisoned_main(sys.argv[2:]))
