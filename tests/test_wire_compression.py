"""`transport.wire_compression` (common/transport/grpc.py, Wire compression; docs/compression.md):
gRPC's own compression of the calls, both directions.  A bad value, or one set for a transport
other than grpc, is one config line; a run of real processes with gzip ends with the same model,
bit for bit, and the same ledger bytes as without (compression is lossless, and the ledger counts
the framed bytes before it); and benchmarks/wire_compression.py's relay sees fewer bytes on the
socket for a sparse tensor with gzip or deflate than without, while the ledger's count is the
same and equals the socket's (to a few HTTP/2 control bytes) without compression.
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]
D = 2000
RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(4, D))
CURV = RNG.uniform(0.5, 2.0, size=(4, D))
SIZES = [10, 30, 20, 40]
CONTROL = ("heartbeat", "register", "probe")   # their count depends on timing, not on the run's data


def config(wire: str | None, kind: str = "grpc", topology: str = "") -> str:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, local_steps=3, lr=0.2, processes=2, topology=topology)
    text = text.replace('kind = "grpc"', f'kind = "{kind}"')
    return text + (f'wire_compression = "{wire}"\n' if wire is not None else "")


def fedhop_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_bad_value_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text(config("zstd"))
    done = fedhop_run(tmp_path, "bad.toml", "--out", "run", "--quiet")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "transport.wire_compression" in lines[0] and "zstd" in lines[0], done.stderr
    assert not (tmp_path / "run" / "run.db").exists()


@pytest.mark.parametrize("kind", ["inmemory", "torch"])
def test_only_the_grpc_transport_takes_it(kind):
    assert parse_config(config("none", kind)).transport.wire_compression == "none"
    with pytest.raises(ConfigError) as err:
        parse_config(config("gzip", kind))
    message = str(err.value)
    assert "\n" not in message and "transport.wire_compression" in message and f"'{kind}'" in message


def data_bytes(run_dir: Path) -> list[tuple]:
    """Every data message's record (both ends) with its byte counts, in an order independent of timing."""
    store = RunStore(run_dir / "run.db")
    try:
        assert store.check_agreement().ok
        rows = [(r["round"], r["method"], r["src"], r["dst"], r["role"], r["tensor_bytes"], r["payload_bytes"],
                 r["framed_bytes"]) for r in store.messages() if not r["method"].startswith(CONTROL)]
    finally:
        store.close()
    return sorted(rows)


@pytest.mark.parametrize("topology", ['kind = "star"', 'kind = "hierarchical"\nedges = 2'])
def test_a_compressed_run_equals_the_plain_one(tmp_path, topology):
    """The server, the edges and the client processes over gRPC sockets, with gzip and with none:
    the same final model bit for bit, and the same ledger bytes for every data message."""
    runs = {}
    for wire in ("none", "gzip"):
        (tmp_path / f"{wire}.toml").write_text(config(wire, topology=topology))
        done = fedhop_run(tmp_path, f"{wire}.toml", "--out", wire, "--quiet")
        assert done.returncode == 0, done.stdout + done.stderr
        runs[wire] = (load_file(str(tmp_path / wire / "model.safetensors")), data_bytes(tmp_path / wire))
    (plain_model, plain_bytes), (gzip_model, gzip_bytes) = runs["none"], runs["gzip"]
    assert plain_model.keys() == gzip_model.keys() == {"w"}
    assert plain_model["w"].shape == (D,) and np.any(plain_model["w"] != 0)   # the run moved the model
    for name in plain_model:
        assert plain_model[name].tobytes() == gzip_model[name].tobytes()
    uploads = [r for r in plain_bytes if r[1].endswith(".reply") and r[4] == "sender"]
    assert uploads and {r[5] for r in uploads if r[1] == "train.reply"} == {4 * D}   # float32 w
    assert plain_bytes == gzip_bytes


@pytest.fixture(scope="module")
def bench_rows() -> list[dict]:
    measure = runpy.run_path(str(ROOT / "benchmarks" / "wire_compression.py"), run_name="wire_compression")["measure"]
    return measure(numel=20_000, calls=2, sparsities=(0.01,), chunk_bytes=16384)   # streamed: 5 frames each way


def test_the_benchmark_sees_compression_on_the_socket(bench_rows):
    rows = {(r["tensor"], r["mode"]): r for r in bench_rows}
    assert set(rows) == {(t, m) for t in ("dense", "sparse 0.01") for m in ("none", "gzip", "deflate")}
    for tensor in ("dense", "sparse 0.01"):
        plain = rows[tensor, "none"]
        for direction in ("up", "down"):
            framed, wire = plain[f"framed_{direction}"], plain[f"socket_{direction}"]
            # uncompressed, the socket carries the framed bytes plus HTTP/2 frame and header bytes only
            assert framed >= 4 * 20_000 and framed <= wire <= framed + 400, (tensor, direction, framed, wire)
        for mode in ("gzip", "deflate"):
            row = rows[tensor, mode]
            assert (row["framed_up"], row["framed_down"]) == (plain["framed_up"], plain["framed_down"])
    for mode in ("gzip", "deflate"):   # 200 non-zeros of 20,000: far under the 80 kB of float32 on the socket
        sparse = rows["sparse 0.01", mode]
        assert sparse["socket_up"] < 0.1 * rows["sparse 0.01", "none"]["socket_up"]
        assert sparse["socket_down"] < 0.1 * rows["sparse 0.01", "none"]["socket_down"]
