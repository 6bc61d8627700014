"""benchmarks/worker_start.py (issue 49, item 2): its small mode runs the three ways from a
folder of its own, every run writes the same model, and the figures it prints are the ones it
writes: forked workers sharing the run's process's pages hold less memory than fresh
interpreters each importing torch and building the data."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_compares_the_three_ways_on_the_same_model(tmp_path):
    out = tmp_path / "ws.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "worker_start.py"), "--mb", "4", "--clients", "4",
                          "--repeats", "1", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["same_model"] is True and "the same model.safetensors in every run: True" in res.stdout
    assert set(figures["median"]) == {"forked", "fresh", "processes"}
    for name, m in figures["median"].items():
        assert m["seconds"] > 0 and 0 < m["pss"] <= m["rss"], (name, m)
        assert f"  {name:<10} {m['seconds']:>8.2f}" in res.stdout
    forked, fresh = figures["median"]["forked"], figures["median"]["fresh"]
    assert figures["ratios"]["pss_forked_over_fresh"] == forked["pss"] / fresh["pss"]
    assert forked["pss"] < fresh["pss"], figures["median"]   # the workers' imports (and data) are the run's pages


def test_bad_flags_exit_2_naming_them(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "worker_start.py"), "--clients", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--clients >= 2" in res.stderr
