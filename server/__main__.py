"""`python -m server --config CONFIG.toml --run-dir DIR [--listen HOST:PORT] [--port-file F]`

Starts the server process of one run: it serves registrations and results, drives the rounds,
and writes the run directory (config.toml, run.db, summary.json, model.safetensors).
Exit status: 0 when the run completed, 1 when it failed, 2 on a bad config.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from common.config import ConfigError, load_config
from common.ledger import Ledger
from common.transport.grpc import GrpcEndpoint
from server.coordinator import Coordinator


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--port-file", default="", help="write the bound address here once serving")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--token", default=os.environ.get("FEDHOP_TOKEN", ""))
    ap.add_argument("--register-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s server %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        logging.error("%s", exc)
        return 2
    logging.getLogger().setLevel(cfg.run.log_level.upper())
    torch.set_num_threads(cfg.run.torch_threads)
    run_dir = Path(args.run_dir)
    ledger = Ledger(run_dir / "ledger" / "server.jsonl", keep_drained=False)
    endpoint = GrpcEndpoint("server", ledger, token=args.token, chunk_bytes=cfg.transport.chunk_bytes,
                            max_message_bytes=cfg.transport.max_message_bytes, workers=32)
    coordinator = Coordinator(cfg, run_dir, endpoint, ledger)
    address = endpoint.serve(lambda req: _no_calls(), args.listen, register_handler=coordinator.handle_register)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(args.port_file)
    logging.info("run %s: serving at %s", coordinator.run_id, address)
    summary = coordinator.run(register_timeout=args.register_timeout)
    endpoint.stop()
    logging.info("run %s %s after %d rounds", coordinator.run_id, summary["status"], summary["rounds_completed"])
    return 0 if summary["status"] == "completed" else 1


def _no_calls():
    from common.transport.base import HandlerError
    raise HandlerError("UNKNOWN_METHOD", "the server accepts no Exchange calls in this topology")


if __name__ == "__main__":
    sys.exit(main())
