"""`fedhop certs --config` makes a certificate for every process `fedhop run` starts (issue 16).

The case that was wrong: topology.kind = "sequential", 5 edges, clients.processes = 2.  The
launcher starts one client process per edge (5), but certs made client-proc0 and client-proc1
only, so the TLS run failed with "missing client-proc4.pem".  These tests need nothing but the
command line and the launcher: the certificate names are checked against the processes whose
logs a real mutual-TLS run leaves.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.deploy.cli.cli import main as fedhop
from fedhop.deploy.launch.launcher import run_local
from tests.helpers import quadratic_config

RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(10, 3))
SIZES = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7]


def seq_text(edges: int = 5, processes: int = 2, rounds: int = 2) -> str:
    """Fed-CHS on 10 quadratic clients: `edges` edges in blocks, a ring, K = 2 steps per round."""
    return quadratic_config(CENTERS, np.ones_like(CENTERS), SIZES, rounds=rounds, local_steps=1, lr=1.0,
                            algorithm="fedchs", processes=processes,
                            topology=f'kind = "sequential"\nedges = {edges}\ngraph = "ring"\nstart = 0\n'
                                     f'steps_per_round = 2')


def cert_nodes(d: Path) -> set[str]:
    return {p.stem for p in d.glob("*.pem")} - {"ca"}


def test_certs_for_a_sequential_config_cover_every_process_the_launcher_starts(tmp_path, capsys):
    """The issue-16 case: sequential, 5 edges, clients.processes = 2.  The launcher starts one
    client process per edge (5), so certs must make client-proc0..4, not client-proc0..1."""
    cfg_file = tmp_path / "seq.toml"
    cfg_file.write_text(seq_text(edges=5, processes=2))
    d = tmp_path / "pki"
    assert fedhop(["certs", str(d), "--config", str(cfg_file)]) == 0
    want = {"server", *(f"edge-{e}" for e in range(5)), *(f"client-proc{p}" for p in range(5))}
    assert cert_nodes(d) == want
    assert f"{len(want)} node certificates" in capsys.readouterr().out


def test_mutual_tls_sequential_run_with_certs_from_the_config_completes(tmp_path):
    """`fedhop certs --config` then `fedhop run` with mutual TLS, real processes: every process the
    launcher starts finds its certificate and the run completes."""
    cfg_file = tmp_path / "seq.toml"
    cfg_file.write_text(seq_text(edges=5, processes=2, rounds=2))
    d = tmp_path / "pki"
    assert fedhop(["certs", str(d), "--config", str(cfg_file)]) == 0
    run = tmp_path / "run"
    code = run_local(str(cfg_file), [f'security.certs_dir="{d}"', "security.mtls=true"], str(run), quiet=True,
                     show_table=False)
    logs = {p.name: p.read_text()[-400:] for p in (run / "logs").glob("*.log")} if code else {}
    assert code == 0, logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["faults"]["auth_refused"] == 0
    assert {p.stem for p in (run / "logs").glob("*.log")} == cert_nodes(d)


CLUSTER_KEYS = ("ca.pem", "ca.key", "issuer.key", "cluster.secret")


def _certs_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "certs", *args], capture_output=True, text=True,
                          timeout=120)


def test_certs_refuses_reserved_node_names_and_never_replaces_the_cluster_keys(tmp_path):
    """`fedhop certs DIR --nodes ca` (or issuer, ...) would write the node's key over the cluster's
    ca.key / issuer.key: refused with one line, exit 2, before anything is written, also beside an
    ordinary node and in another case; the cluster's CA, issuer key and secret stay as they were."""
    d = tmp_path / "pki"
    assert fedhop(["certs", str(d), "--nodes", "server"]) == 0
    before = {n: (d / n).read_bytes() for n in CLUSTER_KEYS}
    listing = sorted(p.name for p in d.iterdir())
    for nodes in ("ca", "issuer", "cluster", "CA", "Issuer", "fedhop-node", "register", "client-proc0,ca"):
        res = _certs_cli(str(d), "--nodes", nodes)
        assert res.returncode == 2, (nodes, res.stdout, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "reserved" in res.stderr, (nodes, res.stderr)
        assert res.stdout == ""
        assert {n: (d / n).read_bytes() for n in CLUSTER_KEYS} == before, nodes
        assert sorted(p.name for p in d.iterdir()) == listing, nodes   # not even client-proc0's files


def test_certs_never_makes_a_new_ca_over_half_of_one(tmp_path):
    """A node's copy of the folder holds ca.pem without ca.key: `fedhop certs` there would have made
    a new CA over the cluster's certificate; it is refused with one line, exit 2, ca.pem as it was."""
    d = tmp_path / "pki"
    assert fedhop(["certs", str(d), "--nodes", "server,client-proc0"]) == 0
    node_copy = tmp_path / "node"
    node_copy.mkdir()
    (node_copy / "ca.pem").write_bytes((d / "ca.pem").read_bytes())
    res = _certs_cli(str(node_copy), "--nodes", "client-proc1")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "no ca.key" in res.stderr
    assert (node_copy / "ca.pem").read_bytes() == (d / "ca.pem").read_bytes()
    assert sorted(p.name for p in node_copy.iterdir()) == ["ca.pem"]
    # the whole folder is extended: same CA, same issuer key, one more node
    before = {n: (d / n).read_bytes() for n in CLUSTER_KEYS}
    assert fedhop(["certs", str(d), "--nodes", "client-proc1"]) == 0
    assert {n: (d / n).read_bytes() for n in CLUSTER_KEYS} == before and (d / "client-proc1.key").exists()


def test_certs_refuses_a_validity_under_one_day_and_an_expired_ca(tmp_path):
    """`--days 0` or a negative count would make certificates that are void at once, and more than
    36,500 days (100 years) runs past X.509's last date: one line, exit 2,
    no folder made.  A folder whose CA has expired is refused too (a certificate it signs would
    never verify), one line, nothing in it changed."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    for days in ("0", "-5", "36501", "99999999"):
        res = _certs_cli(str(tmp_path / f"pki{days}"), "--nodes", "server", "--days", days)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "--days" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and not (tmp_path / f"pki{days}").exists()
    d = tmp_path / "old"
    d.mkdir()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "an expired CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=10))
            .not_valid_after(now - datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    res = _certs_cli(str(d), "--nodes", "server")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "expired" in res.stderr, res.stderr
    assert sorted(p.name for p in d.iterdir()) == ["ca.key", "ca.pem"]


def test_a_host_that_is_no_name_or_address_is_refused_before_anything_is_written(tmp_path):
    """`--hosts` goes into every certificate's names: one that is neither a DNS name nor an IP
    address ('not a host!') is one line naming it, exit 2, no folder; names and addresses pass."""
    res = _certs_cli(str(tmp_path / "pki"), "--nodes", "server", "--hosts", "node1.lan,not a host!")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--hosts 'not a host!'" in res.stderr and not (tmp_path / "pki").exists()
    ok = _certs_cli(str(tmp_path / "pki"), "--nodes", "server,server", "--hosts", "node1.lan,10.0.0.5,::1")
    assert ok.returncode == 0 and "1 node certificates" in ok.stdout, ok.stderr   # a node named twice is one


def _garbage(d: Path, name: str) -> None:
    (d / name).write_bytes(bytes(range(256)) * 2)


def _folder_instead(d: Path, name: str) -> None:
    (d / name).unlink()
    (d / name).mkdir()


@pytest.mark.parametrize("spoil, said", [
    (lambda d, other: (d / "ca.key").write_bytes((other / "ca.key").read_bytes()),
     "ca.key is not the key of {d}/ca.pem"),
    (lambda d, other: (d / "cluster.secret").write_bytes(b"\n"), "cluster.secret is empty"),
    (lambda d, other: _garbage(d, "ca.key"), "ca.key: not an unencrypted PEM private key"),
    (lambda d, other: _garbage(d, "ca.pem"), "ca.pem: not a PEM certificate"),
    (lambda d, other: _garbage(d, "issuer.key"), "issuer.key: not a fedhop issuer key"),
    (lambda d, other: _folder_instead(d, "server.pem"), "server.pem is not a file"),
])
def test_a_spoilt_cluster_folder_is_refused_before_anything_is_written(tmp_path, spoil, said):
    """A cluster folder whose CA key is another cluster's (each certificate re-issued with it would
    fail to verify), whose secret is empty (tokens signed with no secret), whose key files are not
    keys, or where a node's file is a folder: one line naming the file, exit 2, every file as it was
    (no node's certificate replaced, no temporary file left)."""
    d, other = tmp_path / "pki", tmp_path / "other"
    assert fedhop(["certs", str(d), "--nodes", "server,client-proc0"]) == 0
    assert fedhop(["certs", str(other), "--nodes", "server"]) == 0
    spoil(d, other)
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in d.iterdir()}
    res = _certs_cli(str(d), "--nodes", "server,client-proc1")
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert said.format(d=d) in err, err
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in d.iterdir()} == before


@pytest.mark.parametrize("args, said", [
    (["x", "--nodes", "client-proc0..99999999999"], "makes more than 100,000 node certificates in one command"),
    (["x", "--nodes", "server,SERVER"], "'server' and 'SERVER' differ only in case"),
    (["x", "--nodes", "server", "--hosts", "a" * 64 + ".lan"], "not a host name (at most 253 characters, 63"),
])
def test_nodes_and_hosts_no_certificate_can_hold_are_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch,
                                                                                  args, said):
    """A range of billions of nodes (it filled 4 GB before a word was printed), two node ids that
    are one file on a case-insensitive file system, a DNS label over 63 characters."""
    monkeypatch.chdir(tmp_path)
    assert fedhop(["certs", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert list(tmp_path.iterdir()) == []
