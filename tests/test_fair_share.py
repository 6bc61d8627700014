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

from fedhop.common.transport.admission import CONTROL_PER_PEER, RESERVED_WORKERS, CallSlots, LogThrottle
from tests import attacks


def test_call_slots_reserve_threads_and_share_per_caller():
    workers = 32
    slots = CallSlots(workers)
    capacity = workers - RESERVED_WORKERS
    per_peer = capacity // 4
    taken = sum(slots.acquire("client-procH") is None for _ in range(40))
    assert taken == per_peer and slots.refused == 40 - per_peer
    # other callers fill the rest of the data slots, never the reserved ones
    others = sum(slots.acquire(f"client-proc{i}") is None for i in range(100) for _ in range(per_peer))
    assert taken + others == capacity and slots.held("data") == capacity
    # heartbeats and registrations still find their slots: per caller, not from the data share
    assert all(slots.acquire("client-proc0", "control") is None for _ in range(CONTROL_PER_PEER))
    assert slots.acquire("client-proc0", "control") is not None
    # the parent is served whatever the others hold; an unidentified caller (no credentials) too
    slots.privileged = lambda node: node == "server"
    assert all(slots.acquire("server") is None for _ in range(workers))
    assert slots.acquire("") is None
    assert slots.acquire("client-procH") is not None   # what the parent holds counts against the others
    for _ in range(workers):
        slots.release("server")
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
    workers = 32
    share = (workers - RESERVED_WORKERS) // 4
    assert row["figures"]["streams_refused"] == attacks.SLOW_STREAMS - share


def test_wrong_token_flood_leaves_few_log_lines_and_events(tmp_path):
    """2,000 wrong-token registrations: a bounded number of log lines and auth_refused events, each
    event carrying the count it folds (there was one log line per refusal)."""
    row = attacks.run_attack(tmp_path, "wrong_token_x2000")
    assert attacks.ok(row), row
    assert row["figures"]["refusal_log_lines"] <= attacks.MAX_REFUSAL_LINES
    assert row["events_total"] < 50


def test_insider_streams_leave_the_parent_its_calls(tmp_path):
    """A client process's gRPC server (16 workers, token authentication, real sockets): an insider
    holding 16 streams open gets its share of the call slots and no more; the parent's 12 calls at
    once all answer (on 16 plain worker threads the insider held them all and the parent's
    calls waited until their deadline)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from fedhop.common.algorithms.base import Payload
    from fedhop.common.security.auth import NodeCredentials
    from fedhop.common.transport.grpc import EXCHANGE, GrpcEndpoint
    from fedhop.common.wire.ledger import Ledger

    secret = b"fair-share-test-secret"
    workers = 16
    served = GrpcEndpoint("client-proc0", Ledger(), workers=workers,
                          credentials=NodeCredentials("client-proc0", secret))
    served.call_slots.privileged = lambda node: node == "server"
    address = served.serve(lambda request: Payload(scalars={"ok": 1}), "127.0.0.1:0")
    channel = grpc.insecure_channel(address)
    release = threading.Event()

    def idle():
        release.wait()
        yield from ()
    stub = channel.stream_stream(EXCHANGE, request_serializer=None, response_deserializer=None)
    insider = [stub(idle(), timeout=60, metadata=NodeCredentials("client-procH", secret).metadata())
               for _ in range(workers)]
    parent = GrpcEndpoint("server", Ledger(), credentials=NodeCredentials("server", secret))
    try:
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: parent.call(address, f"client-{i}", "ping", Payload(), round=1,
                                                          timeout=20.0), range(12)))
        assert [r.scalars["ok"] for r in replies] == [1] * 12
        share = (workers - 4) // 4
        refused = 0
        for call in insider:
            if call.done():
                try:
                    list(call)
                except grpc.RpcError as exc:
                    refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused == workers - share and served.call_slots.held("data") == share
    finally:
        release.set()
        channel.close()
        parent.stop(0.1)
        served.stop(0.1)
