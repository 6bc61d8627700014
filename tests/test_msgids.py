"""Message ids (common/wire/msgids.py): 32 hex digits, the length of the UUID4 hex they replace
(a message's bytes depend on it), unique across threads, and unique in a forked child, which
inherits its parent's counter and prefix unless it draws a new prefix."""
from __future__ import annotations

import os
import re
import threading

from fedhop.common.wire.codec import make_envelope
from fedhop.common.wire.msgids import new_msg_id


def test_ids_are_32_hex_digits_unique_across_threads():
    out: list[list[str]] = [[] for _ in range(4)]

    def work(k: int) -> None:
        out[k].extend(new_msg_id() for _ in range(20_000))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for chunk in out for i in chunk]
    assert len(set(ids)) == 80_000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    envelope = make_envelope(run_id="r", round=1, src="server", dst="client-1", method="train")
    assert re.fullmatch(r"[0-9a-f]{32}", envelope.msg_id) and envelope.msg_id not in ids


def test_a_forked_child_draws_ids_its_parent_never_makes():
    before = new_msg_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its first ids, then leave without running the parent's cleanup
        os.write(write, ",".join(new_msg_id() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 4096).decode().split(",")
    os.close(read)
    after = [new_msg_id() for _ in range(3)]
    assert os.waitstatus_to_exitcode(status) == 0 and len(child) == 3
    assert not set(child) & set(after)
    assert child[0][:16] != before[:16]   # a new prefix, not the parent's continued
