"""Cluster certificates, node credentials and the per-call check every gRPC server runs.

Two kinds of node credential (docs/faults.md, "Security"):

- **certificate identity** (`security.mtls = true`): every node holds a certificate signed by the
  cluster CA (`fedhop certs DIR --nodes ...`) whose common name is its node id; the TLS handshake
  proves the peer holds the key, and `AuthInterceptor` takes the identity from the peer
  certificate (`context.auth_context()`).  A certificate from another CA fails the handshake.
- **per-node credential** (what `fedhop run` hands each process): an issuer key that only the
  launcher holds (Ed25519, `TokenAuthority`, new per run) signs each node's own public key and
  node id; the process gets its private key, that signature and the issuer's public key in
  `FEDHOP_NODE_CRED` (its environment, never a command line), and no other node's.  Deployments
  that start each process themselves (compose, Kubernetes, a hosts file, `deploy/launch/role.py`) use
  `fedhop certs DIR`, which keeps the issuer's key in `DIR/issuer.key` and writes `DIR/NODE.cred`;
  a process whose certificate folder holds its own `NODE.cred` uses it (the environment wins).  Every call
  carries a token the caller signs for one audience (the node id or logical client it calls)
  and a few minutes of validity (`SignedIdentity.token`); the callee checks the issuer's
  signature, the caller's, the audience (its own name; the audience "register" only on Register
  and Heartbeat, whose callers do not know their parent's id) and the time.  A participant
  holds no key that signs for another node, and a token it receives names it as the audience,
  so it can neither mint nor replay another node's identity to a third process: for
  authorization this is as strong as mutual TLS (docs/faults.md, "Security").
- **shared-secret token** (`FEDHOP_TOKEN` or `DIR/cluster.secret` alone): `node_token(secret,
  node_id)` = HMAC-SHA256 of the node id under the cluster secret.  It travels in gRPC metadata
  (`fedhop-node`, `fedhop-auth`), never on a command line, and under TLS never in clear.  Every
  holder of the secret can mint any node's token: it admits cluster members, it does not tell
  them apart, so it is only a named opt-in for a one-host quick try (deploy/k8s/overlays/quick-try,
  compose's shared-token mode), and a process in it says so in one line at start
  (`security_notes`, like one with no credential or on plaintext gRPC).

Either way the claimed identity must equal the node the message speaks for: a Register's and a
Heartbeat's `node_id`, an Exchange's envelope `src`.  A refused call is answered UNAUTHENTICATED
or PERMISSION_DENIED, logged, and reported through `on_refused` (the server records an
`auth_refused` event in run.db), so a refused node cannot register, send results or be sent the
model.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Callable, Iterable, Iterator, NoReturn

import grpc

from fedhop.common.security.addresses import insecure_from_env, is_loopback, plaintext_refusal
from fedhop.common.security.nodecred import (
    CRED_ENV,
    CRED_SUFFIX,
    ISSUER_KEY,
    REGISTER_AUDIENCE,
    SCOPED_METHODS,
    SecurityError,
    SignedIdentity,
    TokenAuthority,
    check_node_id,
)
from fedhop.common.util.cliparser import folder_problem

__all__ = ["CRED_ENV", "SignedIdentity", "TokenAuthority", "SecurityError", "check_node_id", "SHARED_TOKEN_NOTE",
           "announce_security", "reserved_name_problem", "security_notes"]

log = logging.getLogger("fedhop.security")

CA_CERT, CA_KEY, SECRET_FILE = "ca.pem", "ca.key", "cluster.secret"
CLUSTER_NAME = "fedhop-node"          # a SAN every node certificate carries (peer id unknown: CA membership)
META_NODE, META_AUTH = "fedhop-node", "fedhop-auth"
_TOKEN_CONTEXT = b"fedhop-node-token-v1:"


# ----------------------------------------------------------------------------- addresses
# ----------------------------------------------------------------------------- certificates
def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise SecurityError("making certificates needs the 'cryptography' package (pip install cryptography)") from exc
    return x509, hashes, serialization, ec, NameOID, ExtendedKeyUsageOID


def _write_private(path: Path, data: bytes) -> None:
    """Write a key file readable by its owner only (mode 0600), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a file that must not exist yet (the CA, the issuer key, the cluster secret): the
    content lands under a temporary name and is linked into place, which fails when another
    `fedhop certs` made the file meanwhile, so a cluster key is never replaced."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise SecurityError(f"{path} appeared while it was being made (another `fedhop certs` on {path.parent}?); "
                            f"it was left as it is: run the command again") from None
    finally:
        tmp.unlink(missing_ok=True)


MAX_CERT_DAYS = 36_500   # `fedhop certs --days` at most


def make_ca(days: int = 365, name: str = "fedhop cluster CA") -> tuple[bytes, bytes]:
    """A new CA: (key PEM, certificate PEM), EC P-256."""
    x509, hashes, serialization, ec, NameOID, _ = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


def make_node_cert(ca_key_pem: bytes, ca_cert_pem: bytes, node_id: str, hosts: Iterable[str] = (),
                   days: int = 365) -> tuple[bytes, bytes]:
    """A node certificate signed by the CA: CN = node id; SANs = node id, `fedhop-node`, localhost,
    127.0.0.1, ::1 and `hosts` (names or IP addresses the node is reached at).  Usable as a TLS
    server and as a TLS client certificate (mutual TLS)."""
    x509, hashes, serialization, ec, NameOID, EKU = _x509()
    check_node_id(node_id)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list = [x509.DNSName(node_id), x509.DNSName(CLUSTER_NAME), x509.DNSName("localhost"),
                   x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


# The files of a cluster folder that belong to no node, and the node files' suffixes: a node
# whose files would be one of them (node "ca" -> ca.pem, ca.key; "issuer" -> issuer.key) would
# replace the cluster's CA or issuer key with its own.  Compared case-insensitively: on a
# case-insensitive file system "CA.key" is ca.key.
CLUSTER_FILES = (CA_CERT, CA_KEY, ISSUER_KEY, SECRET_FILE)
NODE_SUFFIXES = (".pem", ".key", CRED_SUFFIX)
# Names that are not node ids although they are valid DNS labels: the stems of the cluster files,
# the SAN every node certificate carries (a node called that would be verified by any member's
# certificate) and the audience of Register and Heartbeat tokens (a node called that would accept
# every registration token as addressed to itself).
RESERVED_NODE_NAMES = frozenset({"ca", "issuer", "cluster", CLUSTER_NAME, REGISTER_AUDIENCE})


def reserved_name_problem(node_id: str) -> str | None:
    """Why `node_id` cannot have files in a cluster folder, or None."""
    low = node_id.lower()
    clash = sorted(f for f in CLUSTER_FILES if f.lower() in {low + s for s in NODE_SUFFIXES})
    if clash:
        return f"node name '{node_id}' is reserved: its files would be the cluster's {' and '.join(clash)}"
    if low in RESERVED_NODE_NAMES:
        return f"node name '{node_id}' is reserved (the names {', '.join(sorted(RESERVED_NODE_NAMES))} are not node ids)"
    return None


def write_cluster(directory: str | os.PathLike, nodes: Iterable[str], hosts: Iterable[str] = (),
                  days: int = 365) -> list[Path]:
    """Make (or extend) a cluster directory: ca.pem/ca.key (reused when present), NODE.pem/NODE.key
    per node, cluster.secret (reused when present), issuer.key (reused when present) and NODE.cred,
    the node's per-node credential signed by it.  Keys are written mode 0600.  Returns the files
    written.

    Refused (SecurityError, before anything is written): a reserved node name
    (`reserved_name_problem`), a node id that cannot be a certificate name, and a folder holding
    only one half of a CA (ca.pem without ca.key is a node's copy: a new CA there would replace the
    cluster's).  The CA, the issuer key and the cluster secret are only ever created, never
    replaced (`_write_new`)."""
    d = Path(directory)
    nodes = list(nodes)
    if days < 1:
        raise SecurityError(f"--days {days}: certificates must be valid for at least 1 day")
    if days > MAX_CERT_DAYS:   # X.509 dates end at 9999-12-31, and a CA that never expires is a key that is never rotated
        raise SecurityError(f"--days {days}: certificates may be valid for at most {MAX_CERT_DAYS} days (100 years)")
    if d.exists() and not d.is_dir():
        raise SecurityError(f"{d} exists and is not a folder")
    blocked = folder_problem(d, "cluster folder")   # a file on the way to it
    if blocked is not None:
        raise SecurityError(blocked)
    for node in nodes:
        problem = reserved_name_problem(node)
        if problem:
            raise SecurityError(problem)
        check_node_id(node)
    node_files = [d / f"{node}{suffix}" for node in nodes for suffix in (".pem", ".key", CRED_SUFFIX)]
    for path in [d / CA_KEY, d / CA_CERT, d / SECRET_FILE, d / ISSUER_KEY, *node_files]:
        if path.exists() and not path.is_file():   # a folder there: writing or reading it would fail half-way
            raise SecurityError(f"{path} is not a file; move it away and run the command again")
    has_key, has_cert = (d / CA_KEY).exists(), (d / CA_CERT).exists()
    if has_key != has_cert:
        present, absent = (CA_KEY, CA_CERT) if has_key else (CA_CERT, CA_KEY)
        raise SecurityError(f"{d} has {present} but no {absent}: it is not a whole cluster CA (a node's copy?); "
                            f"run `fedhop certs` on the folder that holds the CA's key, or on a new folder")
    if has_key:
        ca_key, ca_cert = (d / CA_KEY).read_bytes(), (d / CA_CERT).read_bytes()
        _check_ca(d, ca_key, ca_cert)
    if (d / SECRET_FILE).exists() and not (d / SECRET_FILE).read_bytes().strip():
        raise SecurityError(f"{d / SECRET_FILE} is empty: every node's token would be signed with no secret; "
                            f"remove it (a new one is made) or restore the cluster's")
    authority = None
    if (d / ISSUER_KEY).exists():
        try:
            authority = TokenAuthority.from_bytes((d / ISSUER_KEY).read_bytes())
        except SecurityError as exc:   # "issuer key: ...": said with the file
            raise SecurityError(f"{d / ISSUER_KEY}: {str(exc).removeprefix('issuer key: ')}") from None
    d.mkdir(parents=True, exist_ok=True)
    written = []
    if not has_key:
        ca_key, ca_cert = make_ca(days)
        _write_new(d / CA_KEY, ca_key)
        _write_new(d / CA_CERT, ca_cert, 0o644)
        written += [d / CA_CERT, d / CA_KEY]
    if not (d / SECRET_FILE).exists():
        _write_new(d / SECRET_FILE, secrets.token_hex(32).encode() + b"\n")
        written.append(d / SECRET_FILE)
    if authority is None:
        authority = TokenAuthority()
        _write_new(d / ISSUER_KEY, authority.to_bytes())
        written.append(d / ISSUER_KEY)
    hosts = list(hosts)
    for node in nodes:
        key, cert = make_node_cert(ca_key, ca_cert, node, hosts, days)
        _write_private(d / f"{node}.key", key)
        _write_public(d / f"{node}.pem", cert)
        _write_private(d / f"{node}{CRED_SUFFIX}", authority.issue(node).encode() + b"\n")
        written += [d / f"{node}.pem", d / f"{node}.key", d / f"{node}{CRED_SUFFIX}"]
    return written


def _check_ca(d: Path, ca_key: bytes, ca_cert: bytes) -> None:
    """A cluster folder's CA, before anything is signed with it: ca.pem a certificate, ca.key a
    private key, the key the certificate's (a certificate signed with another key would not
    verify), and not expired.  SecurityError naming the file otherwise."""
    x509, serialization = _x509()[0], _x509()[2]
    try:
        cert = x509.load_pem_x509_certificate(ca_cert)
    except ValueError as exc:
        raise SecurityError(f"{d / CA_CERT}: not a PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(ca_key, password=None)
    except (ValueError, TypeError) as exc:   # TypeError: an encrypted key
        raise SecurityError(f"{d / CA_KEY}: not an unencrypted PEM private key ({exc})") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise SecurityError(f"{d / CA_KEY} is not the key of {d / CA_CERT}: certificates signed with it would not "
                            f"verify; put the CA's own key back (nothing was written)")
    expires = cert.not_valid_after_utc
    if expires <= datetime.datetime.now(datetime.timezone.utc):
        raise SecurityError(f"{d / CA_CERT} expired on {expires:%Y-%m-%d %H:%M} UTC: a certificate it signs "
                            f"would not verify; make a new cluster directory")


# ----------------------------------------------------------------------------- tokens
def node_token(secret: bytes, node_id: str) -> str:
    """HMAC-SHA256(secret, context || node id), hex: the node's signed token."""
    return hmac.new(secret, _TOKEN_CONTEXT + node_id.encode(), hashlib.sha256).hexdigest()


def verify_token(secret: bytes, node_id: str, token: str) -> bool:
    return bool(secret) and hmac.compare_digest(node_token(secret, node_id), token or "")


def read_secret(certs_dir: str | os.PathLike | None, env_secret: str = "") -> bytes:
    """The cluster secret: DIR/cluster.secret when present, else the launcher's per-run token."""
    if certs_dir:
        p = Path(certs_dir) / SECRET_FILE
        if p.exists():
            return p.read_bytes().strip()
    return env_secret.encode()


# ----------------------------------------------------------------------------- credentials
@dataclass
class TlsFiles:
    ca: bytes
    cert: bytes
    key: bytes


def load_tls(certs_dir: str | os.PathLike, node_id: str) -> TlsFiles:
    d = Path(certs_dir)
    missing = [str(d / n) for n in (CA_CERT, f"{node_id}.pem", f"{node_id}.key") if not (d / n).exists()]
    if missing:
        raise SecurityError(f"TLS for node '{node_id}': missing {', '.join(missing)}; make them with "
                            f"`fedhop certs {d} --nodes {node_id}` (the CA in {d} is reused)")
    return TlsFiles((d / CA_CERT).read_bytes(), (d / f"{node_id}.pem").read_bytes(), (d / f"{node_id}.key").read_bytes())


class NodeNames(AbstractSet[str]):
    """The names calls to one process may address: its node id and its aliases (the logical
    clients it hosts), read through, never copied.  Every incoming call's audience is tested
    against them (`authenticate`), and a client process may host tens of thousands of clients:
    a membership test here costs one comparison and one hash look-up, where a set rebuilt per
    call would cost one entry per hosted client on every call.  A live view, so aliases added
    after the credentials were made (client/__main__.py adds the hosted clients) count at once."""

    __slots__ = ("node_id", "aliases")

    def __init__(self, node_id: str, aliases: AbstractSet[str]) -> None:
        self.node_id = node_id
        self.aliases = aliases

    def __contains__(self, name: object) -> bool:
        return name == self.node_id or name in self.aliases

    def __iter__(self) -> Iterator[str]:
        yield self.node_id
        yield from (a for a in self.aliases if a != self.node_id)

    def __len__(self) -> int:
        return len(self.aliases) + (self.node_id not in self.aliases)


@dataclass
class NodeCredentials:
    """What one process presents and checks: its node id, the cluster secret (tokens), TLS files."""

    node_id: str
    secret: bytes = b""
    tls: TlsFiles | None = None
    mtls: bool = False
    signed: SignedIdentity | None = None    # a per-node credential: then no shared-secret token is accepted
    aliases: set[str] = field(default_factory=set)   # other names calls to this process use (its logical clients)

    @classmethod
    def from_options(cls, node_id: str, certs_dir: str = "", mtls: bool = False, env_secret: str = "",
                     env_cred: str | None = None) -> "NodeCredentials":
        """`env_cred`: the per-node credential (default: the environment's FEDHOP_NODE_CRED)."""
        if mtls and not certs_dir:
            raise SecurityError("mutual TLS needs a certificate directory (security.certs_dir / --certs-dir)")
        tls = load_tls(certs_dir, node_id) if certs_dir else None
        cred, source = (os.environ.get(CRED_ENV, "") if env_cred is None else env_cred), CRED_ENV
        cred_file = Path(certs_dir) / f"{node_id}{CRED_SUFFIX}" if certs_dir else None
        if not cred and cred_file is not None and cred_file.is_file():
            cred, source = cred_file.read_text(), str(cred_file)
        if cred:
            signed = SignedIdentity.parse(cred, source)
            if signed.node_id != node_id:
                raise SecurityError(f"{source} is the credential of node '{signed.node_id}', not of '{node_id}'")
            return cls(node_id, b"", tls, mtls, signed)
        return cls(node_id, read_secret(certs_dir, env_secret), tls, mtls)

    @property
    def checks_calls(self) -> bool:
        return self.mtls or bool(self.secret) or self.signed is not None

    def names(self) -> NodeNames:
        """The audiences a call to this process may name: its node id and its aliases, as a live
        view (`NodeNames`): O(1) to make and to test, whatever the number of hosted clients."""
        return NodeNames(self.node_id, self.aliases)

    def metadata(self, audience: str = REGISTER_AUDIENCE) -> tuple[tuple[str, str], ...]:
        """The call's credential metadata; `audience`: the node (or logical client) called."""
        meta = [(META_NODE, self.node_id)]
        if self.signed is not None:
            meta.append((META_AUTH, self.signed.token(audience or REGISTER_AUDIENCE)))
        elif self.secret:
            meta.append((META_AUTH, node_token(self.secret, self.node_id)))
        return tuple(meta)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)],
                                           root_certificates=self.tls.ca if self.mtls else None,
                                           require_client_auth=self.mtls)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        # the node certificate is always offered: a server that asks for it (mutual TLS) gets it
        return grpc.ssl_channel_credentials(self.tls.ca, self.tls.key, self.tls.cert)


# ----------------------------------------------------------------------------- the server check
class AuthRefused(Exception):
    def __init__(self, status: grpc.StatusCode, message: str, claimed: str) -> None:
        super().__init__(message)
        self.status = status
        self.claimed = claimed


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The verified common name of the peer's certificate (mutual TLS), or None."""
    try:
        auth = context.auth_context()
    except Exception:  # pragma: no cover - in-process fakes
        return None
    names = auth.get("x509_common_name") or []
    return names[0].decode() if names else None


def authenticate(creds: NodeCredentials, metadata: dict[str, str], context: grpc.ServicerContext,
                 method: str = "") -> str:
    """The caller's verified node id, or AuthRefused.  `method`: the RPC (Register and Heartbeat
    accept a per-node token for the register audience)."""
    claimed = metadata.get(META_NODE, "")
    if creds.mtls:
        cn = peer_identity(context)
        if cn is None:
            raise AuthRefused(grpc.StatusCode.UNAUTHENTICATED, "no verified client certificate (mutual TLS)", claimed)
        if claimed and claimed != cn:
            raise AuthRefused(grpc.StatusCode.PERMISSION_DENIED,
                              f"certificate is for '{cn}' but the call claims to come from '{claimed}'", claimed)
        return cn
    if creds.signed is not None:
        if not claimed:
            raise AuthRefused(grpc.StatusCode.UNAUTHENTICATED, "no node credential (fedhop-node metadata)", claimed)
        why = creds.signed.verify(claimed, metadata.get(META_AUTH, ""), creds.names(), method in SCOPED_METHODS)
        if why is not None:
            raise AuthRefused(grpc.StatusCode.UNAUTHENTICATED, f"bad per-node token for node '{claimed}': {why}",
                              claimed)
        return claimed
    if creds.secret:
        if not claimed:
            raise AuthRefused(grpc.StatusCode.UNAUTHENTICATED, "no node credential (fedhop-node metadata)", claimed)
        if not verify_token(creds.secret, claimed, metadata.get(META_AUTH, "")):
            raise AuthRefused(grpc.StatusCode.UNAUTHENTICATED,
                              f"bad or missing signed token for node '{claimed}'", claimed)
        return claimed
    return claimed  # no credential policy (in-process tests): identity as claimed


RefusedHook = Callable[[str, str, str, str], None]   # (claimed node, method, reason, peer address)


def _envelope_src(frame: bytes) -> str | None:
    from fedhop.common.wire import fedhop_pb2 as pb
    if not frame or frame[0] != 0x0A:   # not a header frame (Frame field 1): no envelope to read
        return None
    try:
        f = pb.Frame.FromString(frame)
    except Exception:
        return None
    return f.header.src if f.HasField("header") else None


def _bundle_srcs(bundle: bytes) -> list[str]:
    """The envelope `src` of every message in a Call's FrameBundle: a batch carries several
    (common/transport/grpc.py, Batches), and each must speak for the caller.  An unreadable
    bundle gives none (the codec then rejects it with a typed error)."""
    from fedhop.common.wire import fedhop_pb2 as pb
    try:
        frames = pb.FrameBundle.FromString(bundle).frames
    except Exception:
        return []
    return [src for src in map(_envelope_src, frames) if src is not None]


def _refused_unread(handler, method: str, exc: AuthRefused, refuse) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request: a request-streaming handler,
    whose behaviour gRPC runs before any message arrives, so an unauthenticated call costs at most
    what HTTP/2 flow control lets in before the refusal, never a whole message (issue 17, item 3).
    The refusal goes through `on_refused` like any other (the server aggregates it per peer)."""
    def refuse_now(request_iterator, context):
        refuse(context, method, exc)   # aborts: context.abort raises

    def refuse_now_stream(request_iterator, context):
        refuse(context, method, exc)
        yield from ()

    if handler.unary_stream is not None or handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse_now_stream, response_serializer=handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(refuse_now, response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks the node credential of every call before the handler runs (module docstring).

    The identity must also match who the message speaks for: Register / Heartbeat `node_id`
    (checked by `claims_for`) and the Exchange or Call envelope's `src` (checked on the first frame).
    """

    def __init__(self, creds: NodeCredentials, on_refused: RefusedHook | None = None) -> None:
        self.creds = creds
        self.on_refused = on_refused
        self.refused = 0

    def _refuse(self, context, method: str, exc: AuthRefused) -> NoReturn:
        self.refused += 1
        log.warning("refused %s from %s (claims '%s'): %s", method, context.peer(), exc.claimed, exc)
        if self.on_refused is not None:
            try:
                self.on_refused(exc.claimed, method, str(exc), context.peer())
            except Exception:  # a broken hook must not open the door
                log.exception("on_refused hook failed")
        context.abort(exc.status, f"node credential refused: {exc}")
        raise AssertionError("grpc's context.abort returned")   # it raises; says so to the type checker

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        metadata = {k: v for k, v in (handler_call_details.invocation_metadata or ()) if isinstance(v, str)}
        creds, refuse = self.creds, self._refuse
        if (creds.secret or creds.signed is not None) and not creds.mtls:   # a token is metadata: refuse
            try:                                                                 # before reading any message
                authenticate(creds, metadata, None, method)
            except AuthRefused as exc:
                return _refused_unread(handler, method, exc, refuse)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request, context):
                try:
                    identity = authenticate(creds, metadata, context, method)
                    speaks_for = getattr(request, "node_id", None)
                    if creds.checks_calls and speaks_for is not None and speaks_for != identity:
                        raise AuthRefused(grpc.StatusCode.PERMISSION_DENIED,
                                          f"credential of '{identity}' used for node '{speaks_for}'", speaks_for)
                except AuthRefused as exc:
                    refuse(context, method, exc)
                return inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        def caller(context) -> str:
            """The authenticated node of this call (a refused credential aborts it)."""
            try:
                return authenticate(creds, metadata, context, method)
            except AuthRefused as exc:
                self._refuse(context, method, exc)   # aborts: context.abort raises

        def speaks_for_caller(context, identity: str, src: str | None) -> None:
            """With per-call checks, a message's envelope `src` must be the authenticated caller."""
            if creds.checks_calls and src is not None and src != identity:
                refuse(context, method, AuthRefused(
                    grpc.StatusCode.PERMISSION_DENIED, f"credential of '{identity}' used for a message from '{src}'",
                    src))

        if handler.unary_stream is not None:   # Call: one FrameBundle (common/transport/grpc.py)
            inner_us = handler.unary_stream

            def unary_stream(request, context):
                identity = caller(context)
                for src in (_bundle_srcs(request) if creds.checks_calls else []):
                    speaks_for_caller(context, identity, src)
                yield from inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            inner_s = handler.stream_stream

            def stream(request_iterator, context):
                identity = caller(context)
                it = iter(request_iterator)
                first = next(it, None)
                if first is not None:
                    speaks_for_caller(context, identity, _envelope_src(first) if creds.checks_calls else None)
                chained = itertools.chain([first], it) if first is not None else it
                yield from inner_s(chained, context)

            return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                         response_serializer=handler.response_serializer)
        return handler


# ----------------------------------------------------------------------------- role command lines

def add_security_args(ap: argparse.ArgumentParser) -> None:
    """--certs-dir / --insecure (also FEDHOP_CERTS_DIR, FEDHOP_INSECURE=1, FEDHOP_MTLS=1)."""
    ap.add_argument("--certs-dir", default=os.environ.get("FEDHOP_CERTS_DIR", ""),
                    help="TLS: the cluster directory from `fedhop certs` (ca.pem, NODE.pem, NODE.key)")
    ap.add_argument("--mtls", action="store_true", default=os.environ.get("FEDHOP_MTLS", "") == "1",
                    help="mutual TLS: require a cluster certificate from callers")
    ap.add_argument("--insecure", action="store_true", default=insecure_from_env(),
                    help="allow plaintext gRPC to or on non-loopback addresses")


def credentials_from_args(args, addresses: list[str]) -> NodeCredentials:
    """This process's credentials; plaintext off loopback without --insecure is refused.  A weak
    mode (shared token, no credential, plaintext) is announced on the log (`announce_security`)."""
    refusal = plaintext_refusal(addresses, args.insecure, tls=bool(args.certs_dir))
    if refusal:
        raise SecurityError(f"refusing to start: {refusal}")
    creds = NodeCredentials.from_options(args.node_id, args.certs_dir, args.mtls, env_secret=args.token)
    announce_security(creds, addresses)
    return creds


SHARED_TOKEN_NOTE = ("fedhop: SHARED-TOKEN mode (quick try): any member can impersonate any node; "
                     "use `fedhop certs` for per-node credentials")
NO_CREDENTIAL_NOTE = ("fedhop: NO NODE CREDENTIAL: calls are not authenticated and any caller can claim any node "
                      "id; use `fedhop certs` for per-node credentials")


def security_notes(creds: NodeCredentials, addresses: Iterable[str]) -> list[str]:
    """The start-up lines of a process whose security is weaker than per-node credentials over
    TLS, one line per weakness: a shared-secret token (every holder of the secret can mint any
    node's token, so it is a one-host quick try, never a deployment), no credential at all, and
    plaintext gRPC (on loopback as on a network the user allowed with security.insecure: the
    line says which).  Empty for per-node credentials (mutual TLS or a signed credential) over TLS."""
    notes = []
    if not creds.mtls and creds.signed is None:
        notes.append(SHARED_TOKEN_NOTE if creds.secret else NO_CREDENTIAL_NOTE)
    if creds.tls is None:
        shown = [a for a in addresses if a]
        scope = "loopback only" if all(is_loopback(a) for a in shown) else "security.insecure"
        notes.append(f"fedhop: PLAINTEXT gRPC ({', '.join(shown)}; {scope}): calls travel unencrypted; "
                     f"set security.certs_dir to a `fedhop certs` folder for TLS")
    return notes


def announce_security(creds: NodeCredentials, addresses: Iterable[str]) -> list[str]:
    """Log `security_notes` as warnings (each one line on the process's standard error) and
    return them."""
    notes = security_notes(creds, addresses)
    for note in notes:
        log.warning("%s", note)
    return notes

