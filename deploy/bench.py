"""`fedhop bench transport`: figures for the transport and the framework's own overhead.

    fedhop bench transport [--sizes 1,10,100] [--repeats 5] [--rounds 20] [--tiny]
    fedhop bench compute | scale | growth [--tiny]      (deploy/bench_system.py)
    fedhop bench large [--sizes 10,100] [--clients 2,4]  (deploy/bench_large.py)
    fedhop bench flower [--rounds 20] [--flwr-python PY] (benchmarks/flower_compare.py)

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

from fedhop.deploy import bench_system
from fedhop.deploy.malloc import reexec_with_tuned_malloc

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


def bench_grpc(nbytes: int, repeats: int, chunk: int, cpu: dict | None = None) -> tuple[list[float], int]:
    """fedhop's endpoint sending `nbytes` to a served endpoint in another process, `repeats`
    timed calls after one warm-up.  `cpu`, when given, gets the sender's and the receiver's
    CPU seconds per call (`sender_cpu_s`, `receiver_cpu_s`: means over the timed calls).
    A model larger than one chunk is handed over, as a round's broadcast is (transport/fabric.py
    `_prepare`): each call cuts its frames as gRPC pulls them, with no snapshot first."""
    from fedhop.common.transport.grpc import GrpcEndpoint
    from fedhop.common.util.procexit import freeze_heap
    from fedhop.common.wire.codec import hand_over
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload

    ctx = mp.get_context("spawn")
    addr_q, stop_q = ctx.Queue(), ctx.Queue()
    max_message = max(64 << 20, chunk + (1 << 20))
    p = ctx.Process(target=_grpc_receiver, args=(addr_q, stop_q, max_message))
    p.start()
    address = addr_q.get(timeout=60)
    ledger = Ledger()
    ep = GrpcEndpoint("server", ledger, chunk_bytes=chunk, max_message_bytes=max_message)
    w = torch.from_numpy(np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32))
    freeze_heap()   # as fedhop's roles do once set up
    times = []
    for i in range(repeats + 1):
        if i == 1:   # after the warm-up call
            cpu0, peer0 = time.process_time(), _cpu_seconds(p.pid)
        model = Payload(tensors={"w": w})
        if nbytes > chunk:
            hand_over(model, keep_frames=False)
        t = time.perf_counter()
        ep.call(address, "client-0", "train", model, round=i, timeout=max(120, nbytes / 20e6))  # encode + send + decode
        if i:
            times.append(time.perf_counter() - t)
    if cpu is not None:
        cpu["sender_cpu_s"] = (time.process_time() - cpu0) / repeats
        cpu["receiver_cpu_s"] = (_cpu_seconds(p.pid) - peer0) / repeats
    framed = ledger.records()[-2].framed_bytes
    ep.stop()
    stop_q.put(1)
    p.join(10)
    return times, framed


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
    """grpcio alone, as a ceiling for any transport built on it: the same call shape and options
    as fedhop's `Exchange` (bidirectional stream, identity serializers), the bytes cut into
    chunks before timing, received into a preallocated buffer; no codec, checksum or ledger.
    `cpu`: as `bench_grpc`'s.  `cut_in_call`: each call cuts its chunks (`bytes`, as grpcio
    requires) from the array as it sends them: the copy any sender of a fresh tensor makes."""
    import grpc

    from fedhop.common.transport.grpc import grpc_options

    ctx = mp.get_context("spawn")
    addr_q, stop_q = ctx.Queue(), ctx.Queue()
    max_message = max(64 << 20, chunk + (1 << 20))
    p = ctx.Process(target=_bare_grpc_receiver, args=(addr_q, stop_q, nbytes, max_message))
    p.start()
    channel = grpc.insecure_channel(addr_q.get(timeout=60), options=grpc_options(max_message))
    upload = channel.stream_stream(BARE_UPLOAD, request_serializer=None, response_deserializer=None)
    view = memoryview(np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32).data).cast("B")
    chunks = [bytes(view[o:o + chunk]) for o in range(0, nbytes, chunk)]
    times = []
    for i in range(repeats + 1):
        if i == 1:   # after the warm-up call
            cpu0, peer0 = time.process_time(), _cpu_seconds(p.pid)
        t = time.perf_counter()
        requests = (bytes(view[o:o + chunk]) for o in range(0, nbytes, chunk)) if cut_in_call else iter(chunks)
        (ack,) = list(upload(requests, timeout=max(120, nbytes / 20e6)))
        if i:
            times.append(time.perf_counter() - t)
    if cpu is not None:
        cpu["sender_cpu_s"] = (time.process_time() - cpu0) / repeats
        cpu["receiver_cpu_s"] = (_cpu_seconds(p.pid) - peer0) / repeats
    if int.from_bytes(ack, "little") != nbytes:
        raise RuntimeError(f"bare gRPC receiver got {int.from_bytes(ack, 'little')} of {nbytes} bytes")
    channel.close()
    stop_q.put(1)
    p.join(10)
    return times


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
    from fedhop.deploy.launcher import run_local

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
              "flower": "framework overhead against Flower (its own flags: fedhop bench flower --help)"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "large":   # a large model's round and transfer: deploy/bench_large.py (its own flags)
        from fedhop.deploy.bench_large import main as large_main
        if "--default-malloc" not in argv:
            reexec_with_tuned_malloc()
        return large_main([a for a in argv[1:] if a != "--default-malloc"])
    if argv and argv[0] == "flower":   # framework overhead against Flower: benchmarks/flower_compare.py
        import runpy
        script = Path(__file__).resolve().parents[1] / "benchmarks" / "flower_compare.py"
        return runpy.run_path(str(script), run_name="fedhop_bench_flower")["main"](argv[1:])
    ap = argparse.ArgumentParser(prog="fedhop bench", description=__doc__,
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
                    help="measure with glibc's default malloc settings (deploy/malloc.py explains the tuning)")
    args = ap.parse_args(argv)
    if not args.default_malloc and not args.tiny:
        reexec_with_tuned_malloc()  # the figures are for the settings fedhop's processes run with
    if args.what != "transport":
        from fedhop.deploy.bench_gpu import bench_gpu
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
