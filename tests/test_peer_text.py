"""What a participant writes into a message's header or an error reply reaches the callee's
records as it should: a header whose ends are no node ids is a typed refusal (MALFORMED_HEADER)
recorded on the `control` link, not an exception inside the transport; a peer's error code and
text, or a name quoted in a refusal, enter the logs and run.db as one bounded line."""
from __future__ import annotations

import pytest
import torch

from fedhop.common.transport.base import HandlerError, RemoteError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.util.text import MAX_ERROR_TEXT, one_line
from fedhop.common.wire.codec import PayloadError, decode_frames, encode, make_envelope
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload


@pytest.mark.parametrize("src, dst", [("client-0", "bogus"), ("nobody", "client-proc0"), ("x" * 5000, "server")])
def test_a_header_whose_ends_are_no_node_ids_is_refused_and_recorded(src: str, dst: str) -> None:
    ledger = Ledger()
    callee = GrpcEndpoint("client-proc0", ledger)
    handled: list[str] = []
    request = encode(Payload(tensors={"w": torch.ones(3)}),
                     make_envelope(run_id="r", round=1, src=src, dst=dst, method="train", msg_id="m1"))
    reply = decode_frames(callee.serve_frames(list(request.frames), lambda r: handled.append("called") or Payload()))
    assert handled == []
    assert reply.envelope.error.code == "MALFORMED_HEADER"
    assert "must be node ids" in reply.envelope.error.message and len(reply.envelope.error.message) < 300
    received, sent = ledger.records()
    assert (received.role, received.status, received.link, received.direction) == ("receiver", "rejected",
                                                                                   "control", "control")
    assert "MALFORMED_HEADER" in received.error and sent.link == "control" and sent.msg_id == "m1.reply"


def test_a_peers_error_reply_becomes_one_bounded_line() -> None:
    err = RemoteError("EVIL\nCODE", "line1\nline2 injected\x1b[31m\u202e" + "y" * 300_000, "client-1")
    text = str(err)
    assert "\n" not in text and "\x1b" not in text and "\u202e" not in text
    assert err.code == "EVIL CODE" and text.startswith("client-1 replied EVIL CODE: line1 line2 injected?[31m?yyy")
    assert len(err.detail) == MAX_ERROR_TEXT


@pytest.mark.parametrize("error", [PayloadError, HandlerError])
def test_a_refusal_quoting_a_senders_name_is_one_line(error) -> None:
    exc = error("BAD_NAME", "scalar 'evil\u202e\nname' is not expected")
    assert str(exc) == "BAD_NAME: scalar 'evil? name' is not expected" and exc.code == "BAD_NAME"


def test_one_line_leaves_a_plain_line_as_it_is() -> None:
    line = "client-3 replied NON_FINITE: tensor 'w' holds NaN (values: 1.5, nan)"
    assert one_line(line, 500) is line
    assert one_line("a  b\tc\n", 500) == "a b c" and one_line("abcdef", 3) == "abc"
