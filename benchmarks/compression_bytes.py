"""Each compressor's bytes on each upload link: its formula against the run's ledger (docs/compression.md).

    python benchmarks/compression_bytes.py [--d 1000] [--rounds 2]

Runs FedAvg on a d-dimensional separable quadratic (6 clients, 3 sampled a round, star; and
hierarchical with 2 edges coding their partials) once per built-in compressor in this process
(deploy/launch/inmemory.py: real endpoints, in-memory sockets, the same ledger as gRPC), and prints one
Markdown row per compressor and link: the formula, its value for this d (from the compressor's
own `encoded_bytes`, for the parts of a d-element tensor), and the distinct tensor-byte counts
the ledger recorded on that link's uploads.  Equal columns are what tests/test_compression.py asserts.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory

# the keys each compressor runs with here, and its formula as docs/compression.md states it
SETTINGS = {
    "qsgd": ("levels = 3", "4 n_buckets + ceil(d (1 + ceil(log2(s + 1))) / 8)"),
    "topk": ("ratio = 0.5", "s_val k + min(4k, varint, ceil(d / 8))"),
    "randk": ("ratio = 0.5\nvalues = \"float16\"", "s_val k + min(4k, varint, ceil(d / 8))"),
    "threshold": ("threshold = 0.5", "s_val k + min(4k, varint, ceil(d / 8)), k = #{|v_i| >= t}"),
    "sign": ("", "ceil(d / 8)"),
    "scaled_sign": ("", "4 + ceil(d / 8)"),
    "rounding": ("bits = 4", "8 + ceil(d b / 8)"),
    "natural": ("", "ceil(9 d / 8)"),
    "fp16": ("", "2 d"),
    "bf16": ("", "2 d"),
}


def config(d: int, rounds: int, name: str, keys: str, hierarchical: bool) -> str:
    rng = np.random.default_rng(11)
    centers, curv = rng.normal(0, 2, size=(6, d)), rng.uniform(0.5, 2.0, size=(6, d))
    topology = 'kind = "hierarchical"\nedges = 2' if hierarchical else 'kind = "star"'
    per_round = 6 if hierarchical else 3
    return f"""
[run]
rounds = {rounds}
[topology]
{topology}
[algorithm]
name = "fedavg"
lr = 0.2
local_steps = 3
batch_size = 0
[data]
dataset = "quadratic"
centers = {centers.tolist()}
curvatures = {curv.tolist()}
sizes = [10, 30, 20, 5, 40, 15]
[model]
init = "zeros"
[clients]
count = 6
per_round = {per_round}
processes = 2
[transport]
kind = "grpc"
[compression]
up = "{name}"
{keys}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    d = args.d
    print(f"d = {d}, dense float32 = {4 * d} bytes\n")
    print("| compressor | keys | link | formula | formula bytes | ledger bytes (every upload) |")
    print("|---|---|---|---|---|---|")
    for name, (keys, formula) in SETTINGS.items():
        for hierarchical in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = parse_config(config(d, args.rounds, name, keys, hierarchical))
                summary, _ = run_inmemory(cfg, Path(tmp))
                assert summary["status"] == "completed", summary["error"]
                store = RunStore(Path(tmp) / "run.db")
                seen: dict[str, set[int]] = {}
                for r in store.messages():
                    if r["role"] == "sender" and r["direction"] == "up" and r["method"] in ("train.reply",
                                                                                           "edge_round.reply"):
                        seen.setdefault(r["link"], set()).add(int(r["tensor_bytes"]))
                store.close()
            compressor = cfg.compression.params
            probe = torch.linspace(-1, 1, d, dtype=torch.float32)   # a tensor for the formula's data-dependent terms
            parts = compressor.encode(probe, torch.Generator().manual_seed(0))
            expected = compressor.encoded_bytes(d, parts) if name != "threshold" else None   # its k depends on v
            for link, sizes in sorted(seen.items()):
                shown = f"{expected:,}" if expected is not None else "per upload (data dependent)"
                print(f"| {name} | {keys.replace(chr(10), ', ') or '-'} | {link} | {formula} | {shown} | "
                      f"{', '.join(f'{s:,}' for s in sorted(sizes))} |")


if __name__ == "__main__":
    main()
