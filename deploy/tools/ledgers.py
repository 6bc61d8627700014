"""`fedhop merge-ledgers RUN_DIR`: merge the children's ledger files of a run into its run.db.

A run that ends normally merges them itself (server/coordinator.py).  One that was interrupted
(Ctrl-C, a killed server) leaves run.db with the server's own records only, so its report would
show every message as one-sided; this merges RUN_DIR/ledger/*.jsonl (idempotent: records already
in run.db are skipped) and says whether the two sides of each message now agree.  `fedhop run`
does it itself on Ctrl-C.

A ledger file is streamed into run.db a batch of records at a time (memory does not grow with
the file), and a ledger path that is no regular file (a FIFO, a link to /dev/zero, a folder named
*.jsonl) is refused with one line and exit status 2 before anything is merged.
"""
from __future__ import annotations

import sqlite3
import stat
import sys
from pathlib import Path

from fedhop.common.records.runstore import RunStore, foreign_schema_problem
from fedhop.common.util.cliparser import ArgumentParser
from fedhop.common.wire.ledger import NotARegularFile, iter_jsonl_batches, open_regular
from fedhop.deploy.tools.runread import read_summary
from fedhop.server.agreement import Verdict, ledger_verdict


def ledger_files(folder: Path) -> list[Path]:
    """The run's ledger files (ledger/*.jsonl, sorted), each checked to be a regular file
    (`NotARegularFile` otherwise: a FIFO would block the merge, /dev/zero never ends)."""
    files = sorted(folder.glob("*.jsonl"))
    for path in files:
        mode = path.stat().st_mode   # follows a link: a link to /dev/zero is a device
        if not stat.S_ISREG(mode):
            with open_regular(path):   # raises NotARegularFile naming what it is
                pass
    return files


def merge_files(store: RunStore, files: list[Path], batch: int = 10_000) -> int:
    """Insert the records of `files` into `store`, `batch` records per transaction: memory holds
    one batch, however large a file is.  Returns the records that were not yet in run.db."""
    added = 0
    for path in files:
        for records in iter_jsonl_batches(path, batch):
            added += store.insert_records(records)
    return added


def merge_run(run_dir: Path) -> tuple[int, Verdict]:
    """Merge `run_dir`'s ledger files into its run.db; (records added, the agreement verdict of
    server/agreement.py: explained losses agree; counted in SQLite, so a run.db of millions of
    records is judged in bounded memory)."""
    foreign = foreign_schema_problem(run_dir / "run.db")
    if foreign:   # opening it for writing would change it: refused before anything is written
        raise ValueError(foreign)
    store = RunStore(run_dir / "run.db")   # opening it for writing also brings an old schema up to date
    try:
        added = merge_files(store, ledger_files(run_dir / "ledger"))
        return added, ledger_verdict(store)
    finally:
        store.close()


def only_in_flight(verdict: Verdict) -> bool:
    """Whether a run's ledgers disagree only by messages one end recorded, none differing in bytes:
    what a run that ended early leaves (they were in flight when its processes stopped)."""
    return not verdict.ok and verdict.mismatched <= verdict.partial_losses


def stopped_agreement(verdict: Verdict) -> str:
    """The ledger check after a stop: messages in flight when the processes stopped were recorded
    by one end only, which is expected; records that disagree on bytes are not."""
    if not only_in_flight(verdict):
        return verdict.summary()
    return (f"{verdict.matched} messages recorded by both ends; {verdict.sender_only} recorded only by their "
            f"sender and {verdict.receiver_only} only by their receiver: they were in flight when the "
            f"processes stopped, as expected after a stop")


def ended_early(run_dir: Path) -> bool:
    """Whether the run did not complete: stopped, failed, or without a readable summary (one that
    is too large, too deeply nested or wrongly typed counts as none: deploy/tools/runread.py)."""
    try:
        return read_summary(run_dir).get("status") != "completed"
    except (OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop merge-ledgers", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holding run.db and ledger/)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "run.db").is_file() or not (run_dir / "ledger").is_dir():
        print(f"fedhop merge-ledgers: {run_dir} holds no run.db and ledger/ folder; is it a run directory?",
              file=sys.stderr)
        return 2
    try:   # ledger lines that are too long, nested or out of range are skipped with a warning (common/wire/ledger.py)
        added, agreement = merge_run(run_dir)
    except NotARegularFile as exc:   # a FIFO, a device or a folder named *.jsonl: refused before anything is merged
        print(f"fedhop merge-ledgers: {exc}; refusing to merge", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fedhop merge-ledgers: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except (sqlite3.Error, ValueError, OverflowError) as exc:   # a run.db that is no run's
        print(f"fedhop merge-ledgers: {run_dir / 'run.db'}: cannot merge into it ({type(exc).__name__}: "
              f"{str(exc)[:200]})", file=sys.stderr)
        return 2
    print(f"fedhop merge-ledgers: {added} records added to {run_dir / 'run.db'}; "
          f"{stopped_agreement(agreement) if ended_early(run_dir) else agreement.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
