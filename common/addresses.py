"""Addresses: their host part, whether they stay on this machine, and the plaintext rule.

Kept free of gRPC so that the launcher, which forks the run's processes (deploy/forkstart.py),
can use it without importing grpc.
"""
from __future__ import annotations

import ipaddress
from typing import Iterable

IN_MEMORY_SCHEME = "mem:"   # common/transport/inmemory.py addresses


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


def plaintext_refusal(addresses: Iterable[str], insecure: bool, tls: bool) -> str | None:
    """Why a plaintext process must not start (None when it may): plaintext off loopback needs
    an explicit `security.insecure = true` (docs/faults.md)."""
    if tls or insecure:
        return None
    remote = [a for a in addresses if a and not is_loopback(a)]
    if not remote:
        return None
    return (f"plaintext gRPC to or on a non-loopback address ({', '.join(remote)}) needs an explicit "
            f"security.insecure = true (or --insecure); for TLS make certificates with "
            f"`fedhop certs DIR --nodes ...` and set security.certs_dir = DIR (processes: --certs-dir DIR)")


def listen_address(text: str) -> str:
    """argparse type of --listen: HOST:PORT with a host (a name, an IPv4 address or [IPv6]) and a
    port in 0..65535 (0: any free port)."""
    import argparse
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT (e.g. 127.0.0.1:0, 0.0.0.0:7000, [::1]:7000)")
    return text
