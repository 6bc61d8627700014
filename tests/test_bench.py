"""The transport benchmark keeps working (tiny mode; figures are not asserted as speeds)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fedhop.deploy.bench.bench import main


def test_bench_transport_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["transport", "--tiny", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    row = figures["rows"][0]
    assert row["size_mb"] == 1 and row["tcp_mb_s"] > 0 and row["grpc_mb_s"] > 0 and row["bare_grpc_mb_s"] > 0
    assert abs(row["grpc_over_bare"] - row["grpc_mb_s"] / row["bare_grpc_mb_s"]) < 1e-9
    # the ledger's framed bytes for the 1 MB model: data + header frame + 5 bytes per frame
    assert 1_000_000 < row["framed_bytes"] < 1_000_000 + 2_000
    assert figures["codec"]["encode_gb_s"] > 0 and figures["fedavg_round"]["round_ms_median"] > 0
    assert "FedAvg round" in capsys.readouterr().out


def test_bench_growth_tiny_fits_the_byte_law(tmp_path):
    out = tmp_path / "growth.json"
    assert main(["growth", "--tiny", "--json", str(out)]) == 0
    fits = json.loads(out.read_text())["fits"]
    # FedAvg moves the model down and the delta up: 2 * S * 4 bytes per parameter, S = 5 here
    assert abs(fits["bytes_per_param"] - 40.0) < 1e-6
    assert abs(fits["bytes_per_client"] - 2 * 4 * 100_000) < 1e-3


def test_bench_compute_and_scale_tiny(tmp_path):
    out = tmp_path / "c.json"
    assert main(["compute", "--tiny", "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    assert c["loop_seconds"] > 0 and c["fedhop_round_seconds"] > 0
    assert c["model_max_abs_diff"] < 1e-6   # the loop does fedhop's SGD steps (float rounding apart)
    assert main(["scale", "--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["per_round"] for r in rows] == [10, 50] and all(r["client_process_rss_mb"] > 0 for r in rows)
    assert all(0 < r["client_process_uss_mb"] <= r["client_process_rss_mb"] for r in rows)   # own pages within all pages
    assert all(r["clients"] == 2000 and 0 < r["registration_seconds"] < 60 for r in rows)
    assert all(r["round_seconds_min"] <= r["round_seconds_median"] <= r["round_seconds_max"] for r in rows)
    assert all(abs(r["rss_per_logical_client_kb"] * 2000 / 1000 - 2 * r["client_process_rss_mb"]) < 1e-6
               for r in rows)   # two client processes' memory over 2,000 clients


def test_bench_scale_beside_the_inprocess_engine_and_the_loop(tmp_path, capsys, monkeypatch):
    """`--also inprocess,loop`: the scale config in the in-process engine and in the round engine's
    loop too, each ending on the processes engine's model bit for bit, with its round times."""
    monkeypatch.chdir(tmp_path)   # the runs' folders are temporary; nothing is left where the user is
    out = tmp_path / "s.json"
    assert main(["scale", "--default-malloc", "--clients", "300", "--processes", "2", "--sampled", "20",
                 "--rounds", "3", "--also", "inprocess,loop", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert [o["system"] for o in row["others"]] == ["inprocess", "loop"]
    assert len(row["model_sha256"]) == 64 and row["same_model"] is True
    assert all(o["model_sha256"] == row["model_sha256"] for o in row["others"])
    assert all(0 < o["round_seconds_min"] <= o["round_seconds_median"] <= o["round_seconds_max"] and o["peak_rss_mb"] > 0
               for o in row["others"])
    printed = capsys.readouterr().out
    assert "in-process engine (run.workers = 0): round median" in printed
    assert "the round engine's loop (one process, no message sent or recorded): round median" in printed
    assert "final model: the same bits in every fedhop system" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_bench_scale_says_when_a_system_ends_on_another_model(tmp_path, capsys, monkeypatch):
    """The model check can fail: a system whose model hash differs is named a defect."""
    from fedhop.deploy.bench import bench_system

    def fake_run(count, processes, per_round, rounds, batch=True, vectorized=False):
        return {"clients": count, "processes": processes, "per_round": per_round, "rounds": rounds, "batch": batch,
                "registration_seconds": 0.1, "round_seconds_median": 0.2, "round_seconds_min": 0.1,
                "round_seconds_max": 0.3, "server_rss_mb": 1.0, "server_uss_mb": 1.0, "client_process_rss_mb": 1.0,
                "client_process_uss_mb": 1.0, "client_process_rss_mb_max": 1.0, "total_rss_mb": 2.0,
                "total_uss_mb": 2.0, "rss_per_logical_client_kb": 1.0, "uss_per_logical_client_kb": 1.0,
                "model_sha256": "a" * 64}

    def fake_other(system, count, processes, per_round, rounds, batch, timeout, vectorized=False):
        return {"system": system, "clients": count, "per_round": per_round, "rounds": rounds,
                "round_seconds_median": 0.1, "round_seconds_min": 0.1, "round_seconds_max": 0.1,
                "cpu_s_per_round": None, "peak_rss_mb": 1.0, "model_sha256": ("a" if system == "loop" else "b") * 64}

    monkeypatch.setattr(bench_system, "scale_run", fake_run)
    monkeypatch.setattr(bench_system, "scale_other", fake_other)
    out = tmp_path / "s.json"
    assert main(["scale", "--default-malloc", "--clients", "300", "--sampled", "20", "--also", "inprocess,loop",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["same_model"] is False
    assert "final model: DIFFERS between fedhop systems" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["transport", "--tiny"], ["scale", "--tiny"], ["large", "--sizes", "1"],
                                     ["peers", "--quick"], ["flower", "--no-flower", "--rounds", "2"]])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_benchmark_runs(tmp_path, monkeypatch, capsys,
                                                                                  command):
    """The figures go to --json at the end of a run that may take hours: a path with no folder (a
    file stands where it names one) is refused first, exit 2 and one line naming --json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder")
    started = time.monotonic()
    try:
        code = main([*command, *(["--default-malloc"] if command[0] in ("transport", "scale", "large") else []),
                     "--json", "taken/figures.json"])
    except SystemExit as exc:   # argparse's error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"--json taken/figures.json: no folder {tmp_path / 'taken'}" in err[-1], err
    assert time.monotonic() - started < 10   # refused before anything ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("command", [["large", "--default-malloc", "--sizes", "1", "--no-transfer"],
                                     ["flower", "--no-flower", "--rounds", "2"]])
def test_a_keep_folder_that_cannot_be_made_is_refused_before_the_benchmark_runs(tmp_path, monkeypatch, capsys,
                                                                                command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder")
    for keep, why in (("taken", "--keep taken: a file, not a folder"),
                      ("taken/runs", f"--keep taken/runs: {tmp_path / 'taken'} is a file, so no folder can be made")):
        try:
            code = main([*command, "--keep", keep])
        except SystemExit as exc:   # argparse's error
            code = exc.code
        assert code == 2
        assert why in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    if command[0] == "flower":   # Flower's app and FLWR_HOME go into a new folder: one there already is refused
        (tmp_path / "earlier").mkdir()
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--keep", "earlier"])
        assert exit_.value.code == 2
        assert "--keep earlier: there already; name a new folder" in capsys.readouterr().err


def test_bench_transport_torch_tiny(tmp_path):
    out = tmp_path / "k.json"
    assert main(["transport", "--kind", "torch", "--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"grpc", "torch"} and all(r["round_seconds"] > 0 for r in rows)


# The python of a venv with flwr[simulation] (README, Quick start); unset, the Flower side is skipped.
FLWR_PYTHON = os.environ.get("FEDHOP_FLWR_PYTHON", "")


def test_bench_scale_bad_flags_exit_2(capsys):
    for flags in (["--sampled", "10,x"], ["--sampled", "5000", "--clients", "100"], ["--flwr-python", "/nonexistent"],
                  ["--rounds", "1"], ["--also", "inprocess,bogus"], ["--scale-timeout", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["scale", "--default-malloc", *flags])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.startswith("fedhop bench scale: error: ")


@pytest.mark.skipif(not FLWR_PYTHON or not Path(FLWR_PYTHON).exists(),
                    reason="no Flower python: set FEDHOP_FLWR_PYTHON to the python of a venv with flwr[simulation]")
def test_bench_scale_flower_side_tiny(tmp_path, capsys):
    """Flower's simulation beside fedhop's scale run: as many SuperNodes as clients, the sampled
    count trained in every round, its processes all stopped."""
    out = tmp_path / "s.json"
    assert main(["scale", "--default-malloc", "--clients", "200", "--processes", "2", "--sampled", "10",
                 "--rounds", "2", "--flwr-python", str(FLWR_PYTHON), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    (fedhop,), (flower,) = figures["rows"], figures["flower"]
    assert fedhop["clients"] == flower["clients"] == 200 and fedhop["per_round"] == flower["per_round"] == 10
    assert flower["ok"], flower.get("detail")
    assert flower["rounds_completed"] == 2 and flower["train_replies"] == [10, 10]
    assert flower["ratio_to_fedhop"] == pytest.approx(flower["median_s"] / fedhop["round_seconds_median"])
    assert flower["total_rss_mb"] > flower["total_uss_mb"] > 0 and flower["left_alive"] == []
    assert "Flower / fedhop round time" in capsys.readouterr().out
