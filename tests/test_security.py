"""TLS, mutual TLS and node credentials (common/security/auth.py, deploy/launch/certs.py).

- `fedhop certs` makes a CA and per-node certificates that verify against it;
- TLS and mutual-TLS runs of real processes (`fedhop run` with security.certs_dir) complete;
- a node with a wrong token, a certificate from another CA, or a borrowed identity is refused,
  recorded as `auth_refused`, never called, and the run's model is the honest clients' FedAvg;
- a plaintext client against a TLS server stops with a message that says TLS.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from safetensors.torch import load_file

from fedhop.client.runtime import ClientProcess
from fedhop.common.config import parse_config
from fedhop.common.security.auth import NodeCredentials, TlsFiles, write_cluster
from fedhop.common.transport.base import CallFailed
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from fedhop.deploy.cli.cli import main as fedhop
from fedhop.deploy.launch.launcher import run_local
from tests.cluster import Cluster, fedavg_reference
from tests.helpers import quadratic_config, wait_until

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(4, 5))
CURV = RNG.uniform(0.5, 2.0, size=(4, 5))
SIZES = [4, 6, 8, 10]
ROUNDS, STEPS, LR = 3, 3, 0.1


def _text(name: str = "sec") -> str:
    return quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR, processes=2, name=name)


def test_certs_command_makes_a_ca_and_node_certificates_that_verify(tmp_path, capsys):
    d = tmp_path / "pki"
    assert fedhop(["certs", str(d), "--nodes", "server,client-proc0..2", "--hosts", "10.0.0.7,node7.lan"]) == 0
    assert "4 node certificates" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    for node in ("server", "client-proc0", "client-proc1", "client-proc2"):
        cert = x509.load_pem_x509_certificate((d / f"{node}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node
        assert cert.issuer == ca.subject
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {node, "node7.lan", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
        assert stat.S_IMODE(os.stat(d / f"{node}.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    secret, ca_pem = (d / "cluster.secret").read_bytes(), (d / "ca.pem").read_bytes()
    # a second call reuses the CA and the secret, and adds a node
    assert fedhop(["certs", str(d), "--nodes", "edge-0"]) == 0
    assert (d / "ca.pem").read_bytes() == ca_pem
    assert (d / "cluster.secret").read_bytes() == secret and (d / "edge-0.pem").exists()
    assert fedhop(["certs", str(d), "--nodes", "bad_name!"]) == 2


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_tls_and_mutual_tls_process_runs_complete_and_equal_plaintext(tmp_path, mtls):
    certs = tmp_path / "pki"
    write_cluster(certs, ["server", "client-proc0", "client-proc1"])
    cfg_file = tmp_path / "quad.toml"
    cfg_file.write_text(_text())
    sets = [f'security.certs_dir="{certs}"'] + (["security.mtls=true"] if mtls else [])
    assert run_local(str(cfg_file), sets, str(tmp_path / "run"), quiet=True) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    assert summary["faults"]["auth_refused"] == 0
    server_log = (tmp_path / "run" / "logs" / "server.log").read_text()
    assert "plaintext" not in server_log
    # the channel changes nothing in the numbers: the model is FedAvg on every client
    w = load_file(str(tmp_path / "run" / "model.safetensors"))["w"].double().numpy()
    np.testing.assert_allclose(w, fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {}), rtol=1e-5, atol=1e-6)


def _intruder(cluster: Cluster, creds: NodeCredentials, node_id: str, ids: list[int], claim: str | None = None):
    """Try to register `ids` as `claim` (default: node_id) with `creds`; returns the error text."""
    ep = GrpcEndpoint(node_id, Ledger(), credentials=creds)
    proc = ClientProcess(ep, cluster.address, ids)
    if claim is not None:
        ep.node_id = claim
    try:
        proc.register(timeout=5.0, deadline_s=6.0)
    except RuntimeError as exc:
        return str(exc), ep
    return "", ep


def test_wrong_token_and_borrowed_identity_are_refused_and_the_run_is_unaffected(tmp_path):
    secret = b"cluster-secret-for-this-test"
    cfg = parse_config(_text("tokens"), ["run.min_results=1"])
    cluster = Cluster(cfg, tmp_path, creds=lambda node: NodeCredentials(node, secret=secret))
    stray = []
    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3])
        err, ep = _intruder(cluster, NodeCredentials("client-procX", secret=b"guessed"), "client-procX", [1])
        stray.append(ep)
        assert "refused" in err and "bad or missing signed token" in err, err
        with pytest.raises(CallFailed) as beat:   # no heartbeat, no registration, nothing without the token
            ep.heartbeat(cluster.address, pb.HeartbeatRequest(node_id="client-procX", seq=1), timeout=5.0)
        assert beat.value.code == "UNAUTHENTICATED"
        # a valid token of one node used to speak for another
        err2, ep2 = _intruder(cluster, NodeCredentials("client-procY", secret=secret), "client-procY", [1],
                              claim="client-proc0")
        stray.append(ep2)
        assert "credential of 'client-procY' used for node 'client-proc0'" in err2, err2
        summary = cluster.run()
    finally:
        cluster.close()
        for ep in stray:
            ep.stop(grace=0.1)
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    assert summary["faults"]["auth_refused"] >= 3 == len(cluster.refused)
    assert {n for n, _, _ in cluster.refused} == {"client-procX", "client-proc0"}
    assert set(cluster.coord.children) == {"client-proc0", "client-proc1"}   # the intruders never registered
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(),
                               fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {}), rtol=1e-5, atol=1e-6)


class _CaOnly(NodeCredentials):
    """Trusts the cluster CA but presents no certificate of its own."""

    def channel_credentials(self):
        return grpc.ssl_channel_credentials(root_certificates=self.tls.ca)

    def server_credentials(self):
        return None


def test_mtls_refuses_a_certificate_from_another_ca_and_a_node_without_one(tmp_path):
    certs, rogue = tmp_path / "pki", tmp_path / "rogue"
    write_cluster(certs, ["server", "client-proc0", "client-proc1"])
    write_cluster(rogue, ["client-proc9"])            # a well-formed cluster, but not ours
    cfg = parse_config(_text("mtls"), ["run.min_results=1", f'security.certs_dir="{certs}"', "security.mtls=true"])
    cluster = Cluster(cfg, tmp_path / "run", creds=lambda node: NodeCredentials.from_options(node, str(certs), True))
    stray = []
    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3])
        err, ep = _intruder(cluster, NodeCredentials.from_options("client-proc9", str(rogue), True), "client-proc9", [1])
        stray.append(ep)
        assert err and "TLS" in err, err
        # TLS to the server (it checks the server's certificate) but no client certificate of its own
        ca_only = _CaOnly("client-proc8", tls=TlsFiles((certs / "ca.pem").read_bytes(), b"", b""))
        plain_err, ep3 = _intruder(cluster, ca_only, "client-proc8", [1])
        stray.append(ep3)
        assert plain_err and "TLS" in plain_err, plain_err
        summary = cluster.run()
    finally:
        cluster.close()
        for ep in stray:
            ep.stop(grace=0.1)
    assert summary["status"] == "completed" and set(cluster.coord.children) == {"client-proc0", "client-proc1"}
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(),
                               fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {}), rtol=1e-5, atol=1e-6)


def test_plaintext_client_process_against_a_tls_server_stops_with_a_clear_message(tmp_path):
    certs = tmp_path / "pki"
    write_cluster(certs, ["server"])
    cfg = parse_config(_text("plain"), [f'security.certs_dir="{certs}"'])
    cluster = Cluster(cfg, tmp_path / "run", creds=lambda node: NodeCredentials.from_options(node, str(certs)))
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), FEDHOP_TOKEN="")
        out = subprocess.run([sys.executable, "-m", "fedhop.client", "--parent", cluster.address, "--clients", "0-1",
                              "--node-id", "client-proc0"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
    finally:
        cluster.close()
    assert out.returncode == 2, out.stderr[-2000:]
    assert "serves TLS" in out.stderr and "--certs-dir" in out.stderr, out.stderr[-2000:]
    assert not cluster.coord.children


def test_plaintext_off_loopback_needs_insecure(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), FEDHOP_INSECURE="0")
    out = subprocess.run([sys.executable, "-m", "fedhop.client", "--parent", "10.255.0.1:7000", "--clients", "0",
                          "--node-id", "client-proc0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr, out.stderr[-2000:]
    assert "security.insecure" not in out.stderr, "a client process has no config keys before it registers"


@pytest.mark.parametrize("numel", [10, 40_000], ids=["bundled-call", "exchange-stream"])
def test_a_message_speaking_for_another_node_is_refused_on_both_call_shapes(numel):
    """A valid credential of client-procY on a message whose envelope says it comes from the
    server: refused with PERMISSION_DENIED before the handler runs, whether the request went
    bundled (`Call`, at most one chunk) or streamed (`Exchange`); an honest message passes."""
    import torch

    from fedhop.common.algorithms.base import Payload
    secret = b"cluster-secret-for-this-test"
    handled = []
    callee = GrpcEndpoint("client-proc0", Ledger(), chunk_bytes=64 << 10, max_message_bytes=1 << 20,
                          credentials=NodeCredentials("client-proc0", secret=secret))
    address = callee.serve(lambda req: handled.append(req.envelope.src) or Payload(), "127.0.0.1:0")
    caller = GrpcEndpoint("client-procY", Ledger(), chunk_bytes=64 << 10, max_message_bytes=1 << 20,
                          credentials=NodeCredentials("client-procY", secret=secret))
    payload = Payload(tensors={"w": torch.zeros(numel)})
    try:
        caller.call(address, "client-proc0", "ping", payload, round=1, timeout=10)   # honest: passes
        caller.node_id = "server"                                                   # now it lies
        with pytest.raises(CallFailed) as refused:
            caller.call(address, "client-proc0", "train", payload, round=1, timeout=10)
    finally:
        caller.stop()
        callee.stop()
    assert refused.value.code == "PERMISSION_DENIED"
    assert "credential of 'client-procY' used for a message from 'server'" in str(refused.value)
    assert handled == ["client-procY"]


def _stderr_until(proc: subprocess.Popen, needle: str, timeout: float = 120.0) -> str:
    """The process's standard error up to the first line holding `needle` (or its end)."""
    import queue
    import threading
    lines: queue.Queue = queue.Queue()
    assert proc.stderr is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] and None or lines.put(None),
                     daemon=True).start()
    seen = ""
    while True:
        line = lines.get(timeout=timeout)
        if line is None:
            return seen
        seen += line
        if needle in line:
            return seen


@pytest.mark.parametrize("mode", ["shared-token", "per-node", "mtls"])
def test_a_process_says_at_start_in_one_line_that_it_runs_shared_token_or_plaintext(tmp_path, mode):
    """A client process started with only the shared token (FEDHOP_TOKEN) prints the SHARED-TOKEN
    line once; with its own per-node credential it does not; plaintext (here on loopback) is one
    line of its own; mutual TLS with its own certificate prints neither.  The server started with
    the shared token says the same."""
    from fedhop.common.security.auth import SHARED_TOKEN_NOTE
    from fedhop.common.security.nodecred import TokenAuthority
    env = dict(os.environ, PYTHONPATH=str(ROOT), FEDHOP_TOKEN="", FEDHOP_NODE_CRED="", FEDHOP_CERTS_DIR="",
               FEDHOP_MTLS="", FEDHOP_INSECURE="")
    extra: list[str] = []
    if mode == "shared-token":
        env["FEDHOP_TOKEN"] = "a-run-token-every-member-holds"
    elif mode == "per-node":
        env["FEDHOP_NODE_CRED"] = TokenAuthority().issue("client-proc0")
    else:
        write_cluster(tmp_path / "pki", ["client-proc0"])
        extra = ["--certs-dir", str(tmp_path / "pki"), "--mtls"]
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.client", "--parent", "127.0.0.1:9", "--clients", "0-1",
                             "--node-id", "client-proc0", *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        err = _stderr_until(proc, "serving at")
    finally:
        proc.kill()
        proc.wait()
    assert "serving at" in err, err[-2000:]
    notes = [line.split(" WARNING ", 1)[1] for line in err.splitlines() if " WARNING fedhop: " in line]
    shared = [n for n in notes if n.startswith("fedhop: SHARED-TOKEN")]
    plain = [n for n in notes if n.startswith("fedhop: PLAINTEXT")]
    if mode == "shared-token":
        assert shared == [SHARED_TOKEN_NOTE], err[-2000:]
        assert "any member can impersonate any node" in SHARED_TOKEN_NOTE and "fedhop certs" in SHARED_TOKEN_NOTE
    else:
        assert shared == [], err[-2000:]
    if mode == "mtls":
        assert notes == [], err[-2000:]
    else:
        assert len(plain) == 1 and "127.0.0.1" in plain[0] and "loopback only" in plain[0], err[-2000:]
    if mode != "shared-token":
        return
    # the server of a shared-token deployment (deploy/launch/role.py hands it FEDHOP_TOKEN) says it too
    (tmp_path / "exp.toml").write_text(_text("announce"))
    server = subprocess.Popen([sys.executable, "-m", "fedhop.server", "--config", str(tmp_path / "exp.toml"),
                               "--run-dir", str(tmp_path / "run"), "--port-file", str(tmp_path / "port")],
                              cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        # the port file: written once it serves, after its start-up lines
        wait_until("the server's port file", (tmp_path / "port").exists, [server])
    finally:
        server.kill()
        _, err = server.communicate()
    assert [line for line in err.splitlines() if "SHARED-TOKEN" in line] != [], err[-2000:]
    assert sum(SHARED_TOKEN_NOTE in line for line in err.splitlines()) == 1, err[-2000:]


def test_a_busy_plaintext_parent_is_retried_and_never_taken_for_a_tls_one(tmp_path):
    """A plaintext parent whose port is open but whose calls fail UNAVAILABLE for a while (a loaded
    machine; a gRPC channel repeats its last error until its reconnect backoff ends) is retried until
    it answers.  A TLS mismatch is named only where the parent answers a TLS handshake."""
    from fedhop.common.transport.liveness import Backoff, connection_hint, register_with_backoff

    certs = tmp_path / "pki"
    write_cluster(certs, ["server", "client-proc0"])
    plain = GrpcEndpoint("server", Ledger())
    plain_address = plain.serve(lambda req: None, "127.0.0.1:0",
                                register_handler=lambda *a: pb.RegisterReply(accepted=True))
    secure = GrpcEndpoint("server", Ledger(), credentials=NodeCredentials.from_options("server", str(certs), True))
    tls_address = secure.serve(lambda req: None, "127.0.0.1:0")
    closed = CallFailed("UNAVAILABLE", "failed to connect to all addresses; last error: UNAVAILABLE: "
                        "ipv4:127.0.0.1:1: Socket closed")
    try:
        assert "cannot reach" in connection_hint(plain_address, closed, tls=False)
        assert "serves TLS" in connection_hint(tls_address, closed, tls=False)
        assert "TLS handshake" in connection_hint(tls_address, closed, tls=True)      # mTLS closing on us
        assert "cannot reach" in connection_hint(plain_address, closed, tls=True)

        class Flaky:
            """The first five registrations fail as a loaded parent's do; then the real call."""
            def __init__(self, inner: GrpcEndpoint) -> None:
                self.inner, self.calls = inner, 0

            def register(self, parent, request, timeout):
                self.calls += 1
                if self.calls <= 5:
                    raise closed
                return self.inner.register(parent, request, timeout)

        flaky = Flaky(GrpcEndpoint("client-proc0", Ledger()))
        request = pb.RegisterRequest(node_id="client-proc0", role="client", address="127.0.0.1:1")
        reply = register_with_backoff(flaky, plain_address, request, deadline_s=20.0,
                                      backoff=Backoff(base=0.01, cap=0.02))
        # the parent's own answer came back (it refuses the unproven address: still an answer, not a mismatch)
        assert reply.node_id == "server" and "ADDRESS_UNPROVEN" in reply.message and flaky.calls == 6
        flaky.inner.stop(grace=0.1)
        # against the TLS parent the same failures end registration once they held for 2 s
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="serves TLS"):
            register_with_backoff(Flaky(GrpcEndpoint("client-proc0", Ledger())), tls_address, request,
                                  deadline_s=20.0, backoff=Backoff(base=0.01, cap=0.02))
        assert 2.0 <= time.monotonic() - started < 15.0
    finally:
        plain.stop(grace=0.1)
        secure.stop(grace=0.1)
