"""Fair resources: per-caller call slots with worker threads reserved for heartbeats and
registrations (common/transport/admission.py `CallSlots`, common/transport/grpc.py `SlotInterceptor`),
and floods of refusals that leave a bounded number of log lines and run.db events
(`LogThrottle`, `EventThrottle`).

Process tests are rows of the attack suite (tests/attacks.py): a real server and client
processes and an insider holding slow streams open, or 2,000 wrong-token registrations.
"""
from __future__ import annotations

import logging
import re

from fedhop.common.transport.admission import (
    CONTROL_PER_PEER,
    QUICK_PER_PEER,
    CallSlots,
    LogThrottle,
    lane_sizes,
)
from tests import attacks


def test_call_slots_keep_lanes_and_share_per_caller():
    workers = 32
    slots = CallSlots(workers)
    lanes = lane_sizes(workers)
    capacity = slots.capacity
    assert capacity == lanes["data"] == workers - lanes["control"] - lanes["quick"]
    per_peer = capacity // 4
    taken = sum(slots.acquire("client-procH") is None for _ in range(40))
    assert taken == per_peer and slots.refused == 40 - per_peer
    # other callers fill the rest of the data slots, never the other lanes'
    others = sum(slots.acquire(f"client-proc{i}") is None for i in range(100) for _ in range(per_peer))
    assert taken + others == capacity and slots.held("data") == capacity
    # registrations: CONTROL_PER_PEER per caller and the lane's size in all (8 ids x 4 slow Registers)
    registers = [slots.acquire(f"client-procR{i}", "control") is None for i in range(8) for _ in range(4)]
    assert sum(registers) == lanes["control"] and registers[:CONTROL_PER_PEER + 1] == [True] * CONTROL_PER_PEER + [False]
    # heartbeats still find their lane, a victim's too, whatever registrations under its id hold
    assert all(slots.acquire("client-procR0", "quick") is None for _ in range(QUICK_PER_PEER))
    assert slots.acquire("client-procR0", "quick") is not None
    # the parent is served whatever the others hold, where it proves its registration key; a
    # caller claiming its node id without the proof is any caller
    slots.privileged = lambda node: node == "server"
    assert slots.acquire("server") is not None
    assert all(slots.acquire("server", parent=True) is None for _ in range(workers))
    assert slots.acquire("") is None   # an unidentified caller (no credentials): not limited per caller
    assert slots.acquire("client-procH") is not None   # what the parent holds counts against the others
    for _ in range(workers):
        slots.release("server", parent=True)
    slots.release("")
    assert slots.acquire("client-procH") is not None   # still its whole share
    slots.release("client-procH")
    assert slots.acquire("client-procH") is None and slots.held("data") == capacity


def test_log_throttle_folds_a_flood_into_one_line_per_window():
    now = [0.0]
    throttle = LogThrottle(interval=10.0, clock=lambda: now[0])
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("fedhop.test_fair_share")
    log.propagate = False
    log.addHandler(Keep())
    log.addFilter(throttle)
    try:
        for i in range(2000):   # 2,000 refusals over 25 s: windows start at 0, 10 and 20 s
            now[0] = i * 25.0 / 2000
            log.warning("refused %s from %s", "Register", f"peer{i}")
        log.error("an error always passes")
    finally:
        log.removeFilter(throttle)
    assert len(records) == 4 and records[-1] == "an error always passes"
    folded = [int(n) for r in records for n in re.findall(r"\(\+(\d+) more like this", r)]
    assert len(folded) == 2 and 3 + sum(folded) <= 2000   # the last window's are held until its next line


def test_slow_streams_do_not_starve_heartbeats(tmp_path):
    """40 streams held open by one insider: the run completes, no node is marked dead, and all
    but the insider's share of the call slots are refused at once (on 32 plain worker threads the
    heartbeats went unanswered and every client process was marked dead)."""
    row = attacks.run_attack(tmp_path, "slow_streams_x40")
    assert attacks.ok(row), row
    share = CallSlots(32).per_peer   # the server's 32 workers
    assert row["figures"]["streams_refused"] == attacks.SLOW_STREAMS - share


def test_wrong_token_flood_leaves_few_log_lines_and_events(tmp_path):
    """2,000 wrong-token registrations: a bounded number of log lines and auth_refused events, each
    event carrying the count it folds (there was one log line per refusal)."""
    row = attacks.run_attack(tmp_path, "wrong_token_x2000")
    assert attacks.ok(row), row
    assert row["figures"]["refusal_log_lines"] <= attacks.MAX_REFUSAL_LINES
    assert row["events_total"] < 50


def test_insider_streams_leave_the_parent_its_calls(tmp_path):
    """A client process's gRPC server (16 workers, shared-token authentication, real sockets): an
    insider holding 48 streams open under the parent's node id (any holder of the run token can
    mint it) gets one caller's share of the call slots and no more, as it cannot prove the key of
    the child's registration; the parent's 12 calls at once, which carry that proof, all answer
    (when a claimed `server` was exempt, its 48 streams held every worker thread and the parent's
    calls waited until their deadline)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from fedhop.common.algorithms.base import Payload
    from fedhop.common.security.auth import NodeCredentials
    from fedhop.common.transport.grpc import EXCHANGE, GrpcEndpoint
    from fedhop.common.wire import fedhop_pb2 as pb
    from fedhop.common.wire.ledger import Ledger

    secret = b"fair-share-test-secret"
    workers, streams = 16, 48
    served = GrpcEndpoint("client-proc0", Ledger(), workers=workers,
                          credentials=NodeCredentials("client-proc0", secret))
    served.call_slots.privileged = lambda node: node == "server"
    address = served.serve(lambda request: Payload(scalars={"ok": 1}), "127.0.0.1:0")
    parent = GrpcEndpoint("server", Ledger(), credentials=NodeCredentials("server", secret))
    parent_address = parent.serve(lambda request: None, "127.0.0.1:0", register_handler=lambda request: pb.RegisterReply(
        accepted=True, run_id="r", node_id="server"))
    assert served.register(parent_address, pb.RegisterRequest(node_id="client-proc0", role="client",
                                                              address=address), 10.0).accepted
    channel = grpc.insecure_channel(address)
    release = threading.Event()

    def idle():
        release.wait()
        yield from ()
    stub = channel.stream_stream(EXCHANGE, request_serializer=None, response_deserializer=None)
    insider = [stub(idle(), timeout=60, metadata=NodeCredentials("server", secret).metadata())
               for _ in range(streams)]
    ended, ended_calls = threading.Condition(), []

    def on_end(call) -> None:
        with ended:
            ended_calls.append(call)
            ended.notify_all()
    for call in insider:
        call.add_done_callback(on_end)
    try:
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: parent.call(address, f"client-{i}", "ping", Payload(), round=1,
                                                          timeout=20.0), range(12)))
        assert [r.scalars["ok"] for r in replies] == [1] * 12
        share = served.call_slots.per_peer
        # The server refuses the insider's streams as its workers reach them, which on a loaded
        # machine can be after the parent's calls have answered: wait for the refusals, not a time.
        with ended:
            ended.wait_for(lambda: len(ended_calls) >= streams - share, timeout=30.0)
            done = list(ended_calls)
        refused = 0
        for call in done:
            try:
                list(call)
            except grpc.RpcError as exc:
                refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused == streams - share and served.call_slots.held("data") == share
    finally:
        release.set()
        channel.close()
        parent.stop(0.1)
        served.stop(0.1)
