"""What gRPC's channel compression (`transport.wire_compression`) saves on the socket.

    python benchmarks/wire_compression.py [--numel 1000000] [--calls 5] [--sparsity 0.01 0.1] [--json OUT]

The ledger counts the framed bytes fedhop hands to gRPC, before gRPC compresses them
(common/transport/grpc.py, Wire compression), so it cannot show what compression saves.  This
benchmark measures it on a socket: a served `GrpcEndpoint` echoes each `train` request's tensor
back as its reply, and the calling `GrpcEndpoint` reaches it through a loopback TCP relay (in this
process) that counts every byte it forwards, each way.  Those are the bytes gRPC put on the TCP
connection: gRPC's message prefixes, HTTP/2 frame headers, HPACK headers and trailers, and the
messages compressed or not; not the TCP/IP headers below them (`fedhop netsim` counts the
interface's packets instead, for whole runs).  The relay's counters are zeroed after a warm-up
call, so the connection's set-up is not in them; HTTP/2 control frames sent after a call
(WINDOW_UPDATE, 13 bytes) land in the next interval, so the figures hold to a few dozen bytes.

Tensors (float32, `--numel` elements, seeded): dense (standard normal: what a model or a dense
update is) and sparse (a fraction `--sparsity` of the entries standard normal, the rest exact
zeros: a top-k update densified).  For each tensor and each of none / gzip / deflate, both
endpoints use that setting, `--calls` calls are made, and the table gives per call: the ledger's
framed bytes of the request and the reply, the relay's bytes each way, their ratio, and the wall
milliseconds of a call (the request and its reply, both compressed and decompressed; the relay's
copies are in every variant alike).  Each reply is checked equal to its request bit for bit
(compression is lossless).
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

MODES = ("none", "gzip", "deflate")


class CountingRelay:
    """A loopback TCP relay to `target` (host:port) that counts the bytes it forwards: `up` from
    the connecting side to the target, `down` back.  A byte is counted before it is forwarded,
    so once a call's reply has reached the caller every byte of the call is counted."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.counts = {"up": 0, "down": 0}
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:   # closed
                return
            peer = socket.create_connection(self.target)
            for s in (conn, peer):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [conn, peer]
            threading.Thread(target=self._pump, args=(conn, peer, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(peer, conn, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                break
            with self._lock:
                self.counts[direction] += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def take(self) -> dict[str, int]:
        """The bytes forwarded each way since the last `take`."""
        with self._lock:
            out = dict(self.counts)
            self.counts = {"up": 0, "down": 0}
        return out

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


def tensors(numel: int, sparsities: list[float], seed: int = 0) -> dict[str, torch.Tensor]:
    """The measured tensors, float32: dense normal, and one per sparsity (that fraction of the
    entries normal at seeded random places, the rest zeros)."""
    rng = np.random.default_rng(seed)
    out = {"dense": torch.from_numpy(rng.standard_normal(numel, dtype=np.float32))}
    for fraction in sparsities:
        v = np.zeros(numel, dtype=np.float32)
        kept = rng.choice(numel, size=max(1, round(fraction * numel)), replace=False)
        v[kept] = rng.standard_normal(kept.size, dtype=np.float32)
        out[f"sparse {fraction:g}"] = torch.from_numpy(v)
    return out


def measure(numel: int = 1_000_000, calls: int = 5, sparsities: tuple[float, ...] = (0.01, 0.1),
            chunk_bytes: int = 0) -> list[dict]:
    """One row per (tensor, mode): the per-call ledger framed bytes and relay socket bytes of
    each direction, and the milliseconds per call (module docstring).  `chunk_bytes`: the
    endpoints' frame size; 0: one frame, so each request is one bundled `Call`; smaller than the
    tensor: requests stream as `Exchange` calls in frames of that size."""
    from fedhop.common.transport.grpc import GrpcEndpoint
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload

    chunk = chunk_bytes or max(4 << 20, 4 * numel + 4096)
    max_message = chunk + (2 << 20)
    served = GrpcEndpoint("client-proc0", Ledger(), chunk_bytes=chunk, max_message_bytes=max_message)
    address = served.serve(lambda request: Payload(tensors=dict(request.payload.tensors)), "127.0.0.1:0")
    relay = CountingRelay(address)
    ledger = Ledger()
    caller = GrpcEndpoint("server", ledger, chunk_bytes=chunk, max_message_bytes=max_message)
    rows = []
    try:
        rnd = 0
        for name, tensor in tensors(numel, list(sparsities)).items():
            for mode in MODES:
                served.wire_compression = caller.wire_compression = mode

                def call() -> float:
                    nonlocal rnd
                    rnd += 1
                    started = time.perf_counter()
                    reply = caller.call(relay.address, "client-0", "train", Payload(tensors={"w": tensor}),
                                        round=rnd, timeout=120)
                    seconds = time.perf_counter() - started
                    if not torch.equal(reply.tensors["w"], tensor):
                        raise AssertionError(f"{name}, {mode}: the echoed tensor differs from the one sent")
                    return seconds

                call()                        # warm-up: the connection, and this mode's first call
                relay.take()
                first = len(ledger.records())
                seconds = sum(call() for _ in range(calls))
                wire = relay.take()
                records = ledger.records()[first:]
                framed_up = sum(r.framed_bytes for r in records if r.role == "sender")
                framed_down = sum(r.framed_bytes for r in records if r.role == "receiver")
                rows.append({"tensor": name, "mode": mode, "numel": numel, "calls": calls,
                             "framed_up": framed_up / calls, "framed_down": framed_down / calls,
                             "socket_up": wire["up"] / calls, "socket_down": wire["down"] / calls,
                             "ms_per_call": 1e3 * seconds / calls})
    finally:
        caller.stop()
        served.stop()
        relay.close()
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table (bytes per call, each direction)."""
    lines = ["| tensor | wire_compression | framed bytes up / down (ledger) | socket bytes up / down | "
             "socket / framed | ms per call |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (r["socket_up"] + r["socket_down"]) / (r["framed_up"] + r["framed_down"])
        lines.append(f"| {r['tensor']} | {r['mode']} | {r['framed_up']:,.0f} / {r['framed_down']:,.0f} | "
                     f"{r['socket_up']:,.0f} / {r['socket_down']:,.0f} | {ratio:.3f} | {r['ms_per_call']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1_000_000, help="float32 elements per tensor (at least 1)")
    ap.add_argument("--calls", type=int, default=5, help="measured calls per tensor and mode (at least 1)")
    ap.add_argument("--sparsity", type=float, nargs="*", default=[0.01, 0.1],
                    help="fractions of non-zero entries of the sparse tensors (each in (0, 1])")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="frame size (transport.chunk_bytes); 0: a message in one frame (at least 1024 otherwise)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.numel < 1 or args.calls < 1 or not all(0 < f <= 1 for f in args.sparsity) \
            or 0 < args.chunk_bytes < 1024 or args.chunk_bytes < 0:
        ap.error("--numel and --calls must be at least 1, each --sparsity in (0, 1], --chunk-bytes 0 or at least 1024")
    torch.set_num_threads(1)
    rows = measure(args.numel, args.calls, tuple(args.sparsity), args.chunk_bytes)
    frames = f"frames of {args.chunk_bytes:,} bytes" if args.chunk_bytes else "one frame a message"
    print(f"float32 tensors of {args.numel:,} elements, echoed ({frames}); bytes per call, each direction")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
