"""benchmarks/flower_compare.py keeps working (tiny mode; speeds are not asserted).

The fedhop half always runs; the Flower half needs a Flower venv (FEDHOP_FLWR_PYTHON) and is
skipped without one.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib

import pytest

from benchmarks import flower_compare as fc


def test_fedhop_half_tiny(tmp_path, capsys):
    out = tmp_path / "fc.json"
    assert fc.main(["--no-flower", "--rounds", "3", "--params", "100", "--fedhop-processes", "2",
                    "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    fed = figures["fedhop"]
    assert fed["rounds"] == 3 and len(fed["per_round_s"]) == 3
    assert all(t > 0 for t in fed["per_round_s"])
    steady = sorted(fed["per_round_s"][1:])          # the median leaves round 1 out
    assert fed["median_s"] == pytest.approx((steady[0] + steady[1]) / 2)
    assert figures["flower"] == []
    assert "| fedhop | gRPC, 2 client processes, batched calls |" in capsys.readouterr().out   # the default


def test_parse_timing_rounds_and_phases(tmp_path):
    """Round = round_start -> round_end; train = round_start -> train_done; federated
    evaluate = aggregated -> evaluate_done; medians over rounds 2..R."""
    lines = []
    for r, (start, train, agg, ev, end) in enumerate(
            [(0.0, 5.0, 5.1, 9.0, 9.2), (10.0, 12.0, 12.5, 13.5, 14.0), (20.0, 23.0, 23.5, 25.5, 26.0)], 1):
        for event, t in (("round_start", start), ("train_done", train), ("aggregated", agg),
                         ("evaluate_done", ev), ("round_end", end)):
            lines.append(json.dumps({"event": event, "round": r, "t": 1000.0 + t}))
    path = tmp_path / "timing.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = fc.parse_timing(path, 3)
    assert got["per_round_s"] == pytest.approx([9.2, 4.0, 6.0])
    assert got["median_s"] == pytest.approx(5.0) and got["min_s"] == pytest.approx(4.0)
    assert got["train_phase_median_s"] == pytest.approx(2.5)      # rounds 2, 3: 2.0 and 3.0
    assert got["evaluate_phase_median_s"] == pytest.approx(1.5)   # 1.0 and 2.0
    with pytest.raises(RuntimeError, match="round_end stamp for rounds \\[4\\]"):
        fc.parse_timing(path, 4)


def test_written_app_names_its_components(tmp_path):
    app = fc.write_app(tmp_path)
    meta = tomllib.loads((app / "pyproject.toml").read_text())
    comps = meta["tool"]["flwr"]["app"]["components"]
    for key, module in (("serverapp", "server_app"), ("clientapp", "client_app")):
        assert comps[key] == f"fedhopbench.{module}:app"
        assert (app / "fedhopbench" / f"{module}.py").exists()
    assert set(meta["tool"]["flwr"]["app"]["config"]) >= {"num-server-rounds", "num-params", "fraction-evaluate",
                                                            "timing-file", "num-clients", "lr"}


def test_token_finds_exactly_the_marked_processes():
    """Clean-up stops processes by PID found through the token in their environment."""
    token = "test" + str(os.getpid())
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=dict(os.environ, **{fc.TOKEN_VAR: token}))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while marked.pid not in fc._pids_with_token(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = fc._pids_with_token(token)
        assert found == [marked.pid] and other.pid not in found
    finally:
        for p in (marked, other):
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    assert fc._pids_with_token(token) == []


@pytest.mark.slow
def test_flower_half_tiny(tmp_path):
    python = fc.find_flwr_python(None)
    if python is None:
        pytest.skip("no Flower python: set FEDHOP_FLWR_PYTHON to the python of a venv with flwr[simulation]")
    out = tmp_path / "fc.json"
    assert fc.main(["--rounds", "2", "--params", "100", "--fedhop-processes", "2", "--evaluate", "0",
                    "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["mode"].split()[0] for r in figures["flower"]] == ["deployment", "simulation"]
    for r in figures["flower"]:
        assert len(r["per_round_s"]) == 2 and all(t > 0 for t in r["per_round_s"])
        assert r["ratio_to_fedhop"] == pytest.approx(r["median_s"] / figures["fedhop"]["median_s"])
    assert figures["flower_info"]["left_alive"] == []
