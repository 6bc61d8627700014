"""benchmarks/call_cost.py in its tiny mode: both call variants run against a real served process
and report per-call figures; the reply pipeline runs on the digits MLP's reply (its parameter
count from the model's shapes: 64x64 + 64 + 10x64 + 10)."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_call_cost_tiny(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "benchmarks" / "call_cost.py"), run_name="call_cost")["main"]
    assert main(["--calls", "40", "--repeats", "40", "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    for variant in ("single_threaded", "spin_thread"):
        row = out[variant]
        assert row["calls"] == 40
        assert row["wall_ms"] > 0 and row["caller_cpu_ms"] > 0 and row["served_cpu_ms"] > 0
    pipeline = out["reply_pipeline"]
    assert pipeline["tensors"] == 4 and pipeline["parameters"] == 64 * 64 + 64 + 10 * 64 + 10
    assert pipeline["pipeline_us"] > 0 and pipeline["tensor_finite_us"] > 0 and pipeline["torch_isfinite_us"] > 0
    assert "ratio fedhop / default" in capsys.readouterr().out
