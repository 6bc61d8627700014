"""Download bytes and accuracy with coded broadcasts (`[compression] down`, docs/compression.md "Downlink").

FedAvg on digits as examples/fedavg_digits.toml sets it up (50 clients, Dirichlet(0.5), 10 a
round, MLP 64-10, 2 local epochs, 30 rounds), with every client in a process of its own
(`clients.processes = 50`: a receiver is one device, as in cross-device FL), so each round most
receivers have skipped rounds since they last took part.  Each broadcast compressor below runs
with the uploads plain; the table gives the download bytes (the ledger's tensor bytes of every
server-to-client message, `RunStore.bytes_per_round("down")`, shut-downs excluded), how many
messages were coded differences and how many the plain model (the first round's and resyncs:
summary.json's "downlink"), the final test accuracy, and the bytes and accuracy against plain
broadcasts.

Every run is `run_inmemory` (deploy/launch/inmemory.py) in this process, one after another: the same
endpoints, ledger and run.db as a real run, without sockets.

    python benchmarks/downlink_bytes.py --seeds 0,1 --json down.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "fedavg_digits.toml"

SETTINGS: dict[str, list[str]] = {
    "plain": [],
    "fp16": ['compression.down="fp16"'],
    "qsgd-15": ['compression.down="qsgd"', "compression.down_keys={levels = 15}"],
    "qsgd-15-b64": ['compression.down="qsgd"', "compression.down_keys={levels = 15, bucket = 64}"],
    "topk-10%": ['compression.down="topk"', "compression.down_keys={ratio = 0.1}"],
    "topk-1%": ['compression.down="topk"', "compression.down_keys={ratio = 0.01}"],
    "powersgd-r2": ['compression.down="powersgd"', "compression.down_keys={rank = 2}"],
    "powersgd-r4": ['compression.down="powersgd"', "compression.down_keys={rank = 4}"],
}


def measure(name: str, seed: int, rounds: int, folder: Path) -> dict:
    text = DIGITS.read_text()
    cfg = parse_config(text, ["clients.processes=50", f"run.seed={seed}", f"run.rounds={rounds}", "run.eval_every=0",
                              *SETTINGS[name]])
    summary, coord = run_inmemory(cfg, folder / f"{name}-{seed}")
    assert summary["status"] == "completed", summary
    store = RunStore(folder / f"{name}-{seed}" / "run.db")
    down = sum(r["tensor_bytes"] for k, r in store.bytes_per_round("down").items() if 1 <= k <= rounds)
    counts = summary.get("downlink", {"coded_messages": 0, "plain_messages": rounds * cfg.clients.per_round})
    return {"setting": name, "seed": seed, "down_bytes": down, "accuracy": coord.history[-1].metrics["test_accuracy"],
            "coded": counts["coded_messages"], "plain": counts["plain_messages"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated settings (default: all)")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in SETTINGS if not args.only or n in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name in names:
                rows.append(measure(name, seed, args.rounds, Path(tmp)))
                r = rows[-1]
                print(f"{name:12s} seed {seed}: down {r['down_bytes']:>10,d} B  coded {r['coded']:3d}  "
                      f"plain {r['plain']:3d}  accuracy {r['accuracy']:.4f}", flush=True)
    plain = {r["seed"]: r for r in rows if r["setting"] == "plain"}
    print("\n| broadcast | download bytes | vs plain | coded / plain messages | final accuracy (mean) | "
          "accuracy - plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        acc = statistics.mean(r["accuracy"] for r in mine)
        ratio = statistics.mean(r["down_bytes"] / plain[r["seed"]]["down_bytes"] for r in mine) if plain else float("nan")
        gap = statistics.mean(r["accuracy"] - plain[r["seed"]]["accuracy"] for r in mine) if plain else float("nan")
        print(f"| {name} | {statistics.mean(r['down_bytes'] for r in mine):,.0f} | {ratio:.3f} | "
              f"{statistics.mean(r['coded'] for r in mine):.0f} / {statistics.mean(r['plain'] for r in mine):.0f} | "
              f"{acc:.4f} | {gap:+.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
