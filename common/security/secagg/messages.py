"""The byte layout of every message of the four rounds, and the byte formulas that follow from it.

All integers are little-endian uint32; K = 32 (an X25519 key), S = 44 (a Shamir share of a 32-byte
secret: 11 field elements of 4 bytes, shamir.py), w = ceil(modulus_bits / 8).

    phase      message (direction)                  layout                                   bytes
    advertise  request  (server -> u)               round | id | n                           12
               reply    (u -> server)               c_pk | s_pk                              2K = 64
    share      request  (server -> u)               count | count x (id | c_pk | s_pk)       4 + 68 a_u
               reply    (u -> server)               count | count x (to | blob)              4 + 128 a_u
    masked     request  (server -> u)               count | count x (from | blob)            4 + 128 b_u
               reply    (u -> server)               d x w-byte element of Z_R                d w
    unmask     request  (server -> u)               ns | ns x id | nd | nd x id              8 + 4 (s_u + r_u)
               reply    (u -> server)               count | count x (owner | share)          4 + 48 (s_u + r_u)

blob = nonce (12) | AES-GCM(u | v | share of s_u^SK | share of b_u) (8 + 2S = 96) | tag (16) = 124 bytes.
a_u = |N(u) cap U1| (neighbours that advertised), b_u = |N(u) cap U2| (neighbours that shared),
s_u = |N(u) cap U3| (surviving neighbours: self-mask shares asked), r_u = |N(u) cap (U2 minus U3)|
(dropped neighbours: key shares asked).  With no dropouts a_u = b_u = s_u = deg(u), r_u = 0, and a
client's total is 100 + 376 deg(u) + d w bytes: O(n + d) for SecAgg's complete graph (Bonawitz et
al. 2017), O(log n + d) for SecAgg+'s degree O(log n) (Bell et al. 2020); the server's is the sum
over clients, O(n^2 + n d) and O(n log n + n d)."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from . import shamir
from .crypto import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from .errors import BAD_MESSAGE, SecAggFailure

PHASES = ("advertise", "share", "masked", "unmask")
ID = 4
SECRET_BYTES = 32
SHARE = shamir.share_bytes(SECRET_BYTES)                        # 44
PLAINTEXT = 2 * ID + 2 * SHARE                                  # 96
BLOB = NONCE_BYTES + PLAINTEXT + TAG_BYTES                      # 124
KEY_ENTRY = ID + 2 * KEY_BYTES                                  # 68
BLOB_ENTRY = ID + BLOB                                          # 128
SHARE_ENTRY = ID + SHARE                                        # 48


def _u32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


class Reader:
    """Reads a message field by field; a short or long message is a SecAggFailure (bad_message)."""

    def __init__(self, raw: bytes, what: str):
        self.raw, self.at, self.what = raw, 0, what

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.raw):
            raise SecAggFailure(BAD_MESSAGE, f"{self.what}: {len(self.raw)} bytes, short")
        out = self.raw[self.at:self.at + size]
        self.at += size
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(ID))[0])

    def done(self) -> None:
        if self.at != len(self.raw):
            raise SecAggFailure(BAD_MESSAGE, f"{self.what}: {len(self.raw) - self.at} trailing bytes")


# -- advertise
def advertise_request(round_number: int, client: int, n: int) -> bytes:
    return _u32(round_number, client, n)


def read_advertise_request(raw: bytes) -> tuple[int, int, int]:
    r = Reader(raw, "advertise request")
    out = (r.u32(), r.u32(), r.u32())
    r.done()
    return out


def advertise_reply(c_pk: bytes, s_pk: bytes) -> bytes:
    return c_pk + s_pk


def read_advertise_reply(raw: bytes) -> tuple[bytes, bytes]:
    r = Reader(raw, "advertise reply")
    out = (r.take(KEY_BYTES), r.take(KEY_BYTES))
    r.done()
    return out


# -- share
def share_request(keys: dict[int, tuple[bytes, bytes]]) -> bytes:
    return _u32(len(keys)) + b"".join(_u32(v) + c + s for v, (c, s) in sorted(keys.items()))


def read_share_request(raw: bytes) -> dict[int, tuple[bytes, bytes]]:
    r = Reader(raw, "share request")
    out = {}
    for _ in range(r.u32()):
        v = r.u32()
        out[v] = (r.take(KEY_BYTES), r.take(KEY_BYTES))
    r.done()
    return out


def blobs(entries: dict[int, bytes]) -> bytes:
    """count | count x (id | blob): the share reply (ids = recipients) and the masked request (ids = senders)."""
    return _u32(len(entries)) + b"".join(_u32(v) + blob for v, blob in sorted(entries.items()))


def read_blobs(raw: bytes, what: str) -> dict[int, bytes]:
    r = Reader(raw, what)
    out = {}
    for _ in range(r.u32()):
        v = r.u32()
        out[v] = r.take(BLOB)
    r.done()
    return out


def share_plaintext(sender: int, recipient: int, sk_share: np.ndarray, b_share: np.ndarray) -> bytes:
    return _u32(sender, recipient) + shamir.to_bytes(sk_share) + shamir.to_bytes(b_share)


def read_share_plaintext(raw: bytes) -> tuple[int, int, np.ndarray, np.ndarray]:
    r = Reader(raw, "share plaintext")
    out = (r.u32(), r.u32(), shamir.from_bytes(r.take(SHARE)), shamir.from_bytes(r.take(SHARE)))
    r.done()
    return out


# -- masked
def masked_reply(masked: np.ndarray, bits: int) -> bytes:
    """d elements of w = ceil(bits / 8) little-endian bytes each."""
    w = (bits + 7) // 8
    return np.ascontiguousarray(masked.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :w]).tobytes()


def read_masked_reply(raw: bytes, d: int, bits: int) -> np.ndarray:
    w = (bits + 7) // 8
    if len(raw) != d * w:
        raise SecAggFailure(BAD_MESSAGE, f"masked input of {len(raw)} bytes, not d w = {d * w}")
    wide = np.zeros((d, 8), dtype=np.uint8)
    wide[:, :w] = np.frombuffer(raw, dtype=np.uint8).reshape(d, w)
    return wide.view("<u8").reshape(d).astype(np.uint64)


# -- unmask
def unmask_request(survivors: list[int], dropped: list[int]) -> bytes:
    return _u32(len(survivors), *sorted(survivors)) + _u32(len(dropped), *sorted(dropped))


def read_unmask_request(raw: bytes) -> tuple[list[int], list[int]]:
    r = Reader(raw, "unmask request")
    survivors = [r.u32() for _ in range(r.u32())]
    dropped = [r.u32() for _ in range(r.u32())]
    r.done()
    return survivors, dropped


def unmask_reply(shares: dict[int, np.ndarray]) -> bytes:
    return _u32(len(shares)) + b"".join(_u32(u) + shamir.to_bytes(s) for u, s in sorted(shares.items()))


def read_unmask_reply(raw: bytes) -> dict[int, np.ndarray]:
    r = Reader(raw, "unmask reply")
    out = {}
    for _ in range(r.u32()):
        u = r.u32()
        out[u] = shamir.from_bytes(r.take(SHARE))
    r.done()
    return out


# -- the formulas
@dataclass(frozen=True)
class Counts:
    """What one client's message sizes depend on (see the module's table)."""

    a: int = 0   # |N(u) cap U1|: keys in its share request, blobs in its share reply
    b: int = 0   # |N(u) cap U2|: blobs in its masked request
    s: int = 0   # |N(u) cap U3|: self-mask shares asked in unmasking
    r: int = 0   # |N(u) cap (U2 minus U3)|: key shares asked in unmasking


def request_bytes(phase: str, c: Counts) -> int:
    """Bytes the server sends one client in `phase` (the module's table)."""
    return {"advertise": 3 * ID, "share": ID + KEY_ENTRY * c.a, "masked": ID + BLOB_ENTRY * c.b,
            "unmask": 2 * ID + ID * (c.s + c.r)}[phase]


def reply_bytes(phase: str, c: Counts, d: int, bits: int) -> int:
    """Bytes one client sends the server in `phase` (the module's table)."""
    return {"advertise": 2 * KEY_BYTES, "share": ID + BLOB_ENTRY * c.a, "masked": d * ((bits + 7) // 8),
            "unmask": ID + SHARE_ENTRY * (c.s + c.r)}[phase]


def client_total_no_dropouts(degree: int, d: int, bits: int) -> int:
    """A client's bytes over the four rounds with no dropouts: 100 + 376 deg + d w."""
    c = Counts(degree, degree, degree, 0)
    return sum(request_bytes(p, c) + reply_bytes(p, c, d, bits) for p in PHASES)
