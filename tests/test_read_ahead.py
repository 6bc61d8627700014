"""What a peer can put into a process on a stream the process does not read (common/transport/grpc.py,
"Pulled replies"; `transport.window_bytes`): a callee that sends its whole reply without waiting for
the caller's go fills only the stream's fixed HTTP/2 window in the caller.  Real processes on
loopback: the caller's channel and the callee's server use fedhop's `grpc_options`; the callee
pushes 200 MB on each of four streams whose first message alone the caller reads.  With gRPC's
adaptive window (BDP probing, 64 MiB of read-ahead) the caller held 60-190 MiB per stream; the bound
asserted is twice the window."""
from __future__ import annotations

import multiprocessing as mp
import re
import time

import grpc

from fedhop.common.transport.grpc import WINDOW_BYTES, grpc_options

MESSAGE = 4 << 20
MESSAGES = 50          # 200 MB a stream, far more than any window
STREAMS = 4


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) << 10


def _pushing_callee(port_q: "mp.Queue", stop_q: "mp.Queue") -> None:
    from concurrent import futures

    chunk = b"x" * MESSAGE

    def push(requests, context):   # ignores the request stream: no go is awaited
        for _ in range(MESSAGES):
            yield chunk

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=STREAMS + 2),
                         options=grpc_options(64 << 20, server=True))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Push", {"Push": grpc.stream_stream_rpc_method_handler(push)}),))
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop_q.get()
    server.stop(0)


def _settled(timeout: float = 30.0) -> int:
    """The process's RSS once it stopped growing (unchanged within 1 MiB over five polls)."""
    last, still, deadline = _rss(), 0, time.monotonic() + timeout
    while still < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _rss()
        still = still + 1 if abs(now - last) < (1 << 20) else 0
        last = now
    return last


def test_a_stream_left_unread_holds_only_its_window():
    ctx = mp.get_context("spawn")
    port_q, stop_q = ctx.Queue(), ctx.Queue()
    callee = ctx.Process(target=_pushing_callee, args=(port_q, stop_q))
    callee.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port_q.get(timeout=120)}", options=grpc_options(64 << 20))
    push = channel.stream_stream("/t.Push/Push", request_serializer=None, response_deserializer=None)
    try:
        assert sum(len(m) for m in push(iter([b"go"]), timeout=120)) == MESSAGES * MESSAGE   # a whole stream, read
        before = _settled()
        calls = []
        for _ in range(STREAMS):
            call = push(iter([b"header"]), timeout=120)
            assert len(next(call)) == MESSAGE   # the first message read, the rest left to flow control
            calls.append(call)
        grown = _settled() - before
        assert grown < STREAMS * 2 * WINDOW_BYTES, f"{grown >> 20} MiB buffered for {STREAMS} unread streams"
        for call in calls:
            call.cancel()
    finally:
        channel.close()
        stop_q.put(1)
        callee.join(30)
