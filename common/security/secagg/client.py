"""A client's side of the four rounds (Bonawitz et al. 2017, Fig. 4, semi-honest variant; SecAgg+
restricts every "all other clients" to the client's neighbours N(u), Bell et al. 2020).

Each method takes the server's request bytes and returns the reply bytes (messages.py); the state
between rounds lives on the object.  The client refuses (SecAggRefusal) a request that would leak:
share blobs that do not authenticate or are not addressed to it, and an unmasking request that names
one client both as a survivor (asking b_u's share) and as dropped (asking s_u^SK's share), or that
comes twice."""
from __future__ import annotations

import struct

import numpy as np
from cryptography.exceptions import InvalidTag

from . import crypto, masks, messages, quantize, shamir
from .errors import SecAggRefusal
from .params import SecAggParams


def context(round_number: int) -> bytes:
    """What binds keys and blobs to one round (HKDF info, AES-GCM associated data)."""
    return b"fedhop-secagg round " + struct.pack("<I", round_number)


class SecAggClient:
    def __init__(self, params: SecAggParams):
        self.params = params
        self.me = -1
        self.round = -1
        self.phase = "new"
        self.keys: dict[int, tuple[bytes, bytes]] = {}       # neighbour -> (c_pk, s_pk)
        self.held: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # sender -> (share of s^SK, share of b)
        self.revealed: dict[int, str] = {}                   # owner -> "b" | "sk": what unmasking gave away
        self.quantized: np.ndarray | None = None

    def _expect(self, phase: str, previous: str) -> None:
        if self.phase != previous:
            raise SecAggRefusal(f"{phase} request in phase {self.phase!r} (expected after {previous!r})")
        self.phase = phase

    def advertise(self, request: bytes) -> bytes:
        """Round 0 (AdvertiseKeys): two fresh X25519 key pairs (c for encryption, s for masks) and b_u."""
        self._expect("advertise", "new")
        self.round, self.me, n = messages.read_advertise_request(request)
        if n != self.params.n or not 0 <= self.me < n:
            raise SecAggRefusal(f"advertise request for client {self.me} of {n}, parameters say n = {self.params.n}")
        self.c_sk, self.s_sk = crypto.new_private_key(), crypto.new_private_key()
        self.b = crypto.random_seed()
        return messages.advertise_reply(crypto.public_bytes(self.c_sk), crypto.public_bytes(self.s_sk))

    def share(self, request: bytes) -> bytes:
        """Round 1 (ShareKeys): t-of-|N(u)| shares of s_u^SK and b_u, each neighbour's pair encrypted
        to it under HKDF(X25519(c_u^SK, c_v^PK))."""
        self._expect("share", "advertise")
        self.keys = messages.read_share_request(request)
        if self.me in self.keys or any(not 0 <= v < self.params.n for v in self.keys):
            raise SecAggRefusal("share request names this client or an id outside the round")
        if len(self.keys) < self.params.threshold:
            raise SecAggRefusal(f"{len(self.keys)} neighbours for a threshold of {self.params.threshold}")
        order = sorted(self.keys)
        points = [v + 1 for v in order]
        sk_shares = shamir.split(crypto.private_bytes(self.s_sk), self.params.threshold, points)
        b_shares = shamir.split(self.b, self.params.threshold, points)
        ctx = context(self.round)
        out = {}
        for i, v in enumerate(order):
            key = crypto.agree(self.c_sk, self.keys[v][0], crypto.ENCRYPTION_LABEL, ctx)
            out[v] = crypto.encrypt(key, messages.share_plaintext(self.me, v, sk_shares[i], b_shares[i]), ctx)
        return messages.blobs(out)

    def masked(self, request: bytes, update: np.ndarray, bound: float | None = None,
               extra: np.ndarray | None = None) -> bytes:
        """Round 2 (MaskedInputCollection): keep the shares addressed here, then send y_u (masks.py).
        `bound`: the L2 bound the update is clipped to before quantization (at most params.clip;
        differential privacy's, quantize.private_bound); `extra`: integer coordinates in [0, top]
        appended to the quantized update as they are (their sum is unmasked exactly, e.g. the count
        of unclipped updates of adaptive clipping)."""
        self._expect("masked", "share")
        incoming = messages.read_blobs(request, "masked request")
        ctx = context(self.round)
        for w, blob in incoming.items():
            if w not in self.keys:
                raise SecAggRefusal(f"a share blob from {w}, not a neighbour")
            key = crypto.agree(self.c_sk, self.keys[w][0], crypto.ENCRYPTION_LABEL, ctx)
            try:
                sender, recipient, sk_share, b_share = messages.read_share_plaintext(crypto.decrypt(key, blob, ctx))
            except InvalidTag:
                raise SecAggRefusal(f"the share blob from {w} does not authenticate") from None
            if (sender, recipient) != (w, self.me):
                raise SecAggRefusal(f"the share blob from {w} is addressed {sender} -> {recipient}")
            self.held[w] = (sk_share, b_share)
        p = self.params
        code = p.integer_code
        self.quantized = code.encode(update, quantize.rounding_rng(p.seed, self.round, self.me), bound)
        if extra is not None:
            ints = np.asarray(extra, dtype=np.int64)
            if ints.size and (ints.min() < 0 or ints.max() > code.top):
                raise SecAggRefusal(f"extra coordinates outside [0, {code.top}]")
            self.quantized = np.concatenate([self.quantized, ints.astype(np.uint64)])
        seeds = {w: crypto.agree(self.s_sk, self.keys[w][1], crypto.MASK_LABEL, ctx) for w in incoming}
        return messages.masked_reply(masks.mask_input(self.quantized, self.b, seeds, self.me, p.modulus_bits),
                                     p.modulus_bits)

    def unmask(self, request: bytes) -> bytes:
        """Round 3 (Unmasking): the share of b_v for each surviving neighbour v, of s_v^SK for each
        dropped one; never both for one v (refused), and only once per round."""
        self._expect("unmask", "masked")
        survivors, dropped = messages.read_unmask_request(request)
        both = set(survivors) & set(dropped)
        if both:
            raise SecAggRefusal(f"unmasking asks both b and s^SK of {sorted(both)}")
        unknown = (set(survivors) | set(dropped)) - set(self.held)
        if unknown:
            raise SecAggRefusal(f"unmasking asks shares this client does not hold: {sorted(unknown)}")
        out = {}
        for v in survivors:
            out[v] = self.held[v][1]
            self.revealed[v] = "b"
        for v in dropped:
            out[v] = self.held[v][0]
            self.revealed[v] = "sk"
        return messages.unmask_reply(out)
