"""benchmarks/compress_compare.py (docs/claims.md, "Compressed uploads"): the upload bytes it reports
for a run are the ledger's, message by message, and they are the compressed bytes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from fedhop.common.records.runstore import RunStore

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compress_compare.py"


def _module():
    spec = importlib.util.spec_from_file_location("compress_compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_reported_upload_bytes_are_the_ledgers(tmp_path: Path) -> None:
    cc = _module()
    run = cc.run_one("digits", "topk+ef", 0.1, seed=0, rounds=2, run_dir=tmp_path)
    store = RunStore(tmp_path / "run.db")
    try:
        assert store.check_agreement().ok
        sent = [m for m in store.messages() if m["role"] == "sender" and m["direction"] == "up"]
    finally:
        store.close()
    replies = [m for m in sent if m["method"] == "train.reply"]
    assert run.up_bytes == sum(m["tensor_bytes"] for m in sent) > 0
    assert run.up_messages == len(replies) == 2 * 10                  # 10 clients a round, 2 rounds
    # the curve's last cumulative figure is the total, one point per round (eval_every = 1)
    assert [r for r, _, _ in run.curve] == [1, 2] and run.curve[-1][1] == run.up_bytes
    # top-k 1% of the MLP's 4,810 parameters: far below the dense 4 * 4,810 bytes per reply
    assert run.up_bytes < 0.05 * 4 * 4810 * len(replies)
