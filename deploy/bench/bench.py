"""`fedhop bench transport`: figures for the transport and the framework's own overhead.

    fedhop bench transport [--sizes 1,10,100] [--repeats 5] [--rounds 20] [--tiny]
    fedhop bench compute | scale | growth [--tiny]      (deploy/bench/bench_system.py)
    fedhop bench large [--sizes 10,100] [--clients 2,4]  (deploy/bench/bench_large.py)
    fedhop bench flower [--rounds 20] [--flwr-python PY] (benchmarks/flower_compare.py)
    fedhop bench peers [--workloads W1,W2,W3] [--quick]  (deploy/bench/bench_peers.py)

Prints, for each model size, the throughput of sending it over fedhop's gRPC transport
(encode + stream + decode, two processes on loopback) beside a plain TCP socket moving the
same bytes in the same run, and the ratio; beside them grpcio alone moving pre-cut chunks in
the same call shape (`bench_grpc_bare`), the ceiling for any transport built on grpcio; the codec's encode and decode speed; and the wall
time of a FedAvg round with 10 clients and a tiny model over real processes.  Ratios measured
in one run are what count on a noisy machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhop.common.util.cliparser import ArgumentParser, figures_file_problem
from fedhop.deploy.bench import bench_system
from fedhop.deploy.launch.malloc import reexec_with_tuned_malloc

MB = 1_000_000


# ----------------------------------------------------------------------------- raw TCP
def _tcp_receiver(port_q: "mp.Queue", nbytes: int, repeats: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(repeats):
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
    conn.close()


def bench_tcp(nbytes: int, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_receiver, args=(q, nbytes, repeats + 1))
    p.start()
    port = q.get(timeout=60)
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32).data).cast("B")
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        s.sendall(data)
        s.recv(1)
        if i:  # first transfer warms up
            times.append(time.perf_counter() - t)
    s.close()
    p.join(10)
    return times


# ----------------------------------------------------------------------------- gRPC
def _grpc_receiver(addr_q: "mp.Queue", stop_q: "mp.Queue", max_message: int) -> None:
    from fedhop.common.transport.grpc import GrpcEndpoint
    from fedhop.common.util.procexit import freeze_heap
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload

    ep = GrpcEndpoint("client-0", Ledger(), max_message_bytes=max_message)
    address = ep.serve(lambda req: Payload(scalars={"n": len(req.payload.tensors)}), "127.0.0.1:0")
    freeze_heap()   # as fedhop's roles do once set up
    addr_q.put(address)
    stop_q.get()
    ep.stop()


def _cpu_seconds(pid: int | None) -> float:
    """User plus system CPU seconds of process `pid` so far, every thread (/proc/PID/stat)."""
    import psutil
    if pid is None:
        raise RuntimeError("the benchmark's receiver process has not started")
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class Transfer:
    """One way of moving `nbytes` to a receiver in another process, set up once (`start`) and
    timed call by call (`call`), so that several ways can take turns in one run (`paired`)."""

    name = ""
    receiver: "mp.process.BaseProcess | None" = None

    def __init__(self, nbytes: int, chunk: int) -> None:
        self.nbytes, self.chunk = nbytes, chunk
        self.max_message = max(64 << 20, chunk + (1 << 20))
        self._stop_q: "mp.Queue | None" = None

    def _spawn(self, target, *args) -> str:
        ctx = mp.get_context("spawn")
        addr_q, self._stop_q = ctx.Queue(), ctx.Queue()
        receiver = ctx.Process(target=target, args=(addr_q, self._stop_q, *args))
        receiver.start()
        self.receiver = receiver   # started: `stop` may join it (a failed start leaves None, and its own error)
        return addr_q.get(timeout=60)

    def start(self) -> None:
        raise NotImplementedError

    def call(self, i: int) -> float:
        """Call `i` (its round number); returns its wall seconds."""
        raise NotImplementedError

    def receiver_cpu(self) -> float:
        return _cpu_seconds(self.receiver.pid if self.receiver is not None else None)

    def stop(self) -> None:
        if self._stop_q is not None:
            self._stop_q.put(1)
        if self.receiver is not None:
            self.receiver.join(10)


class FedhopTransfer(Transfer):
    """fedhop's endpoint sending the model as a `train` call to a served endpoint: encode, stream,
    decode, ledger.  A model larger than one chunk is handed over, as a round's broadcast is
    (transport/fabric.py `_prepare`): each call cuts its frames as gRPC pulls them."""

    name = "fedhop"

    def start(self) -> None:
        from fedhop.common.transport.grpc import GrpcEndpoint
        from fedhop.common.wire.ledger import Ledger

        self.address = self._spawn(_grpc_receiver, self.max_message)
        self.ledger = Ledger()
        self.endpoint = GrpcEndpoint("server", self.ledger, chunk_bytes=self.chunk, max_message_bytes=self.max_message)
        self.w = torch.from_numpy(np.random.default_rng(0).standard_normal(self.nbytes // 4, dtype=np.float32))

    def call(self, i: int) -> float:
        from fedhop.common.wire.codec import hand_over
        from fedhop.common.wire.message import Payload

        model = Payload(tensors={"w": self.w})
        if self.nbytes > self.chunk:
            hand_over(model, keep_frames=False)
        t = time.perf_counter()
        self.endpoint.call(self.address, "client-0", "train", model, round=i,
                           timeout=max(120, self.nbytes / 20e6))   # encode + send + decode
        return time.perf_counter() - t

    def framed_bytes(self) -> int:
        """The last request's bytes on the wire, as the ledger recorded them."""
        return self.ledger.records()[-2].framed_bytes

    def stop(self) -> None:
        if getattr(self, "endpoint", None) is not None:   # None: `start` failed before it was made
            self.endpoint.stop()
        super().stop()


class BareTransfer(Transfer):
    """grpcio alone, as a ceiling for any transport built on it: the same call shape and options
    as fedhop's `Exchange` (bidirectional stream, identity serializers), received into a
    preallocated buffer; no codec, checksum or ledger.  The chunks are cut before timing, or with
    `cut_in_call` by each call as it sends them (`bytes`, as grpcio requires): the copy any
    sender of a fresh tensor makes."""

    def __init__(self, nbytes: int, chunk: int, cut_in_call: bool = False) -> None:
        super().__init__(nbytes, chunk)
        self.cut_in_call = cut_in_call
        self.name = "cut" if cut_in_call else "bare"

    def start(self) -> None:
        import grpc

        from fedhop.common.transport.grpc import grpc_options

        address = self._spawn(_bare_grpc_receiver, self.nbytes, self.max_message)
        self.channel = grpc.insecure_channel(address, options=grpc_options(self.max_message))
        self.upload = self.channel.stream_stream(BARE_UPLOAD, request_serializer=None, response_deserializer=None)
        self.view = memoryview(np.random.default_rng(0).standard_normal(self.nbytes // 4, dtype=np.float32).data).cast("B")
        self.chunks = [] if self.cut_in_call else [bytes(self.view[o:o + self.chunk]) for o in range(0, self.nbytes, self.chunk)]

    def call(self, i: int) -> float:
        view, chunk, nbytes = self.view, self.chunk, self.nbytes
        t = time.perf_counter()
        requests = (bytes(view[o:o + chunk]) for o in range(0, nbytes, chunk)) if self.cut_in_call else iter(self.chunks)
        (ack,) = list(self.upload(requests, timeout=max(120, nbytes / 20e6)))
        seconds = time.perf_counter() - t
        if int.from_bytes(ack, "little") != nbytes:
            raise RuntimeError(f"bare gRPC receiver got {int.from_bytes(ack, 'little')} of {nbytes} bytes")
        return seconds

    def stop(self) -> None:
        if getattr(self, "channel", None) is not None:   # None: `start` failed before it was made
            self.channel.close()
        super().stop()


def paired(transfers: list[Transfer], repeats: int) -> dict[str, dict]:
    """Each transfer's `repeats` timed calls, after one warm-up each, taking turns: repeat k
    starts with transfer k mod n, so a change in the machine's load falls on all of them alike.
    Returns, by name, the calls' seconds and the sender's and receiver's mean CPU seconds per call
    (`sender_cpu_s`, `receiver_cpu_s`)."""
    from fedhop.common.util.procexit import freeze_heap

    out: dict[str, dict] = {}
    try:
        for tr in transfers:
            tr.start()
            out[tr.name] = {"times": [], "sender_cpu_s": 0.0, "receiver_cpu_s": 0.0}
        freeze_heap()   # as fedhop's roles do once set up
        for tr in transfers:
            tr.call(0)   # warm-up
        for k in range(repeats):
            for j in range(len(transfers)):
                tr = transfers[(k + j) % len(transfers)]
                cpu0, peer0 = time.process_time(), tr.receiver_cpu()
                seconds = tr.call(k + 1)
                row = out[tr.name]
                row["times"].append(seconds)
                row["sender_cpu_s"] += (time.process_time() - cpu0) / repeats
                row["receiver_cpu_s"] += (tr.receiver_cpu() - peer0) / repeats
    finally:
        for tr in transfers:
            if tr.receiver is not None:
                tr.stop()
    return out


def bench_grpc(nbytes: int, repeats: int, chunk: int, cpu: dict | None = None) -> tuple[list[float], int]:
    """fedhop's endpoint alone (`FedhopTransfer`): `repeats` timed calls after one warm-up, and
    the request's framed bytes.  `cpu`, when given, gets the sender's and the receiver's CPU
    seconds per call (`sender_cpu_s`, `receiver_cpu_s`: means over the timed calls)."""
    transfer = FedhopTransfer(nbytes, chunk)
    row = paired([transfer], repeats)[transfer.name]
    if cpu is not None:
        cpu.update(sender_cpu_s=row["sender_cpu_s"], receiver_cpu_s=row["receiver_cpu_s"])
    return row["times"], transfer.framed_bytes()


# ----------------------------------------------------------------------------- bare grpcio
BARE_UPLOAD = "/bench.Bare/Upload"


def _bare_grpc_receiver(addr_q: "mp.Queue", stop_q: "mp.Queue", nbytes: int, max_message: int) -> None:
    from concurrent import futures

    import grpc

    from fedhop.common.transport.grpc import grpc_options

    buf = np.empty(nbytes, dtype=np.uint8)   # preallocated once, as the TCP receiver's

    def upload(chunks, context):
        filled = 0
        for chunk in chunks:
            buf[filled:filled + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            filled += len(chunk)
        yield filled.to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options(max_message, server=True))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Bare", {"Upload": grpc.stream_stream_rpc_method_handler(upload)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    addr_q.put(f"127.0.0.1:{port}")
    stop_q.get()
    server.stop(0)


def bench_grpc_bare(nbytes: int, repeats: int, chunk: int, cpu: dict | None = None,
                    cut_in_call: bool = False) -> list[float]:
    """grpcio alone (`BareTransfer`): `repeats` timed calls after one warm-up.  `cpu`: as
    `bench_grpc`'s."""
    transfer = BareTransfer(nbytes, chunk, cut_in_call)
    row = paired([transfer], repeats)[transfer.name]
    if cpu is not None:
        cpu.update(sender_cpu_s=row["sender_cpu_s"], receiver_cpu_s=row["receiver_cpu_s"])
    return row["times"]


# ----------------------------------------------------------------------------- codec
def bench_codec(nbytes: int, repeats: int, chunk: int) -> tuple[float, float]:
    from fedhop.common.wire import fedhop_pb2 as pb
    from fedhop.common.wire.codec import decode_frames, encode
    from fedhop.common.wire.message import Payload

    payload = Payload(tensors={"w": torch.randn(nbytes // 4)})
    enc_t, dec_t = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        frames = list(encode(payload, pb.Envelope(), chunk).frames)   # the snapshot, and every frame cut
        t1 = time.perf_counter()
        decode_frames(frames)
        t2 = time.perf_counter()
        if i:
            enc_t.append(t1 - t0)
            dec_t.append(t2 - t1)
    return nbytes / statistics.median(enc_t) / 1e9, nbytes / statistics.median(dec_t) / 1e9


# ----------------------------------------------------------------------------- a FedAvg round
ROUND_CONFIG = """
[run]
name = "bench-round"
rounds = {rounds}
eval_every = 0
[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 1
batch_size = 0
[data]
dataset = "quadratic"
dim = 10
[model]
init = "zeros"
[clients]
count = 10
per_round = 10
processes = {processes}
"""


def bench_round(rounds: int, processes: int) -> dict:
    from fedhop.common.records.runstore import RunStore
    from fedhop.deploy.launch.launcher import run_local

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "round.toml"
        cfg.write_text(ROUND_CONFIG.format(rounds=rounds, processes=processes))
        t = time.perf_counter()
        code = run_local(str(cfg), [], str(Path(tmp) / "run"), quiet=True, show_table=False)
        total = time.perf_counter() - t
        if code != 0:
            raise RuntimeError("the FedAvg round benchmark run failed")
        walls = [r["wall_seconds"] for r in RunStore(Path(tmp) / "run" / "run.db", create=False).rounds()]
    steady = walls[1:] if len(walls) > 1 else walls
    return {"rounds": rounds, "processes": processes, "round_ms_median": 1000 * statistics.median(steady),
            "round_ms_min": 1000 * min(steady), "run_seconds_total": total}


def transport(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"sizes_mb": sizes, "rows": []}
    print(f"{'size':>8} {'TCP MB/s':>10} {'gRPC MB/s':>10} {'ratio':>7} {'framed/payload':>15} "
          f"{'bare grpcio MB/s':>17} {'bare/TCP':>9} {'gRPC/bare':>10}")
    for size in sizes:
        nbytes = size * MB // 4 * 4
        tcp = statistics.median(bench_tcp(nbytes, args.repeats))
        grpc_times, framed = bench_grpc(nbytes, args.repeats, args.chunk)
        g = statistics.median(grpc_times)
        bare = statistics.median(bench_grpc_bare(nbytes, args.repeats, args.chunk))
        row = {"size_mb": size, "tcp_mb_s": nbytes / tcp / MB, "grpc_mb_s": nbytes / g / MB,
               "ratio": tcp / g, "framed_bytes": framed, "bare_grpc_mb_s": nbytes / bare / MB,
               "bare_ratio": tcp / bare, "grpc_over_bare": bare / g}
        out["rows"].append(row)
        print(f"{size:>6}MB {row['tcp_mb_s']:>10.0f} {row['grpc_mb_s']:>10.0f} {row['ratio']:>7.2f} "
              f"{framed / nbytes:>15.5f} {row['bare_grpc_mb_s']:>17.0f} {row['bare_ratio']:>9.2f} "
              f"{row['grpc_over_bare']:>10.2f}")
    enc, dec = bench_codec(max(sizes) * MB // 4 * 4, args.repeats, args.chunk)
    out["codec"] = {"encode_gb_s": enc, "decode_gb_s": dec, "size_mb": max(sizes)}
    print(f"codec ({max(sizes)} MB): encode {enc:.2f} GB/s, decode {dec:.2f} GB/s")
    rnd = bench_round(args.rounds, 2)
    out["fedavg_round"] = rnd
    print(f"FedAvg round, 10 clients, tiny model, 2 client processes: median {rnd['round_ms_median']:.1f} ms "
          f"(min {rnd['round_ms_min']:.1f} ms) over {args.rounds - 1} steady rounds")
    return out


#: every `fedhop bench` subcommand, as its help lists them
BENCHMARKS = {"transport": "gRPC (or gloo) throughput against TCP, codec speed, FedAvg round time",
              "compute": "FedAvg rounds against one process doing the same SGD steps",
              "scale": "cross-device: registration, round time and memory with 100,000 logical clients",
              "growth": "round time as model size and client count grow",
              "gpu": "one client's local epoch on a GPU in a fedhop client process against plain torch",
              "large": "one FedAvg round of a 100 MB-1 GB model: memory, CPU per GB, against bare grpcio "
                       "(its own flags: fedhop bench large --help)",
              "flower": "framework overhead against Flower (its own flags: fedhop bench flower --help)",
              "peers": "issue 49's workloads in fedhop's two engines, the round engine's loop, Flower's simulation "
                       "and pfl, with the ratios (its own flags: fedhop bench peers --help)"}


def _flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of `fedhop bench` (one line), before anything is measured."""
    sizes = [s.strip() for s in str(args.sizes).split(",")]
    try:
        if any(int(s) < 1 for s in sizes):
            return f"--sizes {args.sizes}: every size must be at least 1 MB"
    except ValueError:
        return f"--sizes {args.sizes}: whole MB, comma-separated (e.g. 1,10,100)"
    if args.chunk < 1:
        return f"--chunk {args.chunk}: at least 1 byte"
    if args.repeats < 1 or args.rounds < 1:
        return "--repeats and --rounds must be at least 1"
    for flag, value in (("--clients", args.clients), ("--processes", args.processes)):
        if value < 1:   # checked with --tiny too, which measures its own sizes
            return f"{flag} {value}: at least 1"
    return figures_file_problem(args.json)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "large":   # a large model's round and transfer: deploy/bench/bench_large.py (its own flags)
        from fedhop.deploy.bench.bench_large import main as large_main
        if "--default-malloc" not in argv:
            reexec_with_tuned_malloc()
        return large_main([a for a in argv[1:] if a != "--default-malloc"])
    if argv and argv[0] == "peers":   # the workloads against other frameworks: deploy/bench/bench_peers.py
        from fedhop.deploy.bench.bench_peers import main as peers_main
        return peers_main(argv[1:])
    if argv and argv[0] == "flower":   # framework overhead against Flower: benchmarks/flower_compare.py
        import runpy
        script = Path(__file__).resolve().parents[2] / "benchmarks" / "flower_compare.py"
        return runpy.run_path(str(script), run_name="fedhop_bench_flower")["main"](argv[1:])
    ap = ArgumentParser(prog="fedhop bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=BENCHMARKS, help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    ap.add_argument("--sizes", default="1,10,100", help="model sizes in MB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4 << 20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke version (for tests)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--kind", choices=["grpc", "torch"], default="grpc",
                    help="transport: grpc = raw throughput vs TCP; torch = FedAvg rounds over gRPC and gloo side by side")
    bench_system.add_arguments(ap)
    ap.add_argument("--default-malloc", action="store_true",
                    help="measure with glibc's default malloc settings (deploy/launch/malloc.py explains the tuning)")
    args = ap.parse_args(argv)
    problem = _flags_problem(args)
    if problem:
        ap.error(problem)
    if not args.default_malloc and not args.tiny:
        reexec_with_tuned_malloc()  # the figures are for the settings fedhop's processes run with
    if args.what != "transport":
        from fedhop.deploy.bench.bench_gpu import bench_gpu
        runner = {"compute": bench_system.bench_compute, "scale": bench_system.bench_scale,
                  "growth": bench_system.bench_growth, "gpu": bench_gpu}[args.what]
        if args.what == "compute" and args.rounds == 20 and not args.tiny:
            args.rounds = 10
        figures = runner(args)
    elif args.kind == "torch":
        figures = bench_system.bench_kinds(args)
    else:
        if args.tiny:
            args.sizes, args.repeats, args.rounds = "1", 1, 3
        figures = transport(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
