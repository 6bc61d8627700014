"""`python -m fedhop.deploy.launch.h2capture --iface eth0 --out FILE`: what the bytes on a link are made of.

A packet socket (AF_PACKET, root) on one interface sees every TCP segment the host sends and
receives.  Each connection's two byte streams are reassembled by sequence number and parsed
as HTTP/2 (RFC 9113): the 24-byte client preface, then frames of a 9-byte header plus payload.
At SIGTERM/SIGINT the totals are written as JSON: TCP payload bytes, and per frame type the
number of frames, their header bytes and their payload bytes.

What that explains: gRPC puts each message into DATA frame payload as a 5-byte prefix plus the
message, which is exactly what the ledger's `framed_bytes` counts.  So TCP payload = ledger
framed bytes (DATA payload) + DATA frame headers + HEADERS (request headers, response headers,
trailers) + SETTINGS, WINDOW_UPDATE and PING frames + the prefaces; `fedhop netsim --capture`
prints that breakdown beside the kernel's counters.  Without TLS (the transport here is
insecure gRPC) there is nothing else on a TCP stream.
"""
from __future__ import annotations

import json
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field

from fedhop.common.util.cliparser import ArgumentParser

ETH_P_ALL = 0x0003
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_TYPES = {0: "DATA", 1: "HEADERS", 2: "PRIORITY", 3: "RST_STREAM", 4: "SETTINGS", 5: "PUSH_PROMISE",
               6: "PING", 7: "GOAWAY", 8: "WINDOW_UPDATE", 9: "CONTINUATION"}


@dataclass
class Stream:
    """One direction of one TCP connection, parsed as HTTP/2 as bytes arrive in order."""

    next_seq: int | None = None
    tcp_payload: int = 0
    preface_left: int = -1            # -1: not known yet whether this side sends the preface
    preface_bytes: int = 0
    header_need: int = 9
    header_buf: bytes = b""
    skip: int = 0                     # payload bytes of the current frame still to pass
    frames: dict = field(default_factory=dict)   # type name -> [frames, header bytes, payload bytes]
    broken: str = ""
    retransmitted: int = 0

    def feed(self, seq: int, data: bytes, syn: bool) -> None:
        if syn:
            self.next_seq = (seq + 1) & 0xFFFFFFFF
            return
        if not data or self.broken:
            return
        if self.next_seq is None:
            self.broken = "capture started mid-connection"
            return
        offset = (self.next_seq - seq) & 0xFFFFFFFF
        if offset >= 1 << 31:
            self.broken = "gap in the captured stream (packets dropped)"
            return
        if offset >= len(data):
            self.retransmitted += len(data)
            return
        self.retransmitted += offset
        data = data[offset:]
        self.next_seq = (self.next_seq + len(data)) & 0xFFFFFFFF
        self.tcp_payload += len(data)
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        i = 0
        if self.preface_left == -1:
            self.preface_left = len(PREFACE) if data.startswith(PREFACE[:min(len(data), len(PREFACE))]) else 0
        if self.preface_left:
            n = min(self.preface_left, len(data))
            self.preface_left -= n
            self.preface_bytes += n
            i = n
        while i < len(data):
            if self.skip:
                n = min(self.skip, len(data) - i)
                self.skip -= n
                i += n
                continue
            n = min(self.header_need - len(self.header_buf), len(data) - i)
            self.header_buf += data[i:i + n]
            i += n
            if len(self.header_buf) == 9:
                length = int.from_bytes(self.header_buf[:3], "big")
                kind = FRAME_TYPES.get(self.header_buf[3], f"type{self.header_buf[3]}")
                row = self.frames.setdefault(kind, [0, 0, 0])
                row[0] += 1
                row[1] += 9
                row[2] += length
                self.header_buf = b""
                self.skip = length


def capture(iface: str, stop: threading.Event, streams: dict, ready: threading.Event) -> dict:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)   # SO_RCVBUFFORCE: room for bursts
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    ready.set()
    stats = {"packets": 0, "non_tcp": 0}
    while not stop.is_set():
        try:
            frame = sock.recv(1 << 17)
        except socket.timeout:
            continue
        stats["packets"] += 1
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:   # IPv4 and TCP only
            stats["non_tcp"] += 1
            continue
        ihl = (frame[14] & 0x0F) * 4
        total = int.from_bytes(frame[16:18], "big") or (len(frame) - 14)
        tcp = 14 + ihl
        src, dst = frame[26:30], frame[30:34]
        sport, dport, seq = struct.unpack("!HHI", frame[tcp:tcp + 8])
        doff = (frame[tcp + 12] >> 4) * 4
        flags = frame[tcp + 13]
        payload = frame[tcp + doff:14 + total]
        key = (socket.inet_ntoa(src), sport, socket.inet_ntoa(dst), dport)
        streams.setdefault(key, Stream()).feed(seq, payload, bool(flags & 0x02))
    # PACKET_STATISTICS: frames the kernel dropped for want of buffer
    try:
        raw = sock.getsockopt(263, 6, 8)                      # SOL_PACKET, PACKET_STATISTICS
        drops: int | None = struct.unpack("II", raw)[1]
    except OSError:
        drops = None
    sock.close()
    return {**stats, "kernel_drops": drops}


def summarize(streams: dict, stats: dict) -> dict:
    totals: dict[str, list[int]] = {}
    out = {"tcp_payload": 0, "preface_bytes": 0, "retransmitted_bytes": 0, "connections": 0, "broken": [],
           **stats}
    for key, s in streams.items():
        if s.tcp_payload == 0 and not s.broken:
            continue
        out["connections"] += 1
        out["tcp_payload"] += s.tcp_payload
        out["preface_bytes"] += s.preface_bytes
        out["retransmitted_bytes"] += s.retransmitted
        if s.broken:
            out["broken"].append(f"{key[0]}:{key[1]}->{key[2]}:{key[3]}: {s.broken}")
        for kind, row in s.frames.items():
            acc = totals.setdefault(kind, [0, 0, 0])
            for j in range(3):
                acc[j] += row[j]
    out["frames"] = {k: {"frames": v[0], "header_bytes": v[1], "payload_bytes": v[2]} for k, v in sorted(totals.items())}
    out["frame_header_bytes"] = sum(v[1] for v in totals.values())
    out["data_payload_bytes"] = totals.get("DATA", [0, 0, 0])[2]
    out["non_data_payload_bytes"] = sum(v[2] for k, v in totals.items() if k != "DATA")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fedhop.deploy.launch.h2capture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iface", default="eth0")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    stop, ready = threading.Event(), threading.Event()
    streams: dict = {}
    result: dict = {}

    def run() -> None:
        result.update(capture(a.iface, stop, streams, ready))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if not ready.wait(10):
        print("h2capture: could not open the packet socket", file=sys.stderr)
        return 1
    print("capturing", flush=True)
    while not stop.wait(0.2):
        pass
    t.join(5)
    with open(a.out, "w") as fh:
        json.dump(summarize(streams, result), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
