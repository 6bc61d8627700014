"""Per-process memory of client processes that host a LEAF natural partition (docs/datasets.md):

    python -m fedhop.deploy.bench.leaf_memory rss DIR --writers N --processes P

starts P processes at once, each doing what a client process does with FEMNIST in DIR (build the
task, then read every client of its block), and prints one JSON line per process: its clients,
samples, time to index and to load, and its resident and peak memory.  Linux only (/proc/self/status).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fedhop.common.config import parse_config
from fedhop.common.tasks import build_task
from fedhop.common.topologies.plan import client_blocks
from fedhop.common.util.cliparser import ArgumentParser


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def host(folder: str, clients: int, processes: int, index: int) -> dict:
    """Do what client process `index` of `processes` does with a LEAF natural partition: build the
    task, then read every client it hosts (after enough rounds each has been sampled).  Linux only
    (/proc/self/status)."""
    base = Path(folder).resolve()
    cfg = parse_config(f'[data]\ndataset = "femnist"\npartition = "natural"\ndata_dir = "{base.parent}"\n'
                       f'path = "{base.name}"\n[model]\nkind = "leaf_cnn"\n[clients]\ncount = {clients}\n'
                       f'processes = {processes}\n')
    t0 = time.perf_counter()
    task = build_task(cfg)
    index_s, index_rss = time.perf_counter() - t0, _status_kib("VmRSS")
    mine = client_blocks(clients, processes)[index]
    samples = sum(task.client_data(c).num_samples for c in mine)
    return {"process": index, "clients": len(mine), "samples": samples, "index_s": round(index_s, 2),
            "load_s": round(time.perf_counter() - t0 - index_s, 1), "rss_after_index_mib": index_rss // 1024,
            "rss_mib": _status_kib("VmRSS") // 1024, "peak_rss_mib": _status_kib("VmHWM") // 1024,
            "data_mib": samples * 784 * 4 // 2**20}


def rss(folder: str, clients: int, processes: int) -> list[dict]:
    """`processes` client processes at once, each running `host` on its block; their reports."""
    procs = [subprocess.Popen([sys.executable, "-m", "fedhop.deploy.bench.leaf_memory", "host", folder, "--writers",
                               str(clients), "--processes", str(processes), "--index", str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(processes)]
    return [json.loads(p.communicate()[0]) for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fedhop.deploy.bench.leaf_memory", description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("rss", "host"), help="rss: every process at once; host: one (--index)")
    ap.add_argument("folder", help="a FEMNIST folder in LEAF's layout (python -m fedhop.common.data.fakedata femnist DIR)")
    ap.add_argument("--writers", type=int, default=20, help="clients (FEMNIST writers)")
    ap.add_argument("--processes", type=int, default=4, help="client processes")
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.kind == "rss":
        for row in rss(a.folder, a.writers, a.processes):
            print(json.dumps(row))
    else:
        print(json.dumps(host(a.folder, a.writers, a.processes, a.index)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
