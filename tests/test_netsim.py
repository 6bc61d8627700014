"""`fedhop netsim`: emulated hosts in network namespaces.  Unit tests of the parsing and of the
ledger-against-kernel arithmetic run anywhere; the real runs (wire bytes against the kernel's
counters with a 10 MB model, round time against a shaped link, clean-up) need root."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.ledger import LedgerRecord
from fedhop.deploy.launch.hosts import HostsError, HostsFile, HostSpec, Role
from fedhop.deploy.launch.netsim import (
    FRAME_OVERHEAD,
    MSS,
    IfCounters,
    default_hosts,
    host_rates,
    netns_unavailable,
    parse_rate,
    physical_link,
    wire_report,
)
from fedhop.deploy.launch.netsim import main as netsim_main

ROOT = Path(__file__).resolve().parents[1]


def quad_toml(dim: int, *, topology: str = "star", edges: int = 0, count: int = 4, processes: int = 2,
              rounds: int = 2, name: str = "netsim") -> str:
    return f"""
[run]
name = "{name}"
rounds = {rounds}
call_timeout = 60.0
round_timeout = 120.0
[topology]
kind = "{topology}"
edges = {edges}
[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 1
batch_size = 0
[data]
dataset = "quadratic"
dim = {dim}
[model]
init = "zeros"
[clients]
count = {count}
processes = {processes}
[transport]
kind = "grpc"
"""


# ----------------------------------------------------------------------------- unit
@pytest.mark.parametrize("text, bits", [("10mbit", 10_000_000), ("1.5Gbit", 1_500_000_000), ("500kbit", 500_000),
                                        ("2mbps", 16_000_000), (250_000, 250_000), ("100", 100)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["fast", "10 parsecs", "-3mbit", "0mbit", "0.0001bit", 0, 0.5, float("nan")])
def test_parse_rate_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_rate(bad)


def test_counters_payload_subtracts_one_header_per_packet():
    c = IfCounters(tx_bytes=1_000_000 + 70 * 66, tx_packets=70, rx_bytes=40 * 66, rx_packets=40)
    assert (c.tx_payload, c.rx_payload) == (1_000_000, 0)       # 40 pure ACKs carry no payload
    d = c.minus(IfCounters(tx_bytes=66, tx_packets=1))
    assert d.tx_payload == 1_000_000 and d.tx_packets == 69


def test_default_hosts_put_every_process_on_its_own_host():
    cfg = parse_config(quad_toml(10, topology="hierarchical", edges=2, count=6, processes=4))
    hf = default_hosts(cfg)
    assert [h.name for h in hf.hosts] == ["server", "edge-0", "edge-1", "client-0", "client-1", "client-2",
                                          "client-3"]
    assert [h.clients for h in hf.hosts[3:]] == ["0-1", "2", "3-4", "5"]


def test_host_rates_precedence_and_errors():
    hf = HostsFile(hosts=[HostSpec("server", "", server=True), HostSpec("e", "", edges=[0]),
                          HostSpec("c1", "", clients=2), HostSpec("c2", "", clients=2, bandwidth="5mbit")])
    rates = host_rates(hf, {"client": "20mbit", "e": "1gbit"})
    assert rates == {"server": None, "e": 1_000_000_000, "c1": 20_000_000, "c2": 5_000_000}
    assert host_rates(hf, {"c2": "7mbit"})["c2"] == 7_000_000
    with pytest.raises(HostsError, match="'nobody'"):
        host_rates(hf, {"nobody": "1mbit"})
    with pytest.raises(HostsError, match=r"^host 'c1' \(--bandwidth client=\): bandwidth '0bit'"):
        host_rates(hf, {"client": "0bit"})
    with pytest.raises(HostsError, match=r"^host 'c2' \(--bandwidth c2=\): bandwidth 'x'"):
        host_rates(hf, {"c2": "x"})


def test_physical_link_from_endpoint_roles():
    assert physical_link("server", "client-3") == "client-server"
    assert physical_link("client-proc1", "edge-0") == "client-edge"
    assert physical_link("edge-1", "server") == "edge-server"
    assert physical_link("edge-0", "edge-2") == "edge-edge"


def _rec(msg_id, src, dst, framed, role="sender", method="train", round=1):
    return LedgerRecord(run_id="r", round=round, step=0, src=src, dst=dst, link="client-server", direction="down",
                        method=method, tensor_bytes=max(0, framed - 100), payload_bytes=framed - 5, framed_bytes=framed,
                        seconds=0.0, recorder=src, role=role, msg_id=msg_id, status="ok", wall_time=0.0)


def test_wire_report_places_each_message_on_the_hosts_of_its_ends(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.insert_records([
        _rec("m1", "server", "client-0", 1000), _rec("m1", "server", "client-0", 1000, role="receiver"),
        _rec("m2", "client-0", "server", 700, method="train.reply"),
        _rec("m3", "server", "client-2", 500),
        _rec("m4", "client-proc1", "server", 90, role="receiver", method="register"),   # receiver's record only
        _rec("m5", "client-0", "client-1", 10_000),   # same host: never on the wire
    ])
    store.close()
    a, b, s = HostSpec("a", "x"), HostSpec("b", "y"), HostSpec("s", "z", server=True)
    roles = [Role("server", "server", s, 1), Role("client-proc0", "client", a, 2, clients=[0, 1]),
             Role("client-proc1", "client", b, 2, clients=[2])]
    counters = {"s": IfCounters(2000 + 66 * 10, 10, 1000 + 66 * 5, 5), "a": IfCounters(720 + 66 * 4, 4, 1010, 0),
                "b": IfCounters(100, 0, 510, 0)}
    rep = wire_report(tmp_path, roles, counters, {"s": None, "a": 8_000, "b": None})
    assert rep["hosts"]["a"]["ledger_sent"] == 700 and rep["hosts"]["a"]["ledger_received"] == 1000
    assert rep["hosts"]["s"]["ledger_sent"] == 1500 and rep["hosts"]["s"]["ledger_received"] == 790
    assert rep["hosts"]["b"]["ledger_sent"] == 90 and rep["hosts"]["b"]["ledger_received"] == 500
    assert rep["hosts"]["s"]["kernel_payload"] == 3000
    assert rep["hosts"]["s"]["ratio"] == pytest.approx(2290 / 3000)
    link = rep["links"]["client-server"]
    assert link["ledger_framed"] == 2290 and link["kernel_payload"] == 1730 + 610     # the client hosts
    assert link["calls"] == 3 and link["messages"] == 4


# ----------------------------------------------------------------------------- emulated hosts (root)
NETNS_REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS_REASON is not None, reason=f"needs network namespaces: {NETNS_REASON}")
MODEL_DIM = 2_621_440            # 10 MiB of float32: the model the wire-byte test requires


def _netsim_cli(cfg_file: Path, out: Path, *extra: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "netsim", str(cfg_file), "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ledger/kernel" in res.stdout
    return json.loads((out / "netsim.json").read_text())


def _check_wire(report: dict, links: set[str]) -> None:
    hosts = report["hosts"]
    # conservation: the bridge delivers every frame one host sends to another host
    assert sum(h["kernel"]["tx_bytes"] for h in hosts.values()) == sum(h["kernel"]["rx_bytes"] for h in hosts.values())
    assert report["unplaced_messages"] == 0
    assert {k for k, v in report["links"].items() if "kernel_payload" in v} == links
    for name, link in report["links"].items():
        # the ledger's framed bytes are at least 97% of the TCP payload the kernel counted, and never more
        assert 0.97 <= link["ratio"] <= 1.0, (name, link)
    for name, h in hosts.items():
        assert h["ledger_sent"] <= h["kernel"]["tx_payload"] and h["ledger_received"] <= h["kernel"]["rx_payload"]
        assert h["ratio"] >= 0.97, (name, h)


@needs_netns
@pytest.mark.netns
def test_wire_bytes_fedavg_star_10mb_model(tmp_path):
    cfg_file = tmp_path / "star.toml"
    cfg_file.write_text(quad_toml(MODEL_DIM, name="wire-star"))
    report = _netsim_cli(cfg_file, tmp_path / "run", "--capture", "server")
    _check_wire(report, {"client-server"})
    # the remainder, byte for byte: HTTP/2 DATA payload is exactly the ledger's framed bytes, and the
    # rest of the TCP payload is HTTP/2 frame headers, HEADERS/trailers, WINDOW_UPDATE, PING, SETTINGS
    cap = report["capture"]["server"]
    assert cap["broken"] == [] and cap["kernel_drops"] == 0
    assert cap["data_payload_bytes"] == cap["ledger_framed"] == report["hosts"]["server"]["ledger_sent"] + \
        report["hosts"]["server"]["ledger_received"]
    parts = cap["overhead"]
    assert cap["tcp_payload"] - cap["data_payload_bytes"] == parts["frame_headers"] + parts["headers_and_trailers"] \
        + parts["window_updates"] + parts["pings"] + parts["settings"] + parts["other_frames"] + parts["prefaces"] \
        == parts["total"]
    # the kernel's count differs from the capture only by retransmitted segments and SYN option bytes
    assert 0 <= cap["kernel_minus_capture"] - cap["retransmitted_bytes"] <= 8 * 2 * cap["connections"] + 200
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_parameters"] * 4 >= 10 * 2**20
    link = report["links"]["client-server"]
    # 2 rounds x 4 clients x (model down + model up) = 16 models of tensor data on the client links
    assert link["ledger_tensor"] == 16 * MODEL_DIM * 4


@needs_netns
@pytest.mark.netns
def test_wire_bytes_hierfavg_10mb_model(tmp_path):
    from fedhop.deploy.launch.netsim import run_netsim
    cfg = parse_config(quad_toml(MODEL_DIM, topology="hierarchical", edges=2, name="wire-hier"))
    res = run_netsim(cfg, tmp_path / "run")
    assert res.status == 0
    _check_wire(res.report, {"client-edge", "edge-server"})
    assert res.report["links"]["edge-server"]["ledger_tensor"] == 2 * 2 * 2 * MODEL_DIM * 4   # rounds x edges x 2
    # each edge host carries its clients' link and its link to the server, nothing else
    hosts, links = res.report["hosts"], res.report["links"]
    edge_total = hosts["edge-0"]["kernel_payload"] + hosts["edge-1"]["kernel_payload"]
    assert edge_total == links["client-edge"]["kernel_payload"] + links["edge-server"]["kernel_payload"]


@needs_netns
@pytest.mark.netns
def test_round_time_follows_bytes_over_bandwidth(tmp_path):
    """One logical client per client host, both client links at 40 Mbit/s: a round moves the model
    down, then the update up, over each shaped link.

    Noise on a loaded machine (other processes, a CI neighbour) can only make a round slower than
    the wire allows, never faster.  So: every round 2.. (round 1 also opens connections) takes at
    least 90% of the predicted wire time (the shaping binds), and the fastest of them is within
    10% of the prediction + 40 ms (process and codec time): the model explains the round once
    the machine's noise is taken out."""
    from fedhop.deploy.launch.netsim import run_netsim
    dim = 262_144                                    # 1 MiB model: ~0.44 s per round at 40 Mbit/s
    # the virtual clock (common/engine/vclock.py) gets the same links: 40 Mbit/s each way, no compute time
    text = quad_toml(dim, count=2, processes=2, rounds=5, name="shaped").replace(
        "[clients]\n", "[clients]\nuplink_mbps = 40.0\ndownlink_mbps = 40.0\nstep_seconds = 0.0\n")
    cfg = parse_config(text)
    res = run_netsim(cfg, tmp_path / "run", bandwidth={"client": "40mbit"})
    assert res.status == 0
    times = res.report["round_times"]
    assert [t["round"] for t in times] == [1, 2, 3, 4, 5]
    for t in times:
        expected = 2 * (dim * 4) * (1 + FRAME_OVERHEAD / MSS) * 8 / 40e6    # lower bound from tensor bytes alone
        assert t["predicted_seconds"] >= expected
    later = times[1:]
    for t in later:
        assert t["measured_seconds"] >= 0.90 * t["predicted_seconds"], t
    fastest = min(later, key=lambda t: t["measured_seconds"])
    assert abs(fastest["measured_seconds"] - fastest["predicted_seconds"]) <= \
        0.10 * fastest["predicted_seconds"] + 0.04, later
    # the virtual clock agrees with the shaped wire: its round (framed ledger bytes over 40 Mbit/s
    # down, then up) is the fastest measured round within the same tolerance (it omits TCP/IP
    # headers, about 4.5% at this MSS, inside the 10%); no measured round beats it by more than 10%
    with sqlite3.connect(tmp_path / "run" / "run.db") as db:
        sim = dict(db.execute("SELECT round, sim_seconds FROM rounds ORDER BY round"))
    for t in later:
        assert sim[t["round"]] is not None
        assert t["measured_seconds"] >= 0.90 * sim[t["round"]], (t, sim)
    r = fastest["round"]
    assert abs(fastest["measured_seconds"] - sim[r]) <= 0.10 * sim[r] + 0.04, (later, sim)


@needs_netns
@pytest.mark.netns
def test_namespaces_are_cleaned_up_and_stale_ones_removed():
    from fedhop.deploy.launch.netsim import EmulatedNetwork, cleanup_stale
    stale = "fh-999999999-0-sw"                          # no such pid: left by a dead run
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in cleanup_stale()
    with EmulatedNetwork() as net:
        a, b = net.add_host("a", rate=10_000_000), net.add_host("b")
        net.finalize()
        names = [a.netns, b.netns, net.switch]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
        ping = subprocess.run(net.exec_prefix("a") + [sys.executable, "-c",
                              "import socket; print(socket.gethostbyname('b'))"], capture_output=True, text=True)
        assert ping.stdout.strip() == b.address
        qdisc = subprocess.run(["tc", "-n", a.netns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "10Mbit" in qdisc.stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names + [stale])
    assert not any(Path("/etc/netns", n).exists() for n in names)


def test_an_unknown_capture_host_is_one_line_exit_2_before_anything_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.toml").write_text(quad_toml(4))
    assert netsim_main(["exp.toml", "--capture", "nosuchhost", "--out", "no"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--capture nosuchhost: no such host (hosts: server, " in err, err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("setup, extra, said", [
    ("run", [], "--out out: not empty (an earlier run, or files of yours); name a new or empty folder"),
    ("file", [], "--out out: a file, not a folder"),
    ("", ["--bandwidth", "client=0.0001bit"], "--bandwidth client=: bandwidth '0.0001bit': at least 1 bit/s"),
    ("", ["--bandwidth", "nobody=10mbit"], "--bandwidth nobody=...: 'nobody' is neither a host nor one of"),
    ("", ["--hosts", "hosts.toml"], "host 'h0' (the hosts file): bandwidth 'abc': expected e.g. '10mbit'"),
])
def test_bad_out_and_rates_are_one_line_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys, setup, extra, said):
    """An --out holding an earlier run (whose records the new run's would mix with) or a file, and a
    rate that cannot shape a link (below 1 bit/s, unknown host, a hosts file's bad `bandwidth`): one
    line, exit 2, and what was there is untouched."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.toml").write_text(quad_toml(4))
    (tmp_path / "hosts.toml").write_text('[[host]]\nname = "h0"\naddress = "10.0.0.1"\nserver = true\n'
                                         'bandwidth = "abc"\nclients = 2\n[[host]]\nname = "h1"\n'
                                         'clients = 2\n')   # no address: netsim assigns every host's
    if setup == "run":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "run.db").write_bytes(b"earlier")
    elif setup == "file":
        (tmp_path / "out").write_text("mine")
    assert netsim_main(["exp.toml", "--out", "out", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"fedhop netsim: {said}"), err
    if setup == "run":
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["run.db"]
        assert (tmp_path / "out" / "run.db").read_bytes() == b"earlier"
    elif setup == "file":
        assert (tmp_path / "out").read_text() == "mine"
    else:
        assert not (tmp_path / "out").exists()
