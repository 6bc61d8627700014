"""Per-node credentials (common/security/auth.py, "per-node credential"): an issuer key that signs
each node's own key, and the call tokens a node signs for one callee.  No gRPC here: the
launcher issues credentials before it forks its children (deploy/launch/forkstart.py forks only a
process that has not imported grpc)."""
from __future__ import annotations

import threading
import time
from typing import AbstractSet

CRED_ENV = "FEDHOP_NODE_CRED"     # a process's own per-node credential (SignedIdentity), environment only
CRED_SUFFIX = ".cred"             # or DIR/NODE.cred in its certificate folder (`fedhop certs` writes them)
ISSUER_KEY = "issuer.key"         # the issuer's private key in a cluster folder: like ca.key, never shipped
_CRED_PREFIX, _TOKEN_PREFIX, _ISSUER_PREFIX = "fhn1", "fht1", "fhi1"
_CERT_CONTEXT, _CALL_CONTEXT = b"fedhop-node-cert-v1:", b"fedhop-call-v1:"
REGISTER_AUDIENCE = "register"    # the audience of calls to a parent whose node id the caller does not know yet
SCOPED_METHODS = frozenset({"Register", "Heartbeat"})   # the only RPCs that accept that audience
TOKEN_TTL = 300.0                 # seconds a call token is valid (it is re-signed a minute before)
MAX_SKEW = 120.0                  # seconds of clock difference between machines that tokens tolerate


class SecurityError(RuntimeError):
    """Bad or missing credentials, or a channel policy violation; the message says what to do."""


def check_node_id(node_id: str) -> None:
    """Node ids become DNS names in certificates: letters, digits and '-', 1..63 characters."""
    ok = 0 < len(node_id) <= 63 and all(c.isalnum() or c == "-" for c in node_id) and node_id[0] != "-"
    if not ok:
        raise SecurityError(f"node id {node_id!r} cannot be a certificate name: use letters, digits and '-' "
                            f"(e.g. server, edge-0, client-proc3)")


def _ed25519():
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return Ed25519PrivateKey, Ed25519PublicKey, InvalidSignature, Encoding, PublicFormat


def _raw_public(key) -> bytes:
    _, _, _, Encoding, PublicFormat = _ed25519()
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class TokenAuthority:
    """The issuer of per-node credentials: an Ed25519 key that only its owner (the launcher of a
    run) holds.  `issue(node)` is the credential of that node alone (module docstring)."""

    def __init__(self, key=None) -> None:
        Ed25519PrivateKey, *_ = _ed25519()
        self.key = key if key is not None else Ed25519PrivateKey.generate()
        self.public = _raw_public(self.key)

    @classmethod
    def from_bytes(cls, data: bytes) -> "TokenAuthority":
        """The issuer saved by `to_bytes` (a cluster folder's issuer.key, security.write_cluster)."""
        Ed25519PrivateKey, *_ = _ed25519()
        try:
            text = data.decode().strip()
            if not text.startswith(_ISSUER_PREFIX + ":"):
                raise ValueError("not a fedhop issuer key")
            return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text[len(_ISSUER_PREFIX) + 1:])))
        except UnicodeDecodeError:
            raise SecurityError("issuer key: not a fedhop issuer key (not text)") from None
        except ValueError as exc:
            raise SecurityError(f"issuer key: {exc}") from None

    def to_bytes(self) -> bytes:
        """The issuer's private key, hex, one line: whoever holds it can issue any node's credential."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
        raw = self.key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"{_ISSUER_PREFIX}:{raw.hex()}\n".encode()

    def issue(self, node_id: str) -> str:
        """The credential string of `node_id`: a fresh node key, the issuer's signature over its
        public half and the node id, and the issuer's public key."""
        check_node_id(node_id)
        Ed25519PrivateKey, *_ = _ed25519()
        node_key = Ed25519PrivateKey.generate()
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
        raw = node_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        cert = self.key.sign(_CERT_CONTEXT + node_id.encode() + b"\x00" + _raw_public(node_key))
        return ":".join([_CRED_PREFIX, node_id, raw.hex(), cert.hex(), self.public.hex()])


class SignedIdentity:
    """One process's per-node credential: it signs call tokens for its node and checks those of
    its callers against the issuer's public key."""

    def __init__(self, node_id: str, key, cert: bytes, issuer: bytes) -> None:
        self.node_id, self.key, self.cert, self.issuer = node_id, key, cert, issuer
        self.public = _raw_public(key)
        self._tokens: dict[str, tuple[float, str]] = {}     # audience -> (expires, token)
        self._verified: dict[str, float] = {}                # (node, token) -> expires (bounded)
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str, source: str = CRED_ENV) -> "SignedIdentity":
        """`source` names where `text` came from, for the error (the variable, or a .cred file)."""
        Ed25519PrivateKey, *_ = _ed25519()
        parts = text.strip().split(":")
        try:
            if len(parts) != 5 or parts[0] != _CRED_PREFIX:
                raise ValueError("not a fedhop node credential")
            _, node, key, cert, issuer = parts
            return cls(node, Ed25519PrivateKey.from_private_bytes(bytes.fromhex(key)), bytes.fromhex(cert),
                       bytes.fromhex(issuer))
        except ValueError as exc:
            raise SecurityError(f"{source}: {exc} (expected a credential `fedhop run` or `fedhop certs` made "
                                f"for this node)") from None

    def token(self, audience: str, now: float | None = None) -> str:
        """A token for calls to `audience`, valid TOKEN_TTL s (reused until a minute before)."""
        now = time.time() if now is None else now
        with self._lock:
            cached = self._tokens.get(audience)
            if cached is not None and 60.0 < cached[0] - now <= TOKEN_TTL:
                return cached[1]
        expires = int(now + TOKEN_TTL)
        sig = self.key.sign(_call_message(self.node_id, audience, expires))
        token = ".".join([_TOKEN_PREFIX, self.public.hex(), self.cert.hex(), audience, str(expires), sig.hex()])
        with self._lock:
            self._tokens[audience] = (float(expires), token)
        return token

    def verify(self, claimed: str, token: str, audiences: AbstractSet[str], scoped: bool,
               now: float | None = None) -> str | None:
        """None when `token` proves `claimed` for a call to one of `audiences` (or, `scoped`, to
        the register audience); else why not."""
        now = time.time() if now is None else now
        key = f"{claimed}\x00{token}"   # a token proves one node: the cache is keyed by both
        with self._lock:
            known = self._verified.get(key)
        parts = (token or "").split(".")
        if len(parts) != 6 or parts[0] != _TOKEN_PREFIX:
            return "not a per-node token"
        _, pub, cert, audience, expires_s, sig = parts
        if audience not in audiences and not (scoped and audience == REGISTER_AUDIENCE):
            return f"the token is for '{audience}', not for this node"
        try:
            expires = int(expires_s)
        except ValueError:
            return "unreadable expiry"
        if not now - MAX_SKEW < expires <= now + TOKEN_TTL + MAX_SKEW:
            return "expired, or valid for longer than tokens are issued (check the machines' clocks)"
        if known is not None:
            return None
        _, Ed25519PublicKey, InvalidSignature, _, _ = _ed25519()
        try:
            raw_pub = bytes.fromhex(pub)
            Ed25519PublicKey.from_public_bytes(self.issuer).verify(
                bytes.fromhex(cert), _CERT_CONTEXT + claimed.encode() + b"\x00" + raw_pub)
            Ed25519PublicKey.from_public_bytes(raw_pub).verify(bytes.fromhex(sig),
                                                              _call_message(claimed, audience, expires))
        except (InvalidSignature, ValueError):
            return "its signatures do not verify (not issued for this node by this cluster's issuer)"
        with self._lock:
            if len(self._verified) >= 4096:
                self._verified.clear()
            self._verified[key] = float(expires)
        return None


def _call_message(node_id: str, audience: str, expires: int) -> bytes:
    return _CALL_CONTEXT + b"\x00".join([node_id.encode(), audience.encode(), str(expires).encode()])
