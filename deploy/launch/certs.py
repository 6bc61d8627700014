"""`fedhop certs DIR --nodes server,edge-0,client-proc0,... [--config EXP.toml] [--hosts H,...] [--days N]`

Makes (or extends) a cluster directory for TLS and node credentials (common/security/auth.py):

    DIR/ca.pem, DIR/ca.key          the cluster CA (reused when DIR already has one)
    DIR/NODE.pem, DIR/NODE.key      one certificate per node, CN = node id, usable for mutual TLS
    DIR/cluster.secret              the shared secret of shared-token deployments (reused when present)
    DIR/issuer.key                  the key that issues per-node credentials (reused when present)
    DIR/NODE.cred                   one per-node credential per node, issued by it

Keys are written mode 0600.  The CA, issuer.key and cluster.secret are only ever created, never
replaced; a folder holding ca.pem without ca.key (a node's copy) is refused.  Reserved names are
refused with one line, exit 2, before anything is written: ca, issuer, cluster (a node's files
would be the cluster's ca.pem / ca.key / issuer.key), fedhop-node (the name every certificate
carries) and register (the registration audience), in any case.  `--config EXP.toml` adds the node ids of that experiment's
processes as `fedhop run` starts them (server, edge-E, client-procP: common/topologies/plan.py).  `--hosts`
adds host names or IP addresses to every certificate (peers are otherwise verified by node id).
Then set `security.certs_dir = "DIR"` (and `security.mtls = true` for mutual TLS); copy to each
machine only ca.pem and its own NODE.pem / NODE.key / NODE.cred (a process whose folder holds its
NODE.cred signs its calls with it and accepts no shared-secret token); ca.key and issuer.key stay here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedhop.common.util.cliparser import ArgumentParser

#: node certificates one `fedhop certs` makes at most (each is a key pair and a signature)
MAX_NODES = 100_000


def expand_nodes(spec: str) -> list[str]:
    """'server,edge-0..2,client-proc0..3' -> the node ids ('a..b' ranges over trailing numbers)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if ".." in part:
            head, hi = part.split("..", 1)
            stem = head.rstrip("0123456789")
            lo = head[len(stem):]
            if not lo or not hi.isdigit() or int(hi) < int(lo):
                raise ValueError(f"--nodes: bad range '{part}' (write e.g. client-proc0..3)")
            if len(out) + int(hi) - int(lo) + 1 > MAX_NODES:
                raise ValueError(f"--nodes: '{part}' makes more than {MAX_NODES:,} node certificates in one command")
            out += [f"{stem}{i}" for i in range(int(lo), int(hi) + 1)]
        else:
            out.append(part)
    nodes = list(dict.fromkeys(out))   # a node named twice is one node
    folded: dict[str, str] = {}
    for node in nodes:
        other = folded.setdefault(node.casefold(), node)
        if other != node:
            raise ValueError(f"--nodes: '{other}' and '{node}' differ only in case: their files would be one on a "
                             f"case-insensitive file system")
    return nodes


def nodes_for_config(path: str) -> list[str]:
    """The node ids of an experiment's processes: its process plan (common/topologies/plan.py)."""
    from fedhop.common.config import load_config
    from fedhop.common.topologies.plan import plan_processes
    return plan_processes(load_config(path)).node_ids


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop certs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="cluster directory (created if missing)")
    ap.add_argument("--nodes", default="", help="node ids, comma-separated; ranges as client-proc0..7")
    ap.add_argument("--config", default="", help="add the node ids of this experiment's processes")
    ap.add_argument("--hosts", default="", help="extra host names / IPs for every certificate, comma-separated")
    ap.add_argument("--days", type=int, default=365, help="validity of a new CA and of the node certificates, in days (1 to 36500)")
    args = ap.parse_args(argv)
    if not args.dir.strip():   # "" would be the folder the command runs in
        ap.error(f"dir {args.dir!r}: name the cluster folder (e.g. certs)")
    from fedhop.common.security.auth import SecurityError, write_cluster
    try:
        nodes = expand_nodes(args.nodes)
        if args.config:
            nodes += [n for n in nodes_for_config(args.config) if n not in nodes]
    except (ValueError, OSError) as exc:
        print(f"fedhop certs: {exc}", file=sys.stderr)
        return 2
    if not nodes:
        print("fedhop certs: name the nodes with --nodes (e.g. server,client-proc0..3) or --config EXP.toml",
              file=sys.stderr)
        return 2
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    from fedhop.common.config.validate import host_problem
    for host in hosts:   # a certificate names hosts by DNS name or IP address
        problem = host_problem(host)
        if problem:
            print(f"fedhop certs: --hosts {host!r}: {problem}", file=sys.stderr)
            return 2
    try:
        written = write_cluster(args.dir, nodes, hosts, args.days)
    except SecurityError as exc:
        print(f"fedhop certs: {exc}", file=sys.stderr)
        return 2
    print(f"fedhop certs: {len(nodes)} node certificates and credentials in {Path(args.dir)} ({len(written)} files written): "
          f"{', '.join(nodes)}")
    print(f'  set security.certs_dir = "{Path(args.dir)}" (security.mtls = true for mutual TLS)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
