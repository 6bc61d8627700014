"""Fault-injecting TCP proxies for tests (plain sockets and threads).

`FaultProxy(target, mode, p, seed)` listens on a loopback port and forwards every connection to
`target` (host:port).  It parses the HTTP/2 frame layer of the stream (9-byte frame headers; the
connecting side first sends the 24-byte client preface) so it can hit gRPC message bytes, not the
framing, which keeps the injected fault the one the test means:

- mode "corrupt": with probability `p` per large DATA frame (>= `min_data` bytes), flip one bit
  of the frame's last byte.  gRPC DATA frames carry our codec frames, and the last byte of a
  large one is tensor data, so the receiver's XXH3-64 check must answer CHECKSUM_MISMATCH.
- mode "drop": with probability `p` per large DATA frame, forward only the first half of the
  frame, then close both sockets: the message is truncated and the connection dropped.

`refuse_first = n`: the first n connections are accepted and closed at once, before a byte is
read (a listener that accepts and then refuses); `refused` counts them.

`directions` picks which way faults go: "down" (from the connecting side: the parent's calls to
the child) and/or "up" (the child's replies).  Every choice comes from one seeded generator, and
`events` lists what was done: (direction, kind, frame length).
"""
from __future__ import annotations

import random
import socket
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA = 0x0


class FaultProxy:
    def __init__(self, target: str, mode: str = "corrupt", p: float = 0.3, seed: int = 0,
                 directions: tuple[str, ...] = ("down", "up"), min_data: int = 1024, refuse_first: int = 0) -> None:
        if mode not in ("corrupt", "drop", "pass"):
            raise ValueError(f"mode must be corrupt, drop or pass, got {mode!r}")
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.mode, self.p, self.directions, self.min_data = mode, p, directions, min_data
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.events: list[tuple[str, str, int]] = []
        self.data_frames = 0
        self.refuse_first, self.refused = refuse_first, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="faultproxy-accept").start()

    # ------------------------------------------------------------------ plumbing
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            if self.refused < self.refuse_first:
                self.refused += 1
                down.close()
                continue
            try:
                up = socket.create_connection(self.target)
            except OSError:
                down.close()
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [down, up]
            pair = _Pair(down, up)
            threading.Thread(target=self._pump, args=(down, up, "down", pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, "up", pair, False), daemon=True).start()

    def _fault(self, direction: str, length: int) -> bool:
        if self.mode == "pass" or direction not in self.directions or length < self.min_data:
            return False
        with self._rng_lock:
            self.data_frames += 1
            return self._rng.random() < self.p

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, pair: "_Pair", preface: bool) -> None:
        buf = bytearray()
        need_preface = preface
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                out = bytearray()
                if need_preface:
                    if len(buf) < len(PREFACE):
                        continue
                    out += buf[:len(PREFACE)]
                    del buf[:len(PREFACE)]
                    need_preface = False
                while len(buf) >= 9:
                    length = int.from_bytes(buf[0:3], "big")
                    if len(buf) < 9 + length:
                        break
                    frame = bytearray(buf[:9 + length])
                    del buf[:9 + length]
                    if frame[3] == DATA and self._fault(direction, length):
                        if self.mode == "corrupt":
                            frame[-1] ^= 0x10
                            self.events.append((direction, "corrupt", length))
                        else:
                            out += frame[:9 + length // 2]
                            self.events.append((direction, "drop", length))
                            dst.sendall(out)
                            pair.close()
                            return
                    out += frame
                if out:
                    dst.sendall(out)
        except OSError:
            pass
        finally:
            pair.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


class _Pair:
    """Both sockets of one proxied connection, closed together."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.a, self.b = a, b
        self._lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.a, self.b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
