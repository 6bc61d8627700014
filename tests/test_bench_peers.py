"""`fedhop bench peers` (deploy/bench/bench_peers.py): the quick workloads in fedhop's two engines,
run as a user runs the command from a folder outside the checkout, and the peer scripts' JSON
contract through a fake peer interpreter written here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.tasks import build_task
from fedhop.deploy.bench.bench_peers import against_loop, parse_peer_output, workloads

FAKE_PEER = '''\
"""A stand-in peer: checks the data contract (peerkit.py) and answers one JSON line, its accuracy
the share of the test set holding the most common training label."""
import json, sys, time
from pathlib import Path
import numpy as np
BURN = 0.25

script, folder = Path(sys.argv[1]), Path(sys.argv[2])
assert script.name in ("pfl_peer.py", "flwr_peer.py") and script.is_file(), script
spec = json.loads((folder / "spec.json").read_text())
with np.load(folder / "data.npz", allow_pickle=False) as npz:
    a = {k: npz[k] for k in npz.files}
if spec["kind"] == "quadratic":
    assert a["centers"].shape == a["curvatures"].shape and a["centers"].shape[0] == spec["clients"]
    result = {"accuracy": None, "objective": float(0.5 * (a["curvatures"] * a["centers"] ** 2).sum(1).mean())}
else:
    assert len(a["offsets"]) == spec["clients"] + 1 and a["offsets"][-1] == len(a["x"]) == len(a["y"])
    assert a["x_test"].shape[1] == a["x"].shape[1] and spec["per_round"] <= spec["clients"]
    majority = np.bincount(a["y"]).argmax()
    result = {"accuracy": float((a["y_test"] == majority).mean()), "objective": None}
print("some framework log line")
ends = []
for r in range(spec["rounds"]):   # each round burns BURN CPU seconds of this process, then stamps its end
    t0 = time.process_time()
    while time.process_time() - t0 < BURN:
        pass
    ends.append(time.perf_counter())
print(json.dumps({"system": "fake", "version": "0", "per_round_s": [0.5] + [0.25] * (spec["rounds"] - 1),
                  "round_end_s": ends, **result}))
'''

ROW = re.compile(r"^  (fedhop processes|fedhop inprocess|fedhop loop|pfl|Flower sim)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
RATIO = re.compile(r"^  ratio (pfl|Flower sim) / (fedhop \w+): (\S+)")


def _fake_python(tmp_path: Path) -> Path:
    (tmp_path / "fake_peer.py").write_text(FAKE_PEER)
    exe = tmp_path / "fakepython"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake_peer.py"}" "$@"\n')
    exe.chmod(0o755)
    return exe


def _bench(tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDHOP_FLWR_PYTHON", "FEDHOP_PFL_PYTHON")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli", "bench", "peers", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)


def _tables(stdout: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """workload -> system -> (s/round, peak MB, accuracy or objective) as printed."""
    return {w: {system: (r[0], r[3], r[4]) for system, r in t.items()} for w, t in _rows(stdout).items()}


def _rows(stdout: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """workload -> system -> (s/round, CPU s/round, cores, peak MB, accuracy or objective) as printed."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    current = ""
    for line in stdout.splitlines():
        head = re.match(r"^(W\d): ", line)
        if head:
            current = head.group(1)
            out[current] = {}
        row = ROW.match(line)
        if row and current:
            out[current][row.group(1)] = row.groups()[1:]
    return out


def test_quick_workloads_in_both_engines_with_a_fake_peer(tmp_path):
    fake = _fake_python(tmp_path)
    res = _bench(tmp_path, "--quick", "--workloads", "W1,W2", "--repeats", "2", "--json", "figures.json",
                 env_extra={"FEDHOP_PFL_PYTHON": str(fake)})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    tables = _tables(res.stdout)
    assert set(tables) == {"W1", "W2"}
    assert "Flower sim         not run (set FEDHOP_FLWR_PYTHON)" in res.stdout
    for name, table in tables.items():
        assert set(table) == {"fedhop processes", "fedhop inprocess", "fedhop loop", "pfl"}, table
        for s_round, peak, metric in table.values():
            assert float(s_round) > 0 and float(peak) > 10   # a python process holds more than 10 MB
        # the engines and the round engine's loop are bit-identical by design: the same final figure
        assert table["fedhop processes"][2] == table["fedhop inprocess"][2] == table["fedhop loop"][2]
        # the fake peer's rounds take 0.25 s from round 2 on: the median of rounds 2..n
        assert table["pfl"][0] == "0.2500"
    for name, table in _rows(res.stdout).items():
        # the fake burns 0.25 CPU s a round in its one process: the tree's CPU between its stamps,
        # read every 50 ms (the readings around the first and last stamp interpolated)
        s_round, cpu, cores = table["pfl"][:3]
        assert 0.17 < float(cpu) < 0.33, table["pfl"]
        assert float(cores) == pytest.approx(float(cpu) / float(s_round), abs=0.01)
        for engine in ("fedhop processes", "fedhop inprocess", "fedhop loop"):   # a few rounds of ~10 ms: under 5 readings
            s_round, cpu, cores = table[engine][:3]
            assert cpu == cores == "-" or 0 < float(cores) <= (os.cpu_count() or 1) + 0.5, table[engine]
    assert "(CPU s/round -: rounds 2..n spanned fewer than 5 readings" in res.stdout

    # W1's objective against numpy: every client sampled, one full step at lr 0.1, from zeros
    w1 = workloads(True)["W1"]
    task = build_task(parse_config(w1.config(w1.rounds, 0)))
    a = np.stack([task.client_data(c).tensors[0].numpy()[0] for c in range(w1.clients)]).astype(np.float64)
    c = np.stack([task.client_data(c).tensors[1].numpy()[0] for c in range(w1.clients)]).astype(np.float64)
    w = np.zeros(a.shape[1])
    for _ in range(w1.rounds):
        w = (w - w1.lr * c * (w - a)).mean(0)
    objective = float((0.5 * c * (w - a) ** 2).sum(1).mean())
    assert float(tables["W1"]["fedhop processes"][2]) == pytest.approx(objective, rel=1e-4)
    assert float(tables["W1"]["pfl"][2]) == pytest.approx(float((0.5 * c * a ** 2).sum(1).mean()), rel=1e-4)

    # W2: the fake peer saw fedhop's own split (its accuracy is the majority label's share)
    w2 = workloads(True)["W2"]
    task2 = build_task(parse_config(w2.config(w2.rounds, 0)))
    majority = np.bincount(np.concatenate([task2.client_data(c).tensors[1].numpy() for c in range(w2.clients)]))
    share = float((task2.y_test.numpy() == majority.argmax()).mean())
    assert float(tables["W2"]["pfl"][2]) == pytest.approx(share, abs=5e-5)

    # every ratio printed is the division of the printed s/round figures
    seen = 0
    current = ""
    for line in res.stdout.splitlines():
        head = re.match(r"^(W\d): ", line)
        current = head.group(1) if head else current
        m = RATIO.match(line)
        if m:
            peer = "pfl" if m.group(1) == "pfl" else "Flower sim"
            ratio = float(tables[current][peer][0]) / float(tables[current][m.group(2)][0])
            assert float(m.group(3)) == pytest.approx(ratio, rel=2e-3)
            seen += 1
    assert seen == 6   # two engines and the loop x pfl x two workloads
    # each fedhop system's final model hashed (the engines' model.safetensors, the loop's state): one hash
    assert res.stdout.count("final model: the same bits in every fedhop system and repeat") == 2
    assert "(issue 49: >= 2: " in res.stdout   # W1/W2 in-process against pfl carry their acceptance line

    figures = json.loads((tmp_path / "figures.json").read_text())
    runs = figures["workloads"]["W2"]["seeds"]["0"]["systems"]
    assert runs["fedhop processes"]["runs"] == 2 and runs["pfl"]["runs"] == 2
    assert len(runs["fedhop loop"]["models"]) == 1 and runs["fedhop loop"]["models"] == runs["fedhop inprocess"]["models"]
    loop = figures["workloads"]["W2"]["seeds"]["0"]["loop"]
    assert loop["identical"] is True and set(loop["engine_over_loop"]) == {"fedhop processes", "fedhop inprocess"}
    for engine, over in loop["engine_over_loop"].items():   # printed s/round over the loop's
        assert over == pytest.approx(runs[engine]["s_per_round"] / runs["fedhop loop"]["s_per_round"])
    # each ratio within each repeat, from the two systems' runs of that repeat
    for row in figures["workloads"]["W2"]["seeds"]["0"]["ratios"]:
        theirs, ours = runs[row["peer"]]["by_repeat"], runs[row["engine"]]["by_repeat"]
        assert len(theirs) == len(ours) == 2
        assert row["by_repeat"] == pytest.approx([t / o for t, o in zip(theirs, ours)])
        shown = f"(by repeat {min(row['by_repeat']):.3f}-{max(row['by_repeat']):.3f})"
        assert shown in next(line for line in res.stdout.splitlines() if line.startswith(
            f"  ratio pfl / {row['engine']}: ") and f"{row['ratio']:.3f}" in line)


def test_peer_contract_errors_are_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="printed nothing"):
        parse_peer_output("\n\n", "pfl")
    with pytest.raises(ValueError, match="last line is not JSON"):
        parse_peer_output('{"per_round_s": [1]}\nTraceback...', "pfl")
    with pytest.raises(ValueError, match="per_round_s must be a non-empty list"):
        parse_peer_output('{"per_round_s": []}', "pfl")
    with pytest.raises(ValueError, match="round_end_s must be a list of 2 times"):
        parse_peer_output('{"per_round_s": [0.1, 0.2], "round_end_s": [5.0]}', "pfl")
    with pytest.raises(ValueError, match="accuracy must be a number"):
        parse_peer_output('{"per_round_s": [0.1], "accuracy": "high"}', "pfl")
    assert parse_peer_output('log\n{"per_round_s": [0.1, 0.2], "accuracy": 0.5}', "pfl")["accuracy"] == 0.5

    # a peer whose python fails: the run stops with the peer named and its log's end
    broken = tmp_path / "brokenpython"
    broken.write_text("#!/bin/sh\necho 'no module named pfl' >&2\nexit 3\n")
    broken.chmod(0o755)
    res = _bench(tmp_path, "--quick", "--workloads", "W1", "--repeats", "1",
                 env_extra={"FEDHOP_PFL_PYTHON": str(broken)})
    assert res.returncode != 0 and "pfl failed (exit 3)" in res.stderr and "no module named pfl" in res.stderr


@pytest.mark.parametrize("flags, message", [(["--workloads", "W9"], "unknown W9"),
                                            (["--seeds", "a,b"], "expected comma-separated integers"),
                                            (["--rounds", "1"], "--rounds must be >= 2")])
def test_bad_flags_exit_2(tmp_path, flags, message):
    res = _bench(tmp_path, "--quick", *flags)
    assert res.returncode == 2 and message in res.stderr


def test_fedhop_s_per_round_counts_the_time_between_rounds_rows():
    """A fedhop round lasts from the previous round's row to its own (run.db `finished`), as a
    peer's central iterations are timed: the recording of a round counts, not only the round's
    own `wall_seconds`; rows without stamps (an older run.db) fall back to wall_seconds."""
    from fedhop.common.records.runstore import round_seconds as per_round
    from fedhop.deploy.bench.bench_peers import steady

    rows = [{"wall_seconds": 0.5, "finished": 100.0}, {"wall_seconds": 0.1, "finished": 100.25},
            {"wall_seconds": 0.1, "finished": 100.40}, {"wall_seconds": 0.1, "finished": 100.60}]
    got = per_round(rows)
    assert got[0] == 0.5 and got[1:] == pytest.approx([0.25, 0.15, 0.20])
    assert steady(got) == pytest.approx(0.20)
    assert per_round([{**r, "finished": None} for r in rows]) == [0.5, 0.1, 0.1, 0.1]


def test_cpu_per_round_is_the_cpu_between_the_first_and_last_round_ends():
    """Readings (wall, monotonic, CPU) of a tree that used 0.3 CPU s a second from t = 0: rounds
    ending at 0.1, 0.35, 0.6 and 1.1 s (between readings) used 0.3 * 1.0 / 3 CPU s a round over
    rounds 2..4, on either clock; a stamp outside the readings, or a span of fewer than 5
    readings, gives None."""
    from fedhop.deploy.bench.bench_peers import MONOTONIC, WALL, cpu_at, cpu_per_round

    samples = [(1000.0 + t, 50.0 + t, 0.3 * t) for t in (0.0, 0.05, 0.2, 0.3, 0.5, 0.55, 0.8, 0.9, 1.2)]
    ends = [0.1, 0.35, 0.6, 1.1]
    assert cpu_at(samples, 50.35, MONOTONIC) == pytest.approx(0.3 * 0.35)
    assert cpu_per_round(samples, [50.0 + t for t in ends], MONOTONIC) == pytest.approx(0.1)
    assert cpu_per_round(samples, [1000.0 + t for t in ends], WALL) == pytest.approx(0.1)
    assert cpu_per_round(samples, [50.0 + t for t in (*ends, 1.3)], MONOTONIC) is None
    assert cpu_per_round(samples, [50.1], MONOTONIC) is None   # one round: no span
    assert cpu_per_round(samples, [50.1, 50.35, 50.6], MONOTONIC) is None   # 4 readings in the span: a rate only


def test_tree_watch_counts_a_childs_cpu_after_it_has_exited(tmp_path):
    """A process that starts a child burning 0.4 CPU s and then burns 0.2 itself: the watch's
    last reading holds both (the child's as last read before it exited), within the readings'
    50 ms spacing."""
    from fedhop.deploy.bench.bench_peers import TreeWatch

    burn = ("import time\nt0 = time.process_time()\nwhile time.process_time() - t0 < {s}: pass\n")
    script = ("import subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {burn.format(s=0.4)!r}], check=True)\n"
              + burn.format(s=0.2))
    proc = subprocess.Popen([sys.executable, "-c", script])
    watch = TreeWatch(proc.pid)
    assert proc.wait(60) == 0
    watch.stop()
    used = watch.cpu[-1][2]
    assert 0.6 - 0.12 < used < 0.6 + 0.4, watch.cpu[-3:]   # above: the interpreters' own start-up
    assert [r[2] for r in watch.cpu] == sorted(r[2] for r in watch.cpu)   # readings only grow


def test_a_model_that_differs_between_fedhop_systems_is_reported():
    def fig(s_round: float, models: list[str]) -> dict:
        return {"s_per_round": s_round, "models": models}
    same = {"fedhop processes": fig(0.02, ["a"]), "fedhop inprocess": fig(0.03, ["a"]), "fedhop loop": fig(0.01, ["a"]),
            "pfl": fig(0.05, [])}
    assert against_loop(same) == {"engine_over_loop": {"fedhop processes": pytest.approx(2.0),
                                                       "fedhop inprocess": pytest.approx(3.0)}, "identical": True}
    assert against_loop({**same, "fedhop loop": fig(0.01, ["b"])})["identical"] is False
    assert against_loop({**same, "fedhop inprocess": fig(0.03, ["a", "c"])})["identical"] is False   # repeats differ
    assert against_loop({**same, "fedhop loop": fig(0.01, [])})["identical"] is None   # no hash: nothing claimed


def test_a_line_met_by_the_medians_but_not_by_every_repeat_says_so():
    """The medians decide whether a line is met; where the repeats alone do not all agree, the
    printed line says how many meet it (the machine's state moved the ratio across the line)."""
    from fedhop.deploy.bench.bench_peers import ratio_line, ratios

    def fig(*by_repeat: float) -> dict:
        return {"s_per_round": sorted(by_repeat)[len(by_repeat) // 2], "by_repeat": list(by_repeat)}
    # pfl 0.1224 and 0.0800 against processes 0.1027 and 0.0827 (2026-12-06): 1.19 and 0.97; a third repeat 1.11
    table = {"fedhop processes": fig(0.1027, 0.0827, 0.0900), "pfl": fig(0.1224, 0.0800, 0.1000)}
    row = next(r for r in ratios("W2", table) if r["engine"] == "fedhop processes")
    assert row["ratio"] == pytest.approx(0.1000 / 0.0900) and row["meets"] is True
    assert row["by_repeat"] == pytest.approx([0.1224 / 0.1027, 0.0800 / 0.0827, 0.1000 / 0.0900])
    assert row["repeats_agree"] is False
    line = ratio_line(row)
    assert line == ("  ratio pfl / fedhop processes: 1.111 (by repeat 0.967-1.192)  (issue 49: >= 1: met; "
                    "2 of 3 repeats alone meet it: the machine's state decides it)")
    steady = {"fedhop processes": fig(0.05, 0.06), "pfl": fig(0.08, 0.09)}
    row = next(r for r in ratios("W2", steady) if r["engine"] == "fedhop processes")
    assert row["repeats_agree"] is True and ratio_line(row).endswith("(issue 49: >= 1: met)")
    one = next(r for r in ratios("W2", {"fedhop processes": fig(0.05), "pfl": fig(0.04)}) if r["engine"] == "fedhop processes")
    assert one["repeats_agree"] is None and ratio_line(one) == "  ratio pfl / fedhop processes: 0.800  (issue 49: >= 1: NOT met)"


def test_the_loop_refuses_a_topology_with_its_own_rounds_in_one_line(tmp_path):
    w1 = workloads(True)["W1"]
    (tmp_path / "hier.toml").write_text(w1.config(2, 0) + "\n[topology]\nkind = \"hierarchical\"\nedges = 2\n")
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.bench.engine_loop", "hier.toml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "hierarchical" in lines[0] and "own round protocol" in lines[0], res.stderr
