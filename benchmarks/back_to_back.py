"""Back-to-back sends of one large model from one process: a walk's hops, a client's replies.

    python benchmarks/back_to_back.py [--mb 100] [--calls 15] [--no-checksum] [--json OUT]

The model is handed over before each call, as a round sends a message larger than one chunk
(common/transport/fabric.py `_prepare`): its frames are cut as gRPC pulls them.  Each call is a
lone send (nothing else in flight), so it should leave its few frames in the heap for the next
one (common/util/heap.py `SendBurst`).  Prints the median milliseconds per call, MB/s, and the
sender's minor page faults per call, which count the pages a call had to get from the kernel
again (a trim after every call shows here: about 5,600 a call at 100 MB, 22 MiB of frames).
`--no-checksum` sends without the XXH3 checksum, as `security.checksum = false` does (under TLS).
Run it with the malloc settings fedhop's processes use (it restarts itself with them).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics


def measure(nbytes: int, calls: int, chunk: int = 4 << 20, checksum: bool = True) -> dict:
    from fedhop.common.util.procexit import freeze_heap
    from fedhop.deploy.bench.bench import FedhopTransfer  # hands a model larger than a chunk over, as rounds do

    transfer = FedhopTransfer(nbytes, chunk)
    try:
        transfer.start()
        transfer.endpoint.checksum = checksum
        freeze_heap()
        transfer.call(0)   # warm-up
        times, faults = [], 0
        for i in range(1, calls + 1):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times.append(transfer.call(i))
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        trims = transfer.endpoint.sends.trims
    finally:
        transfer.stop()
    median = statistics.median(times)
    return {"bytes": nbytes, "calls": calls, "ms_per_call": median * 1e3, "mb_s": nbytes / median / 1e6,
            "sender_faults_per_call": faults / calls, "trims": trims}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="model size in MB (default 100)")
    ap.add_argument("--calls", type=int, default=15, help="timed calls, after one warm-up (default 15)")
    ap.add_argument("--no-checksum", action="store_true", help="send without the XXH3 checksum (security.checksum = false)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.mb <= 0 or args.calls < 1:
        ap.error("--mb must be positive and --calls at least 1")
    row = measure(int(args.mb * 1e6) // 4 * 4, args.calls, checksum=not args.no_checksum)
    print(f"{args.mb:g} MB x {args.calls} back-to-back calls{' without checksum' if args.no_checksum else ''}: {row['ms_per_call']:.1f} ms a call (median), "
          f"{row['mb_s']:.0f} MB/s, {row['sender_faults_per_call']:.0f} sender page faults a call, "
          f"{row['trims']} heap trims")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    from fedhop.deploy.launch.malloc import reexec_with_tuned_malloc
    reexec_with_tuned_malloc()   # the figures are for the settings fedhop's processes run with
    raise SystemExit(main())
