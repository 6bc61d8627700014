"""What a server's main thread spends waiting for a round's calls (issue 49, item 4).

A round's fan-out waits on one future per sampled client (common/transport/fabric.py `gather`)
and, in the rounds, looks for a stop signal every WAIT_SLICE seconds
(common/util/procexit.py `wait_stoppable`).  This times, in CPU seconds of the waiting thread,
one wait on `--calls` futures that 4 threads finish evenly over `--seconds`: fedhop's
`wait_stoppable` (one done-callback per future, an event waited on in slices) against
`concurrent.futures.wait` called once per slice (what a wait in slices over the standard call
costs), taking turns, `--pairs` of each.  Every wait is checked to return every future done.

    python benchmarks/wait_calls_speed.py [--calls 1000] [--seconds 0.4] [--pairs 5]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable

from fedhop.common.util.procexit import WAIT_SLICE, stops_at_waits, wait_stoppable


def sliced_standard_wait(fs: list[Future], timeout: float) -> tuple[set[Future], set[Future]]:
    """`concurrent.futures.wait` once per WAIT_SLICE until every future is done."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        done, pending = futures_wait(fs, timeout=min(left, WAIT_SLICE))
        if not pending or left <= WAIT_SLICE:
            return done, pending


def one_wait(wait: Callable[[list[Future], float], tuple[set[Future], set[Future]]], calls: int,
             seconds: float) -> float:
    """CPU ms of this thread in one `wait` on `calls` futures finished over `seconds`."""
    futures = [Future() for _ in range(calls)]

    def finish(part: list[Future]) -> None:
        for i, f in enumerate(part):
            time.sleep(seconds / len(part))
            f.set_result(i)

    threads = [threading.Thread(target=finish, args=(futures[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    started = time.thread_time()
    done, pending = wait(futures, 60.0)
    cpu = time.thread_time() - started
    for t in threads:
        t.join()
    if pending or len(done) != calls:
        raise SystemExit(f"a wait returned {len(pending)} futures pending")
    return cpu * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    fedhop, standard = [], []
    with stops_at_waits():   # as in a server's rounds: the wait looks for a stop every slice
        for _ in range(args.pairs):
            fedhop.append(one_wait(wait_stoppable, args.calls, args.seconds))
            standard.append(one_wait(sliced_standard_wait, args.calls, args.seconds))
    f, s = statistics.median(fedhop), statistics.median(standard)
    print(f"{args.calls} calls finished over {args.seconds:g} s, slices of {WAIT_SLICE:g} s; "
          f"CPU ms of the waiting thread, median of {args.pairs}:")
    print(f"  wait_stoppable               {f:7.2f}   ({', '.join(f'{v:.2f}' for v in fedhop)})")
    print(f"  concurrent.futures.wait      {s:7.2f}   ({', '.join(f'{v:.2f}' for v in standard)})")
    print(f"  standard / fedhop            {s / f:7.2f}")


if __name__ == "__main__":
    main()
