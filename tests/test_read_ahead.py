"""What a peer can put into a process on a stream the process does not read (common/transport/grpc.py,
"Pulled replies"; `transport.window_bytes`): a callee that sends its whole reply without waiting for
the caller's go fills only the stream's fixed HTTP/2 window in the caller.  Real processes on
loopback: the caller's channel and the callee's server use fedhop's `grpc_options`; the callee
pushes 200 MB on each of four streams whose first message alone the caller reads, and counts the
messages gRPC took from it until flow control stopped it.  Fixed 16 MiB windows: 20-22 messages and
54-92 MiB of the caller's memory in three runs; with gRPC's adaptive window (64 MiB of read-ahead,
BDP probing) 21-72 messages and 80-541 MiB, so the bounds asserted (10 messages and 48 MiB a stream)
catch the adaptive window in about half the runs: how far it grows depends on the timing."""
from __future__ import annotations

import multiprocessing as mp
import queue
import re

import grpc

from fedhop.common.transport.grpc import WINDOW_BYTES, grpc_options

MESSAGE = 4 << 20
MESSAGES = 50          # 200 MB a stream, far more than any window
STREAMS = 4


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) << 10


def _pushing_callee(port_q: "mp.Queue", stop_q: "mp.Queue", pushed: "mp.Queue") -> None:
    from concurrent import futures

    chunk = b"x" * MESSAGE

    def push(requests, context):   # ignores the request stream: no go is awaited
        for _ in range(MESSAGES):
            yield chunk
            pushed.put(1)   # gRPC took the message: the caller's window had room for it

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=STREAMS + 2),
                         options=grpc_options(64 << 20, server=True))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Push", {"Push": grpc.stream_stream_rpc_method_handler(push)}),))
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop_q.get()
    server.stop(0)


def _until_blocked(pushed: "mp.Queue", quiet: float = 3.0) -> int:
    """Messages the callee pushes until flow control stops it: none for `quiet` seconds (a
    generous bound; each message takes milliseconds while the window has room)."""
    n = 0
    while True:
        try:
            pushed.get(timeout=quiet)
        except queue.Empty:
            return n
        n += 1


def test_a_stream_left_unread_holds_only_its_window():
    ctx = mp.get_context("spawn")
    port_q, stop_q, pushed = ctx.Queue(), ctx.Queue(), ctx.Queue()
    callee = ctx.Process(target=_pushing_callee, args=(port_q, stop_q, pushed))
    callee.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port_q.get(timeout=120)}", options=grpc_options(64 << 20))
    push = channel.stream_stream("/t.Push/Push", request_serializer=None, response_deserializer=None)
    try:
        assert sum(len(m) for m in push(iter([b"go"]), timeout=120)) == MESSAGES * MESSAGE   # a whole stream, read
        for _ in range(MESSAGES):
            pushed.get(timeout=120)   # that stream's pushes, counted
        before = _rss()
        calls = []
        for _ in range(STREAMS):
            call = push(iter([b"header"]), timeout=120)
            assert len(next(call)) == MESSAGE   # the first message read, the rest left to flow control
            calls.append(call)
        sent = _until_blocked(pushed)
        grown = _rss() - before
        # each stream stops at its window in the caller and about a window in the callee's own buffers
        assert STREAMS <= sent <= STREAMS * (2 * WINDOW_BYTES // MESSAGE + 2), f"{sent} messages pushed"
        # the caller: a window per stream in gRPC's buffers, the message read and malloc's slack
        assert grown < STREAMS * 3 * WINDOW_BYTES, f"{grown >> 20} MiB buffered for {STREAMS} unread streams"
        for call in calls:
            call.cancel()
    finally:
        channel.close()
        stop_q.put(1)
        callee.join(30)
