"""benchmarks/back_to_back.py in a small mode: lone sends of a handed-over model, one after another,
leave their frames in the heap for the next (no trim), and every call's reply comes back."""
from __future__ import annotations

import runpy
from pathlib import Path

from fedhop.common.util.heap import TRIM_AFTER_BYTES, transient_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_back_to_back_lone_sends_do_not_trim_the_heap():
    measure = runpy.run_path(str(ROOT / "benchmarks" / "back_to_back.py"), run_name="back_to_back")["measure"]
    nbytes = 40_000_000   # ten 4 MiB frames a call; four calls send more than any trim threshold
    assert transient_bytes(nbytes, 4 << 20) < TRIM_AFTER_BYTES < 4 * nbytes
    row = measure(nbytes, calls=3)
    assert row["trims"] == 0, row
    assert row["calls"] == 3 and row["ms_per_call"] > 0 and row["mb_s"] > 0
