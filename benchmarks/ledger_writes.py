"""What recording a message costs when several threads record at once (issue 49: the server's
threads each receive one client process's batch and record its replies together).

Each of `--threads` threads adds its share of `--records` ledger records to one file-backed
`Ledger` (common/wire/ledger.py), in groups of a reply bundle's records (`--bundle`, 32: 16
replies, two records each), either one write a record (outside `Ledger.deferred`) or one write a
group (inside it, as the server receives a bundle).  Printed: microseconds of wall time and of
this process's CPU per record, the median of `--passes` passes, for a ledger that holds its
records (the server's) and one that does not (a client process's); and the cost of one message
id (`new_msg_id`) beside a UUID4's hex, which it replaced.  Every pass checks that the file
holds every record once (exit 1 otherwise).

    python benchmarks/ledger_writes.py [--records 32000] [--threads 1,4] [--passes 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import timeit
import uuid
from pathlib import Path

from fedhop.common.wire.ledger import Ledger, LedgerRecord, read_jsonl
from fedhop.common.wire.msgids import new_msg_id


def record(i: int) -> LedgerRecord:
    """A reply's receiver record as the server writes it (W2's sizes)."""
    return LedgerRecord(run_id="bench-a1b2c3d4", round=1, step=0, src=f"client-{i}", dst="server",
                        link="client-server", direction="up", method="train.reply", tensor_bytes=26280,
                        payload_bytes=26514, framed_bytes=26524, seconds=0.0012, recorder="server",
                        role="receiver", msg_id=f"{i:032x}", status="ok", wall_time=1.7e9 + i, error="")


def one_pass(records: list[LedgerRecord], threads: int, bundle: int, deferred: bool, hold: bool) -> tuple[float, float]:
    """(wall us, CPU us) per record; raises if the file lost or doubled a record."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.jsonl"
        ledger = Ledger(path, keep_drained=False, hold=hold)

        def work(share: list[LedgerRecord]) -> None:
            for k in range(0, len(share), bundle):
                if deferred:
                    with ledger.deferred():
                        for r in share[k:k + bundle]:
                            ledger.add(r)
                else:
                    for r in share[k:k + bundle]:
                        ledger.add(r)

        workers = [threading.Thread(target=work, args=(records[t::threads],)) for t in range(threads)]
        wall, cpu = time.perf_counter(), time.process_time()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        ledger.close()
        back = read_jsonl(path)
        if sorted(r.msg_id for r in back) != sorted(r.msg_id for r in records):
            raise RuntimeError(f"the file holds {len(back)} records, {len({r.msg_id for r in back})} distinct, "
                               f"of {len(records)}")
    return wall / len(records) * 1e6, cpu / len(records) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=32000)
    ap.add_argument("--threads", default="1,4", help="comma-separated thread counts")
    ap.add_argument("--bundle", type=int, default=32, help="records a group (a bundle of 16 replies: 32)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    records = [record(i) for i in range(args.records)]
    rows = []
    try:
        for hold in (True, False):
            for threads in (int(t) for t in args.threads.split(",")):
                cells = {}
                for deferred in (False, True):
                    passes = [one_pass(records, threads, args.bundle, deferred, hold) for _ in range(args.passes)]
                    cells[deferred] = (statistics.median(p[0] for p in passes), statistics.median(p[1] for p in passes))
                rows.append({"hold": hold, "threads": threads, "each_wall_us": cells[False][0],
                             "each_cpu_us": cells[False][1], "deferred_wall_us": cells[True][0],
                             "deferred_cpu_us": cells[True][1]})
    except RuntimeError as exc:
        print(f"ledger_writes: {exc}", file=sys.stderr)
        return 1
    print(f"{args.records} records, groups of {args.bundle}, median of {args.passes} passes; us a record (wall / CPU)")
    print(f"  {'ledger':<22} {'threads':>7} {'a write a record':>18} {'a write a group':>17}")
    for r in rows:
        kind = "holds records (server)" if r["hold"] else "file only (client)"
        print(f"  {kind:<22} {r['threads']:>7} {r['each_wall_us']:>8.2f} / {r['each_cpu_us']:<7.2f}"
              f" {r['deferred_wall_us']:>7.2f} / {r['deferred_cpu_us']:<7.2f}")
    ids = {"uuid4_hex_us": min(timeit.repeat(lambda: uuid.uuid4().hex, number=100_000, repeat=5)) * 10,
           "new_msg_id_us": min(timeit.repeat(new_msg_id, number=100_000, repeat=5)) * 10}
    print(f"  a message id: uuid.uuid4().hex {ids['uuid4_hex_us']:.2f} us, new_msg_id {ids['new_msg_id_us']:.2f} us")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **ids}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
