"""`fedhop launch`: hosts files, the plan of roles, remote commands, and real launches through a
remote command template: local shells (no root needed) and `ip netns exec {host}` on four
emulated hosts (root)."""
from __future__ import annotations

import json
import os
import shlex
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.security.nodecred import SignedIdentity
from fedhop.deploy.launch.hosts import (
    HostsError,
    Launch,
    hosts_from_dict,
    kill_command,
    load_hosts,
    plan_roles,
    process_layout,
    remote_argv,
    role_command,
)
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config, read_db

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(6, 5))
CURV = RNG.uniform(0.5, 2.0, size=(6, 5))
SIZES = [4, 7, 3, 9, 5, 6]
HIER = 'kind = "hierarchical"\nedges = 2'


def cfg_text(topology: str = "", rounds: int = 3, processes: int = 2) -> str:
    return quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=4, processes=processes, local_steps=3,
                            topology=topology, name="launch")


def hosts(*entries: dict, **launch) -> dict:
    return {"launch": launch, "host": list(entries)}


# ----------------------------------------------------------------------------- hosts file and plan
def test_plan_star_allocates_counts_in_host_order_with_ports_and_parents():
    cfg = parse_config(cfg_text())
    hf = hosts_from_dict(hosts({"name": "a", "address": "10.0.0.1", "server": True, "clients": 2},
                               {"name": "b", "address": "10.0.0.2", "clients": 4, "client_processes": 2,
                                "client_port": 8000}))
    roles = plan_roles(hf, cfg)
    assert [(r.node_id, r.host.name, r.port) for r in roles] == [
        ("server", "a", 7000), ("client-proc0", "a", 7200), ("client-proc1", "b", 8000), ("client-proc2", "b", 8001)]
    assert [r.clients for r in roles[1:]] == [[0, 1], [2, 3], [4, 5]]
    assert all(r.parent == "10.0.0.1:7000" for r in roles[1:])


def test_every_launcher_gives_edges_and_clients_the_configured_window():
    """`transport.window_bytes` reaches every child process's flags: the hosts launcher's and Slurm's
    argv for edges and client processes (the local launcher's are the same lists, deploy/launch/launcher.py)."""
    from fedhop.deploy.launch.hosts import role_argv
    from fedhop.deploy.launch.slurm import task_list

    cfg = parse_config(cfg_text(HIER).replace("[transport]\n", "[transport]\nwindow_bytes = 1048576\n"))
    hf = hosts_from_dict(hosts({"name": "s", "address": "10.0.0.1", "server": True, "edges": [0, 1], "clients": 6}))
    argvs = [role_argv(r, cfg, "/r") for r in plan_roles(hf, cfg) if r.kind != "server"]
    argvs += [t["argv"] for t in task_list(cfg, Path("/r"), 1, False) if t["kind"] != "server"]
    assert len(argvs) == 2 * (2 + 2)   # two edges and two client processes, by each launcher
    for argv in argvs:
        assert argv[argv.index("--window-bytes") + 1] == "1048576", argv


def test_plan_hierarchical_parents_are_the_cluster_edges():
    cfg = parse_config(cfg_text(HIER))
    hf = hosts_from_dict(hosts({"name": "s", "address": "10.0.0.1", "server": True},
                               {"name": "e", "address": "10.0.0.2", "edges": [1, 0], "clients": "0,4"},
                               {"name": "c", "address": "10.0.0.3", "clients": 4}))
    roles = {r.node_id: r for r in plan_roles(hf, cfg)}
    assert roles["edge-1"].address == "10.0.0.2:7100" and roles["edge-0"].address == "10.0.0.2:7101"
    clusters = [[0, 1, 2], [3, 4, 5]]                      # blocks of 6 clients over 2 edges
    for r in roles.values():
        if r.kind == "client":
            assert all(c in clusters[r.edge] for c in r.clients)
            assert r.parent == roles[f"edge-{r.edge}"].address
    placed = sorted(c for r in roles.values() for c in r.clients)
    assert placed == list(range(6))
    on_e = sorted(c for r in roles.values() if r.kind == "client" and r.host.name == "e" for c in r.clients)
    assert on_e == [0, 4]


@pytest.mark.parametrize("data, cfg_topology, needle", [
    (hosts({"name": "a", "address": "x", "server": True, "clients": 5}), "", "clients.count = 6"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": 9}), "", "clients = 9, but only 6"),
    (hosts({"name": "a", "address": "not an address!", "server": True, "clients": 6}), "", "host[0].address"),
    ({"launch": {"stop_grace": -3}, "host": [{"name": "a", "address": "x", "server": True, "clients": 6}]},
     "", "launch.stop_grace = -3"),
    (hosts({"name": "a", "address": "x", "clients": 6}), "", "exactly one host"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": 6, "colour": "red"}), "", "host[0].colour"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": 6, "edges": [0]}), "", "no edge servers"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": 6, "edges": [0]}), HIER, "edges [1]"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": "0-5", "client_port": 7000}), "", "port 7000"),
    (hosts({"name": "a", "address": "x", "server": True, "clients": "0-9"}), "", "outside 0..5"),
    ({"launch": {"remote": "ssh box"}, "host": [{"name": "a", "address": "x", "server": True, "clients": 6}]},
     "", "{host}"),
    ({"launch": {"remote": "ssh {host} {command} {oops"}, "host": [{"name": "a", "address": "x", "server": True,
                                                                   "clients": 6}]}, "", "{oops is not a field"),
    ({"launch": {"workdir": ""}, "host": [{"name": "a", "address": "x", "server": True, "clients": 6}]},
     "", "launch.workdir = '': give a path"),
    ({"launch": {"ship": "tarball"}, "host": [{"name": "a", "address": "x", "server": True, "clients": 6}]},
     "", "launch.ship = 'tarball': no fedhop wheel there"),
])
def test_bad_hosts_files_are_refused_naming_the_problem(data, cfg_topology, needle):
    cfg = parse_config(cfg_text(cfg_topology))
    with pytest.raises(HostsError) as info:
        plan_roles(hosts_from_dict(data), cfg)
    assert needle in str(info.value)


def test_a_hosts_file_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "hosts.toml").write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(HostsError, match="not a hosts file .TOML text.: not UTF-8 at byte 1"):
        load_hosts(tmp_path / "hosts.toml")


def test_example_hosts_file_fits_the_digits_example():
    from fedhop.common.config import load_config
    hf = load_hosts(ROOT / "examples" / "hosts.toml")
    roles = plan_roles(hf, load_config(ROOT / "examples" / "fedavg_digits.toml"))
    assert sorted(c for r in roles for c in r.clients) == list(range(50))
    assert {r.host.name for r in roles} == {h.name for h in hf.hosts}


def test_remote_argv_places_the_command_as_one_argument_or_as_sh_c():
    cmd = "cd ~/fedhop && exec python -m fedhop.server --listen 'a b'"
    assert remote_argv("ssh -p 2222 {host} {command}", "u@h", cmd) == ["ssh", "-p", "2222", "u@h", cmd]
    assert remote_argv("ip netns exec {host}", "ns1", cmd) == ["ip", "netns", "exec", "ns1", "sh", "-c", cmd]


def test_role_command_keeps_credentials_off_the_command_line_and_quotes_paths(tmp_path):
    """A role's shell reads its own per-node credential and, by default, its own TLS files from
    standard input (never a command line, never a shared run token, never another node's key or
    the CA's); the shell writes those files where its process finds them, mode 0600."""
    cfg = parse_config(cfg_text())
    hf = hosts_from_dict(hosts({"name": "a", "address": "10.0.0.1", "server": True, "clients": 6,
                                "env": {"GLOO_SOCKET_IFNAME": "eth 0"}}, workdir="~/my repo", run_root="runs"))
    server, client = plan_roles(hf, cfg)[:2]
    cmd = role_command(hf, server, cfg, "runs/x")
    assert cmd.startswith("cd ~/'my repo' && ") and "FEDHOP_TOKEN" not in cmd
    assert "IFS= read -r FEDHOP_NODE_CRED" in cmd and "export FEDHOP_NODE_CRED " in cmd
    launch = Launch(hf, cfg, Path("out"), roles=[server, client], remote_run="runs/x")
    assert launch.tls is not None    # no certs_dir, no security.insecure: the launcher's own mutual TLS
    pems = {}
    for role in (server, client):
        cred, rest = launch.stdin_of(role).split("\n", 1)
        signed = SignedIdentity.parse(cred)
        assert signed.node_id == role.node_id and signed.issuer == launch.authority.public
        blocks = rest.split("\n.\n")
        ca, cert, key = blocks[:3]
        assert "BEGIN CERTIFICATE" in ca and "BEGIN CERTIFICATE" in cert and "PRIVATE KEY" in key
        pems[role.node_id] = (ca, cert, key)
        tail = blocks[3]
        assert ("[run]" in tail and 'certs_dir = "runs/x/creds/server"' in tail and "mtls = true" in tail) \
            if role.kind == "server" else tail == ""
        # what the shell of that role writes, run for real on this machine
        argv = role_command(hf, role, cfg, "runs/x").split(" && exec ")[0].replace("cd ~/'my repo'", f"cd {tmp_path}")
        res = subprocess.run(["sh", "-c", argv + " && env"], input=launch.stdin_of(role), capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        folder = tmp_path / "runs" / "x" / "creds" / role.node_id
        assert sorted(p.name for p in folder.iterdir()) == sorted(["ca.pem", f"{role.node_id}.pem",
                                                                  f"{role.node_id}.key"])
        assert (folder / f"{role.node_id}.key").read_text() == key + "\n"
        assert (folder / "ca.pem").read_text() == ca + "\n"
        assert stat.S_IMODE((folder / f"{role.node_id}.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "runs" / "x" / "ledger").stat().st_mode) & 0o055   # results keep the umask
        assert "FEDHOP_TOKEN" not in res.stdout
    assert pems["server"][0] == pems["client-proc0"][0] and pems["server"][2] != pems["client-proc0"][2]
    assert "PRIVATE KEY" not in launch.stdin_of(client).split(pems["client-proc0"][2])[1]   # one key each
    assert "--mtls" in role_command(hf, client, cfg, "runs/x") and "runs/x/creds/client-proc0" in role_command(
        hf, client, cfg, "runs/x")
    assert "cat > runs/x/config.toml" in cmd and "GLOO_SOCKET_IFNAME='eth 0'" in cmd
    assert "cat >" not in role_command(hf, client, cfg, "runs/x")
    assert "client-proc0" in kill_command(hf, client, "runs/x")
    # the shell parses it back into the python argv we planned
    tail = cmd.split("exec ", 1)[1]
    assert shlex.split(tail)[:3] == [".venv/bin/python", "-m", "fedhop.server"]
    # the named opt-out: plaintext, no TLS files, the per-node credential still
    plain = parse_config(cfg_text(), ["security.insecure=true"])
    assert Launch(hf, plain, Path("out"), roles=[server, client]).tls is None
    assert "creds" not in role_command(hf, client, plain, "runs/x") and "--insecure" in role_command(
        hf, client, plain, "runs/x")


def test_process_layout_matches_fedhop_run():
    cfg = parse_config(cfg_text(HIER, processes=4))
    assert process_layout(cfg) == [(0, [0, 1]), (0, [2]), (1, [3, 4]), (1, [5])]
    assert process_layout(parse_config(cfg_text(processes=4))) == [(None, [0, 1]), (None, [2, 3]),
                                                                   (None, [4]), (None, [5])]


# ----------------------------------------------------------------------------- real launches
def _write_hosts(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def _launch(hosts_file: Path, cfg_file: Path, out: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "launch", str(hosts_file), str(cfg_file), "--out",
                           str(out), "--quiet", *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _no_process_mentions(marker: str) -> bool:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    return False
            except OSError:
                pass
    return True


LOCAL_TEMPLATE = "env FEDHOP_HOST={host} sh -c {command}"   # "remote" = a local shell: no root, no ssh


def test_launch_through_a_local_template_completes_and_gathers(tmp_path):
    """Two "machines" (local shells with their own run folders), every port 0: each process binds
    its own and reports it, the launcher hands the server's to the clients.  By default the run is
    mutual TLS with certificates the launcher made; the keys never come back with the results and
    are gone from the hosts after gathering."""
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(cfg_text())
    work_a, work_b = tmp_path / "hostA", tmp_path / "hostB"     # two "machines": separate run directories
    work_a.mkdir(), work_b.mkdir()
    p_server, p_a, p_b = 0, 0, 0
    hf = _write_hosts(tmp_path / "hosts.toml", f"""
        [launch]
        remote = "{LOCAL_TEMPLATE}"
        python = "{sys.executable}"
        run_root = "runs"
        [[host]]
        name = "a"
        address = "127.0.0.1"
        workdir = "{work_a}"
        server = true
        server_port = {p_server}
        clients = 2
        client_port = {p_a}
        [[host]]
        name = "b"
        address = "127.0.0.1"
        workdir = "{work_b}"
        clients = 4
        client_port = {p_b}
    """)
    out = tmp_path / "out"
    res = _launch(hf, cfg_file, out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fedhop launch: mutual TLS with per-node credentials made for this run" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["faults"]["auth_refused"] == 0
    assert 'mtls = true' in (out / "config.toml").read_text()          # the server's, gathered
    assert not list(out.rglob("*.key")) and not (out / "creds").exists()
    for work in (work_a, work_b):
        assert not (work / "runs" / "out" / "creds").exists(), work
    server_log = (out / "logs" / "server.log").read_text()
    port = int(server_log.split("serving at ")[1].split()[0].rsplit(":", 1)[1])
    assert port != 0 and f"registering with 127.0.0.1:{port}" in (out / "logs" / "client-proc1.log").read_text()
    assert "PLAINTEXT" not in server_log and "SHARED-TOKEN" not in server_log
    # host b's ledger was only on host b until gathered: now merged, both sides of every message
    assert sorted(p.name for p in (out / "ledger").glob("*.jsonl")) == [
        "client-proc0.jsonl", "client-proc1.jsonl", "server.jsonl"]
    assert not (work_a / "runs" / "out" / "ledger" / "client-proc1.jsonl").exists()
    remote_summary = json.loads((work_a / "runs" / "out" / "summary.json").read_text())
    assert remote_summary["ledger_agreement"]["ok"] is False   # the server alone saw only its own side
    assert summary["ledger_agreement"]["ok"] is True
    assert RunStore(out / "run.db").check_agreement().ok
    _, coord = run_inmemory(parse_config(cfg_text()), tmp_path / "mem")
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], coord.state.params["w"])
    assert (out / "logs" / "client-proc1.log").read_text().count("shut down by parent") == 1


def _two_hosts(path: Path, run_root: Path, second: str, second_python: str) -> Path:
    """Host a (server, 3 clients, this interpreter) and host SECOND (3 clients, SECOND_PYTHON)."""
    ports = [0, 0, 0]   # each process binds its own
    return _write_hosts(path, f"""
        [launch]
        remote = "{LOCAL_TEMPLATE}"
        python = "{sys.executable}"
        workdir = "{ROOT}"
        run_root = "{run_root}"
        stop_grace = 2
        [[host]]
        name = "a"
        address = "127.0.0.1"
        server = true
        server_port = {ports[0]}
        clients = 3
        client_port = {ports[1]}
        [[host]]
        name = "{second}"
        address = "127.0.0.1"
        python = "{second_python}"
        clients = 3
        client_port = {ports[2]}
    """)


def test_launch_stops_everything_when_a_role_fails(tmp_path):
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(cfg_text(rounds=50))
    marker = f"fh-launch-fail-{os.getpid()}"
    run_root = tmp_path / marker
    hf = _two_hosts(tmp_path / "hosts.toml", run_root, "broken", "/nonexistent/python")
    started = time.monotonic()
    res = _launch(hf, cfg_file, tmp_path / "out", timeout=120)
    assert res.returncode == 1
    assert "client-proc1 on broken exited with status 127" in res.stderr
    assert time.monotonic() - started < 60          # did not wait for the server's registration timeout
    assert _no_process_mentions(marker), "a role survived the failed launch"


def test_launch_names_the_servers_refusal_in_one_line(tmp_path):
    """A server that refuses the run's data as it starts (exit status 2: digits has no natural
    clients) is named with its own line, not only its log's path, and the launch exits 2 (a
    refused config, as `fedhop run`); no role is left running."""
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text('[run]\nname = "refused"\nrounds = 2\n[data]\ndataset = "digits"\npartition = "natural"\n'
                        '[clients]\ncount = 6\nper_round = 4\nprocesses = 2\n')
    marker = f"fh-launch-refused-{os.getpid()}"
    hf = _two_hosts(tmp_path / "hosts.toml", tmp_path / marker, "b", sys.executable)
    res = _launch(hf, cfg_file, tmp_path / "out", timeout=120)
    assert res.returncode == 2, res.stderr
    assert "server on a exited with status 2 before serving: data.partition = 'natural': dataset 'digits' has no " \
           "natural clients" in res.stderr, res.stderr
    assert _no_process_mentions(marker), "a role survived the refused launch"


# ----------------------------------------------------------------------------- emulated hosts (root)
def _netns_reason() -> str | None:
    from fedhop.deploy.launch.netsim import netns_unavailable
    return netns_unavailable()


@pytest.mark.netns
def test_launch_hierarchical_on_four_emulated_hosts_with_ip_netns_exec(tmp_path):
    reason = _netns_reason()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    from fedhop.deploy.launch.netsim import EmulatedNetwork, cleanup_stale
    cleanup_stale()
    text = cfg_text(HIER, processes=4) + "\n[security]\ninsecure = true   # emulated hosts: plaintext, explicitly\n"
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(text)
    out = tmp_path / "out"
    with EmulatedNetwork() as net:
        hs = [net.add_host(n) for n in ("alpha", "beta", "gamma", "delta")]
        net.finalize()
        works = []
        for h in hs:
            works.append(tmp_path / h.name)
            works[-1].mkdir()
        body = f"""
            [launch]
            remote = "ssh -o BatchMode=yes {{host}} {{command}}"
            python = "{sys.executable}"
            run_root = "runs"
        """
        layout = [("server = true\nclients = 1", 0), ("edges = [0]\nclients = 2", 1),
                  ("edges = [1]\nclients = 1", 2), ("clients = 2\nclient_processes = 2", 3)]
        for (roles, i) in layout:
            h = hs[i]
            body += (f'[[host]]\nname = "{h.name}"\ntarget = "{h.netns}"\naddress = "{h.address}"\n'
                     f'workdir = "{works[i]}"\n{roles}\n')
        hf = tmp_path / "hosts.toml"
        hf.write_text(textwrap.dedent(body))
        res = _launch(hf, cfg_file, out, "--remote", "ip netns exec {host}")
        assert res.returncode == 0, res.stderr[-3000:]
        for h in hs:   # nothing left running on any emulated host
            assert subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout == ""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == "hierarchical"
    assert summary["ledger_agreement"]["ok"] is True
    assert set(summary["bytes"]["by_link"]) == {"client-edge", "edge-server", "control"}
    # every process registered from its own emulated host's address
    events = RunStore(out / "run.db").events("registered")
    assert {e["node"]: e["detail"].split(" at ")[1].split(":")[0] for e in events} == {
        "edge-0": hs[1].address, "edge-1": hs[2].address}
    serving = set()                     # client processes ran on all four hosts
    for log in (out / "logs").glob("client-proc*.log"):
        serving |= {line.split("serving at ")[1].split(":")[0] for line in log.read_text().splitlines()
                    if "serving at" in line}
    assert serving == {h.address for h in hs}
    _, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], coord.state.params["w"])


@pytest.mark.parametrize("end", ["Ctrl-C", "Ctrl-C twice", "server killed"])
def test_launch_ctrl_c_stops_every_role(tmp_path, end):
    """Ctrl-C stops every role and gathers the stopped run; a second Ctrl-C while the roles are
    being stopped changes nothing (it once cut the stop and the gathering).  A server killed
    (SIGKILL) ends the launch with exit 1, and the gathered run.db says `failed` with a
    `server_lost` event instead of "running"."""
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(cfg_text(rounds=100_000))
    marker = f"fh-launch-int-{os.getpid()}"
    p_server, p_a = 0, 0   # each process binds its own
    hf = _write_hosts(tmp_path / "hosts.toml", f"""
        [launch]
        remote = "{LOCAL_TEMPLATE}"
        python = "{sys.executable}"
        workdir = "{ROOT}"
        run_root = "{tmp_path / marker}"
        [[host]]
        name = "a"
        address = "127.0.0.1"
        server = true
        server_port = {p_server}
        clients = 6
        client_port = {p_a}
    """)
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "launch", str(hf), str(cfg_file), "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    deadline = time.monotonic() + 180              # generous bounds: they hold on a loaded machine
    seen = ""
    assert proc.stdout is not None
    while time.monotonic() < deadline:           # wait until rounds are running
        line = proc.stdout.readline()
        seen += line
        if "round 2:" in line:
            break
    assert "round 2:" in seen, seen[-2000:]
    taken = ""
    if end == "server killed":
        server = next(c for c in psutil.Process(proc.pid).children(recursive=True)
                      if " ".join(c.cmdline()).startswith("fedhop server "))
        server.kill()
    else:
        proc.send_signal(2)                        # Ctrl-C
    while end == "Ctrl-C twice" and "interrupted; stopping every process" not in taken:   # the stop under way
        line = proc.stdout.readline()
        assert line, (seen + taken)[-2000:]
        taken += line
    if end == "Ctrl-C twice":
        proc.send_signal(2)                        # Ctrl-C again, during the stop
    rest, _ = proc.communicate(timeout=180)
    rest = taken + rest
    assert proc.returncode == (1 if end == "server killed" else 130), (seen + rest)[-2000:]
    assert end == "server killed" or "interrupted; stopping every process" in rest
    assert _no_process_mentions(marker)
    # the stopped run came back whole: a run.db without -wal beside it, which merge-ledgers accepts
    out = tmp_path / "out"
    assert (out / "run.db").exists() and not (out / "run.db-wal").exists(), sorted(p.name for p in out.iterdir())
    status = "failed" if end == "server killed" else "stopped"
    assert read_db(out / "run.db", "SELECT status FROM runs") == status
    assert read_db(out / "run.db", "SELECT COUNT(*) FROM events WHERE kind = 'server_lost'") == \
        (end == "server killed")
    merged = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "merge-ledgers", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr[-2000:]
    with RunStore(out / "run.db", create=False) as store:
        assert store.check_agreement().matched > 0


def test_launch_runs_mutual_tls_by_default_and_plaintext_only_by_name(capsys, tmp_path, monkeypatch):
    """The README's two-machine recipe, as written (no security keys): every role gets its own
    certificate folder and --mtls, and the launch says so in one line; plaintext only with
    security.insecure = true, said in one line too.  A dry run makes nothing in the folder it
    runs in."""
    from fedhop.deploy.launch.hosts import main as launch
    monkeypatch.chdir(tmp_path)
    args = [str(ROOT / "examples" / "hosts.toml"), str(ROOT / "examples" / "fedavg_digits.toml"), "--dry-run"]
    assert launch(args) == 0
    tls = capsys.readouterr()
    assert tls.err.strip().splitlines() == [
        "fedhop launch: mutual TLS with per-node credentials made for this run (a CA in this process's memory only; "
        "each host receives its own roles' keys, never another's)"], tls.err
    commands = [line for line in tls.out.splitlines() if not line.startswith("#")]
    assert len(commands) == 4 and all("--insecure" not in c and "FEDHOP_TOKEN" not in c for c in commands)
    for node in ("client-proc0", "client-proc1", "client-proc2"):
        (cmd,) = [c for c in commands if f"--node-id {node}" in c]
        assert "--mtls" in cmd and f"/creds/{node} " in cmd and "umask 077" in cmd
    assert launch(args + ["--set", "security.insecure=true"]) == 0
    plain = capsys.readouterr()
    assert plain.out.count("--insecure") == 3, plain.out   # passed to each of the three client processes
    assert "--mtls" not in plain.out and "creds" not in plain.out
    assert len(plain.err.strip().splitlines()) == 1 and "PLAINTEXT gRPC between the hosts" in plain.err
    assert list(tmp_path.iterdir()) == []


def test_a_hosts_file_port_of_zero_is_bound_by_the_process_and_never_shared():
    """Port 0 in a hosts file: every process of that kind binds its own (no two roles planned on
    one chosen port); the launcher reads the port from the process's "serving at" line."""
    from fedhop.deploy.launch.hosts import reported_port
    cfg = parse_config(cfg_text(HIER, processes=4))
    hf = hosts_from_dict(hosts({"name": "a", "address": "10.0.0.1", "server": True, "server_port": 0,
                                "edges": [0, 1], "edge_port": 0, "clients": 6, "client_processes": 2,
                                "client_port": 0}))
    roles = plan_roles(hf, cfg)
    assert [r.port for r in roles] == [0] * len(roles)
    assert {r.parent_node for r in roles if r.kind == "edge"} == {"server"}
    assert {r.parent_node for r in roles if r.kind == "client"} == {"edge-0", "edge-1"}
    assert reported_port("2026-11-28 10:00:00 server INFO run abc: serving at 0.0.0.0:41234") == 41234
    assert reported_port("x client-proc0 INFO serving at [::1]:5001, registering with 10.0.0.1:41234") == 5001
    assert reported_port("no address here") is None
    with pytest.raises(HostsError, match="not a TCP port"):
        hosts_from_dict(hosts({"name": "a", "address": "10.0.0.1", "server": True, "clients": 6,
                               "client_port": -1}))


WRITER = r"""
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1] + "/run.db", isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, pad BLOB)")
ledger = open(sys.argv[1] + "/ledger/server.jsonl", "a")
n = 0
while True:
    n += 1
    db.execute("INSERT INTO t VALUES (?, zeroblob(2000))", (n,))
    ledger.write('{"n": %d}\n' % n); ledger.flush()
    if n == 500:
        print(n, flush=True)
"""


def test_gathering_copies_a_database_that_is_still_being_written(tmp_path):
    """Ctrl-C on a launch: the copy-back can run while a stopping server still writes run.db (its
    -wal changing under tar) and a ledger.  The host side snapshots run.db with SQLite's backup
    API and ships no -wal; tar's "file changed as we read it" still yields the archive."""
    from fedhop.deploy.launch.hosts import gather_command, unpack_gathered
    work = tmp_path / "hostA"
    run = work / "runs" / "r"
    (run / "ledger").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and int(writer.stdout.readline()) == 500   # 500 rows committed
        assert (run / "run.db-wal").exists()
        hf = hosts_from_dict(hosts({"name": "a", "address": "127.0.0.1", "server": True, "clients": 6,
                                    "workdir": str(work)}, remote=LOCAL_TEMPLATE, python=sys.executable,
                                   run_root="runs", stop_grace=1))
        host = hf.hosts[0]
        res = subprocess.run(remote_argv(hf.remote, host.remote_name, gather_command(hf, host, "runs/r")),
                             capture_output=True, timeout=300)
        out = tmp_path / "out"
        out.mkdir()
        problem = unpack_gathered(res.returncode, res.stdout, res.stderr.decode(errors="replace"), out)
    finally:
        writer.kill()
        writer.wait()
    assert problem is None or problem.startswith("tar:"), problem
    assert sorted(p.name for p in out.iterdir()) == ["ledger", "run.db", "summary.json"]
    with sqlite3.connect(out / "run.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        count, top = db.execute("SELECT COUNT(*), MAX(id) FROM t").fetchone()
    assert count >= 500 and top == count   # every row committed before the copy, and no torn transaction
    assert not (run / "run.db.gathered").exists()   # the snapshot does not stay behind on the host


def test_parent_address_from_a_file_written_later_or_malformed(tmp_path):
    """`--parent-file` (common/transport/liveness.py `resolve_parent`): the child waits for the file its
    parent writes once serving; a file that is not HOST:PORT, or none in time, is a clear error."""
    import threading
    from types import SimpleNamespace

    from fedhop.common.transport.liveness import resolve_parent
    path = tmp_path / "server.address"
    threading.Timer(0.3, lambda: path.write_text("127.0.0.1:4567")).start()
    assert resolve_parent(SimpleNamespace(parent=None, parent_file=str(path)), timeout=10) == "127.0.0.1:4567"
    assert resolve_parent(SimpleNamespace(parent="10.0.0.2:50051", parent_file=None)) == "10.0.0.2:50051"
    path.write_text("not an address")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        resolve_parent(SimpleNamespace(parent=None, parent_file=str(path)), timeout=1)
    with pytest.raises(TimeoutError, match="no parent address within 0s"):
        resolve_parent(SimpleNamespace(parent=None, parent_file=str(tmp_path / "never")), timeout=0.2)


# ----------------------------------------------------------------------------- shipping and versions
def test_launch_refuses_a_host_with_another_fedhop_version(tmp_path):
    """A host whose python reports another fedhop version: exit 2 naming both versions, nothing started."""
    from fedhop.deploy.launch.hosts import launcher_version
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(cfg_text())
    old_python = tmp_path / "old-python"
    old_python.write_text("#!/bin/sh\necho 0.0.9\n")    # answers the version query as an older install would
    old_python.chmod(0o755)
    hf = _two_hosts(tmp_path / "hosts.toml", tmp_path / "remote-runs", "old", str(old_python))
    res = _launch(hf, cfg_file, tmp_path / "out", timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"host 'old' has fedhop 0.0.9 but this launcher is fedhop {launcher_version()}" in res.stderr
    assert "host 'a'" not in res.stderr                     # the matching host passed
    assert not (tmp_path / "remote-runs").exists()          # no role was started


def test_ship_installs_this_checkouts_wheel_into_a_venv_on_the_host(tmp_path):
    """launch.ship = "wheel": the checkout's wheel is built, copied through the remote template and
    installed into a venv in the host's workdir; the roles then run that venv's python, whose
    fedhop is this checkout's code at this launcher's version."""
    from fedhop.deploy.launch.hosts import check_versions, launcher_version, ship
    workdir = tmp_path / "host-a"
    hf = hosts_from_dict(hosts({"name": "a", "address": "127.0.0.1", "server": True, "clients": 6},
                               remote=LOCAL_TEMPLATE, workdir=str(workdir), ship="wheel", venv="fv",
                               ship_python=sys.executable, ship_deps=False))
    ship(hf, tmp_path / "out")
    assert hf.python == "fv/bin/python" and (workdir / "fv" / "bin" / "python").exists()
    assert [p.name for p in (workdir / ".fedhop-ship").iterdir()] == [f"fedhop-{launcher_version()}-py3-none-any.whl"]
    where = subprocess.run([str(workdir / "fv" / "bin" / "python"), "-c",
                            "import importlib.metadata as m, fedhop.deploy.launch.hosts as h; print(m.version('fedhop')); "
                            "print(h.__file__)"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    version, path = where.stdout.split()
    assert version == launcher_version() and Path(path).is_relative_to(workdir / "fv")
    assert Path(path).read_bytes() == (ROOT / "deploy" / "launch" / "hosts.py").read_bytes()
    assert check_versions(hf) == []


@pytest.mark.parametrize("extra, said", [
    (["--out", "earlier"], "--out earlier: not empty (an earlier run, or files of yours); name a new or empty folder"),
    (["--out", "afile"], "--out afile: a file, not a folder"),
    (["--out", ".."], "--out '..': its last part names the run on the hosts"),
    (["--out", "."], "--out '.': its last part names the run on the hosts"),
    (["--remote", "ssh {command}"], "--remote 'ssh {command}': must contain {host}"),
    (["--remote", ""], "--remote '': must contain {host}"),
    (["--remote", "ssh {host} {zzz}"], "--remote 'ssh {host} {zzz}': {zzz} is not a field"),
])
def test_a_bad_out_or_remote_is_one_line_exit_2_and_nothing_is_touched(tmp_path, monkeypatch, capsys, extra, said):
    """--out naming an earlier run (launch would write its config over it and report the old run's
    summary as its own), a file, or a name that puts the hosts' run folder at launch.run_root itself
    or above it; a --remote template the hosts file itself would refuse: refused before anything
    starts, dry run or not, and what was there stays."""
    from fedhop.deploy.launch.hosts import main as launch
    monkeypatch.chdir(tmp_path)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "config.toml").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    for dry in (["--dry-run"], []):
        assert launch([str(ROOT / "examples" / "hosts.toml"), str(ROOT / "examples" / "fedavg_digits.toml"),
                       *extra, *dry]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"fedhop launch: {said}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "earlier" / "config.toml").read_text() == "mine" and (tmp_path / "afile").read_text() == "mine"
