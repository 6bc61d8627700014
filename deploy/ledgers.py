"""`fedhop merge-ledgers RUN_DIR`: merge the children's ledger files of a run into its run.db.

A run that ends normally merges them itself (server/coordinator.py).  One that was interrupted
(Ctrl-C, a killed server) leaves run.db with the server's own records only, so its report would
show every message as one-sided; this merges RUN_DIR/ledger/*.jsonl (idempotent: records already
in run.db are skipped) and says whether the two sides of each message now agree.  `fedhop run`
does it itself on Ctrl-C.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

from fedhop.common.records.runstore import AgreementReport, RunStore
from fedhop.deploy.runread import read_summary


def merge_run(run_dir: Path) -> tuple[int, AgreementReport]:
    """Merge `run_dir`'s ledger files into its run.db; (records added, the sender/receiver check)."""
    store = RunStore(run_dir / "run.db")   # opening it for writing also brings an old schema up to date
    try:
        added = store.merge_ledger_dir(run_dir / "ledger")
        return added, store.check_agreement()
    finally:
        store.close()


def stopped_agreement(report: AgreementReport) -> str:
    """The ledger check after a stop: messages in flight when the processes stopped were recorded
    by one end only, which is expected; records that disagree on bytes are not."""
    if report.ok or report.mismatched:
        return report.summary()
    return (f"{report.matched} messages recorded by both ends; {len(report.sender_only)} recorded only by their "
            f"sender and {len(report.receiver_only)} only by their receiver: they were in flight when the "
            f"processes stopped, as expected after a stop")


def ended_early(run_dir: Path) -> bool:
    """Whether the run did not complete: stopped, failed, or without a readable summary (one that
    is too large, too deeply nested or wrongly typed counts as none: deploy/runread.py)."""
    try:
        return read_summary(run_dir).get("status") != "completed"
    except (OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedhop merge-ledgers", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holding run.db and ledger/)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "run.db").is_file() or not (run_dir / "ledger").is_dir():
        print(f"fedhop merge-ledgers: {run_dir} holds no run.db and ledger/ folder; is it a run directory?",
              file=sys.stderr)
        return 2
    try:   # ledger lines that are too long, nested or out of range are skipped with a warning (common/wire/ledger.py)
        added, agreement = merge_run(run_dir)
    except (sqlite3.Error, ValueError, OverflowError) as exc:   # a run.db that is no run's
        print(f"fedhop merge-ledgers: {run_dir / 'run.db'}: cannot merge into it ({type(exc).__name__}: "
              f"{str(exc)[:200]})", file=sys.stderr)
        return 2
    print(f"fedhop merge-ledgers: {added} records added to {run_dir / 'run.db'}; "
          f"{stopped_agreement(agreement) if ended_early(run_dir) else agreement.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
