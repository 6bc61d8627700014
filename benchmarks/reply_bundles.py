"""What reply bundles save (issue 49; common/transport/grpc.py, Batches): one batched call of
`--clients` requests to a served process on loopback, each answered by a reply of `--numel`
float32 values, its replies sent as bundles of `transport.reply_bundle` replies (the wire today)
against one gRPC message per reply frame (the wire before reply bundles, patched into that
variant's process for the comparison).  Interleaved pairs of fresh processes; each prints the
best of `--repeats` batches.

    python benchmarks/reply_bundles.py [--pairs 6] [--clients 250] [--numel 2500] [--bundle 16]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CHILD = r'''
import sys, time, torch
import fedhop.common.transport.base as base
import fedhop.common.transport.grpc as g
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.transport.base import Batched
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
variant, clients, numel, bundle, repeats = sys.argv[1], *map(int, sys.argv[2:6])
if variant == "per-frame":
    def per_frame(endpoint, messages, handler):
        for i, message in enumerate(messages):
            yield from g._streamed(endpoint.serve_frames(message, handler, framing=base.batch_framing(i, map(len, message))))
    g.reply_bundles = per_frame
    init = g.BatchDecoder.__init__
    def unbundled(self, *a, **k):
        init(self, *a, **k)
        self.bundled = False
    g.BatchDecoder.__init__ = unbundled
reply = torch.randn(numel)
callee = GrpcEndpoint("client-proc0", Ledger())
callee.replies_per_bundle = bundle
address = callee.serve(lambda r: Payload(tensors={"d": reply}), "127.0.0.1:0")
caller = GrpcEndpoint("server", Ledger())
prepared = caller.prepare(Payload(tensors={"w": torch.randn(numel)}))
best = float("inf")
for rep in range(repeats):
    started = time.perf_counter()
    out = caller.call_many(address, [Batched(f"client-{k}", "train", prepared) for k in range(clients)],
                           round=rep, timeout=60)
    best = min(best, time.perf_counter() - started)
    assert all(isinstance(o, Payload) for o in out)
print(best)
caller.stop()
callee.stop()
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--clients", type=int, default=250)
    ap.add_argument("--numel", type=int, default=2500)
    ap.add_argument("--bundle", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"per-frame": [], "bundled": []}
    for _ in range(args.pairs):
        for variant in times:
            out = subprocess.run([sys.executable, "-c", CHILD, variant, str(args.clients), str(args.numel),
                                  str(args.bundle), str(args.repeats)], capture_output=True, text=True, check=True)
            times[variant].append(float(out.stdout.split()[-1]))
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{args.clients} replies of {args.numel} float32 in one batched call, best of {args.repeats} per process, "
          f"{args.pairs} interleaved pairs ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load}):")
    for variant, ts in times.items():
        print(f"  {variant:9s} median {1000 * statistics.median(ts):7.1f} ms  (min {1000 * min(ts):.1f}, "
              f"max {1000 * max(ts):.1f})")
    ratios = [a / b for a, b in zip(times["per-frame"], times["bundled"])]
    print(f"  per-frame / bundled: median {statistics.median(ratios):.2f}x over pairs "
          f"(bundled faster in {sum(r > 1 for r in ratios)} of {len(ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
