"""Addresses: their host part, whether they stay on this machine, and the plaintext rule.

Kept free of gRPC so that the launcher, which forks the run's processes (deploy/launch/forkstart.py),
can use it without importing grpc.
"""
from __future__ import annotations

import ipaddress
import os
from typing import Iterable

IN_MEMORY_SCHEME = "mem:"   # transports/inmemory/endpoint.py addresses


def host_of(address: str) -> str:
    """'127.0.0.1:7000' -> '127.0.0.1'; '[::1]:7000' -> '::1'; 'mem:x:1' -> 'mem:x'."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1, localhost and the in-memory transport's "mem:NODE:N" addresses
    (plaintext there never leaves the machine).  Decided by the address: a host *named*
    "memnode.example" is remote."""
    if address.startswith(IN_MEMORY_SCHEME):
        return True
    host = host_of(address)
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


INSECURE_ENV = "FEDHOP_INSECURE"   # =1 (or true, yes): the same as --insecure


def insecure_from_env() -> bool:
    """FEDHOP_INSECURE=1 / true / yes: every role's --insecure default."""
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def plaintext_refusal(addresses: Iterable[str], insecure: bool, tls: bool, *, who: str = "process") -> str | None:
    """Why a plaintext process must not start (None when it may): plaintext off loopback needs an
    explicit opt-in (docs/faults.md).  The message names the flags and keys of the refusing `who`:
    "server" (reads its security from the config, and --insecure), "process" (a client or edge:
    flags only, the config reaches it after registration), "launch" (`fedhop launch`: the config)."""
    if tls or insecure:
        return None
    remote = [a for a in addresses if a and not is_loopback(a)]
    if not remote:
        return None
    allow, certs = {
        "server": (f"--insecure (the same as security.insecure = true in the config or "
                   f"--set security.insecure=true; or {INSECURE_ENV}=1)",
                   "set security.certs_dir = DIR in the config (or --set security.certs_dir=DIR)"),
        "launch": ("security.insecure = true in the config (or --set security.insecure=true)",
                   "set security.certs_dir = DIR in the config (DIR on every host, relative to its workdir)"),
    }.get(who, (f"--insecure (or {INSECURE_ENV}=1)", "pass --certs-dir DIR"))
    return (f"plaintext gRPC to or on a non-loopback address ({', '.join(remote)}) needs {allow} on a "
            f"trusted network; for TLS make certificates with `fedhop certs DIR --nodes ...` and {certs}")


def listen_address(text: str) -> str:
    """argparse type of --listen: HOST:PORT with a host (a name, an IPv4 address or [IPv6]) and a
    port in 0..65535 (0: any free port)."""
    import argparse
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT (e.g. 127.0.0.1:0, 0.0.0.0:7000, [::1]:7000)")
    return text
