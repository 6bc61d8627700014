"""Malformed inputs from a hostile client: each is rejected with its typed error, recorded in
run.db and counted in the summary; the parent never crashes and the model is exactly the one
built from the honest clients' results."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from fedhop.client.host import ClientHost
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import parse_config
from fedhop.common.transport.base import Request
from fedhop.common.transport.grpc import GrpcEndpoint, probe_rpc_handler
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import decode_frames, encode, make_envelope
from fedhop.common.wire.ledger import Ledger
from fedhop.server.resilience import ledger_consistency
from tests.cluster import Cluster, failed_clients_by_round, fedavg_reference
from tests.helpers import quadratic_config

RNG = np.random.default_rng(21)
CENTERS = RNG.normal(0, 2, size=(4, 6))
CURV = RNG.uniform(0.5, 2.0, size=(4, 6))
SIZES = [5, 9, 13, 7]
ROUNDS, STEPS, LR = 3, 3, 0.1
HOSTILE = 3


def _cfg():
    return parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR, name="hostile"),
                        ["run.min_results=1", "run.call_timeout=10.0", "run.round_timeout=20.0"])


def _frame_header(env: pb.Envelope) -> bytes:
    head = env.SerializeToString()
    return bytes([0x0A]) + _varint(len(head)) + head


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class HostileClient:
    """Hosts client 3 behind its own gRPC server; computes the honest reply, then breaks it."""

    def __init__(self, cfg, mode: str) -> None:
        self.cfg, self.mode = cfg, mode
        self.host = ClientHost(cfg, "client-procH", [HOSTILE], "", Ledger())
        self.previous: list[bytes] | None = None
        self.calls = 0
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fedhop.Fedhop", {
            "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
            "Call": grpc.unary_stream_rpc_method_handler(   # a small request, bundled (common/transport/grpc.py)
                lambda bundle, context: self._exchange(iter(pb.FrameBundle.FromString(bundle).frames), context)),
            "Probe": probe_rpc_handler("client-procH")}),))   # it proves its address when it registers
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.server, self.address = server, f"127.0.0.1:{port}"

    def _exchange(self, request_iterator, context):
        decoded = decode_frames(list(request_iterator))
        env = decoded.envelope
        self.calls += 1
        if env.method != "train":
            reply_env = make_envelope(run_id=env.run_id, round=env.round, step=env.step, src=env.dst, dst=env.src,
                                      method=env.method + ".reply")
            yield from encode(Payload(), reply_env).frames
            return
        self.host.run_id = env.run_id
        honest = self.host.handle(Request(env, decoded.payload))
        reply_env = make_envelope(run_id=env.run_id, round=env.round, step=env.step, src=env.dst, dst=env.src,
                                  method="train.reply")
        frames = self.corrupt(honest, reply_env)
        if self.mode == "replay" and self.previous is None:
            self.previous = encode(honest, reply_env).frames   # honest in round 1, replayed later
            yield from self.previous
            return
        yield from frames

    def corrupt(self, honest: Payload, env: pb.Envelope) -> list[bytes]:
        w = honest.tensors["w"]
        t, s = dict(honest.tensors), dict(honest.scalars)
        mode = self.mode
        if mode == "wrong_shape":
            t["w"] = w[:3].clone()
        elif mode == "wrong_dtype":
            t["w"] = w.double()
        elif mode == "nan":
            t["w"] = w.clone()
            t["w"][0] = math.nan
        elif mode == "inf_scalar":
            s["train_loss"] = math.inf
        elif mode == "no_weight":
            s.pop("weight")
        elif mode == "bad_weight":
            s["weight"] = -5.0
        elif mode == "string_scalar":
            s["train_loss"] = "lots"
        elif mode == "extra_tensor":
            t["sneaky"] = torch.ones(1000)
        elif mode == "stale_round":
            env.round = env.round + 7
        elif mode == "wrong_run":
            env.run_id = "someone-elses-run"
        elif mode == "impersonate":
            env.src = "client-0"
        elif mode == "replay" and self.previous is not None:
            return self.previous
        frames = encode(Payload(t, s), env).frames
        if mode == "huge":
            env2 = pb.Envelope()
            env2.CopyFrom(env)
            env2.data_bytes = 1 << 40
            del env2.tensors[:]
            env2.tensors.add(name="w", dtype="float32", shape=[1 << 38], nbytes=1 << 40)
            return [_frame_header(env2), *frames[1:]]
        if mode == "size_lie":     # the header promises more bytes than the frames carry
            env2 = pb.Envelope()
            env2.CopyFrom(env)
            env2.data_bytes = env.data_bytes + 400
            env2.tensors[0].shape[:] = [6 + 100]
            env2.tensors[0].nbytes = (6 + 100) * 4
            return [_frame_header(env2), *frames[1:]]
        if mode == "bad_checksum":
            data = bytearray(frames[1])
            data[-1] ^= 0x40
            return [frames[0], bytes(data), *frames[2:]]   # the sender's true trailer, a flipped data byte
        if mode == "garbage":
            return [b"\x0a\xff\xff\xff\xff\x0f" + bytes(range(50))]
        return frames

    def register(self, server_address: str, ids=(HOSTILE,)) -> pb.RegisterReply:
        ep = GrpcEndpoint("client-procH", Ledger())
        try:
            return ep.register(server_address, pb.RegisterRequest(
                node_id="client-procH", role="client", address=self.address,
                clients=[pb.LogicalClient(client_id=c) for c in ids]), 10.0)
        finally:
            ep.stop()

    def close(self) -> None:
        self.server.stop(0.1)


CASES = [
    ("wrong_shape", "BAD_SHAPE"), ("wrong_dtype", "BAD_DTYPE"), ("nan", "NON_FINITE"), ("inf_scalar", "NON_FINITE"),
    ("no_weight", "MISSING_SCALAR"), ("bad_weight", "BAD_SCALAR"), ("string_scalar", "BAD_SCALAR"),
    ("extra_tensor", "BAD_EXTRA"), ("stale_round", "STALE_ROUND"), ("replay", "STALE_ROUND"),
    ("wrong_run", "WRONG_RUN"), ("impersonate", "WRONG_SENDER"), ("huge", "TOO_LARGE"),
    ("size_lie", "SIZE_MISMATCH"), ("bad_checksum", "CHECKSUM_MISMATCH"), ("garbage", "MALFORMED_FRAME"),
]


@pytest.fixture(scope="module")
def honest_only(tmp_path_factory):
    return fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {r: {HOSTILE} for r in range(1, ROUNDS + 1)})


@pytest.mark.parametrize("mode, code", CASES)
def test_hostile_result_is_rejected_typed_and_the_run_completes(tmp_path, mode, code, honest_only):
    cfg = _cfg()
    cluster = Cluster(cfg, tmp_path)
    hostile = HostileClient(cfg, mode)
    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2])
        assert hostile.register(cluster.address).accepted
        summary = cluster.run()
    finally:
        cluster.close()
        hostile.close()
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS
    store = cluster.store()
    rejected = [e for e in store.events("rejected_payload") if e["node"] == f"client-{HOSTILE}"]
    rounds_hit = ROUNDS - 1 if mode == "replay" else ROUNDS      # the replay is honest in round 1
    assert len(rejected) == rounds_hit, store.events()
    assert all(e["detail"].startswith(code) for e in rejected), [e["detail"] for e in rejected]
    assert summary["faults"]["rejections"] == {code: rounds_hit}
    # no honest result was lost; the model is the honest clients' FedAvg (hostile bytes never got in)
    left_out = failed_clients_by_round(store)
    assert all(ids == {HOSTILE} for ids in left_out.values())
    expected = honest_only if mode != "replay" else fedavg_reference(
        CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {r: {HOSTILE} for r in range(2, ROUNDS + 1)})
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(), expected, rtol=1e-5, atol=1e-5)
    consistency = ledger_consistency(store)      # every lone record is an explained loss or rejection
    assert consistency["ok"] and consistency["mismatched"] == 0, consistency
    # the receiver's ledger records the rejected message as such
    if mode in ("stale_round", "impersonate", "wrong_run", "replay"):
        recs = [m for m in store.messages() if m["role"] == "receiver" and m["status"] == "rejected"]
        assert len(recs) == rounds_hit and all(r["error"].startswith(code) for r in recs), recs


def test_duplicate_client_id_registration_is_refused_while_the_owner_lives(tmp_path):
    cfg = _cfg()
    cluster = Cluster(cfg, tmp_path)
    hostile = HostileClient(cfg, "none")
    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3])
        reply = hostile.register(cluster.address, ids=(1, 3))       # steals live clients
        assert not reply.accepted and reply.message.startswith("DUPLICATE_CLIENT")
        twice = hostile.register(cluster.address, ids=(5, 5))       # one id twice
        assert not twice.accepted and "listed twice" in twice.message
        summary = cluster.run()
    finally:
        cluster.close()
        hostile.close()
    assert summary["status"] == "completed" and hostile.calls == 0   # never called: never saw the model
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(),
                               fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {}), rtol=1e-5, atol=1e-5)


def test_nan_policy_fail_stops_the_run_with_a_clear_message(tmp_path):
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR, name="nanfail"),
                       ["run.min_results=1", "security.nan_policy=fail"])
    cluster = Cluster(cfg, tmp_path)
    hostile = HostileClient(cfg, "nan")
    try:
        cluster.add_client("client-proc0", [0, 1, 2])
        assert hostile.register(cluster.address).accepted
        summary = cluster.run()
    finally:
        cluster.close()
        hostile.close()
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0
    assert "NaN/Inf" in summary["error"] and "nan_policy" in summary["error"]
    assert summary["faults"]["rejections"] == {"NON_FINITE": 1}


HANDSHAKES = """
import socket, ssl, sys, time
from concurrent import futures
import fedhop.common   # before grpc: its GRPC_VERBOSITY default
import grpc
d = sys.argv[1]
key, cert, ca = (open(f"{d}/{n}", "rb").read() for n in ("server.key", "server.pem", "ca.pem"))
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                                           require_client_auth=True))
server.start()
failed = 0
for _ in range(20):   # TLS without a client certificate: the server refuses each handshake
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            tls.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
            failed += tls.recv(100) == b""
    except (OSError, ssl.SSLError):
        failed += 1
server.stop(0).wait()
print("refused", failed)
"""


@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_refused_tls_handshakes_do_not_grow_a_roles_log(tmp_path, verbosity):
    """Red team: gRPC core wrote a line for every failed TLS handshake, so any peer reaching a port
    grew the log without limit.  With fedhop imported first (every role) gRPC's log keeps its
    errors only: 20 refused handshakes, no line; a user who asks for INFO (GRPC_VERBOSITY) gets
    them back, which is the control that the handshakes were logged at all."""
    assert subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "certs", str(tmp_path / "certs"), "--nodes",
                           "server"], capture_output=True).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity
    res = subprocess.run([sys.executable, "-c", HANDSHAKES, str(tmp_path / "certs")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.split() == ["refused", "20"], res.stdout + res.stderr
    handshake_lines = [ln for ln in res.stderr.splitlines() if "Handshake failed" in ln]
    assert len(handshake_lines) == 0 if verbosity is None else len(handshake_lines) >= 20, res.stderr[-2000:]
