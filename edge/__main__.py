"""`python -m edge --parent HOST:PORT --node-id edge-N [--listen HOST:PORT]`

Starts one edge server: it registers with the server, accepts its cluster's client processes
(which register with it), aggregates their results each round and answers the server with
one partial aggregate.  Exits when the server shuts it down.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from common.ledger import Ledger
from common.transport.grpc import GrpcEndpoint
from edge.runtime import EdgeProcess


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge", description=__doc__)
    ap.add_argument("--parent", required=True, help="address of the server")
    ap.add_argument("--node-id", required=True, help="edge-<n>: n selects the cluster in the topology config")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--port-file", default="", help="write the bound address here once serving")
    ap.add_argument("--ledger-dir", default="")
    ap.add_argument("--token", default=os.environ.get("FEDHOP_TOKEN", ""))
    ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node_id} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    sink = Path(args.ledger_dir) / f"{args.node_id}.jsonl" if args.ledger_dir else None
    endpoint = GrpcEndpoint(args.node_id, Ledger(sink), token=args.token, max_message_bytes=args.max_message_bytes)
    proc = EdgeProcess(endpoint, args.parent, bind=args.listen)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(proc.address)
        tmp.replace(args.port_file)
    logging.info("serving at %s, registering with %s", proc.address, args.parent)
    try:
        proc.start()
    except Exception as exc:
        logging.error("%s", exc)
        endpoint.stop()
        return 2
    proc.wait()
    endpoint.stop(grace=0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
