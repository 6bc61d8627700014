"""Where a run's CPU goes, stage by stage, in its server and in each client process (issue 49:
what a sampled client costs beyond its training).

    python benchmarks/stage_cpu.py CONFIG [--skip 2] [--json FILE]
    python -m fedhop.benchmarks.stage_cpu CONFIG ...        (from an installed wheel)

Runs `fedhop run CONFIG --engine processes` as the command does (real processes, forked from
this process), with each stage of the message path timed in CPU seconds of the thread that runs it
(`time.thread_time`): a sampling profiler cannot say this for fedhop's processes, because
torch releases the interpreter lock inside its operators (py-spy's `--gil` then leaves the
training out) and a reply's work runs in the server's call threads beside its main thread.
Each process writes its sums to a temporary folder when it ends; this script prints, over the
rounds after the first `--skip`:

- server, per reply: the process's CPU; the call threads' CPU (`call_many`, inclusive) and in
  them the replies' decoding (`FrameDecoder.feed` and `finish`), checks (`Endpoint._settle`:
  the reply chain), fold (`_folded`) and ledger records (`Endpoint._record`, both of a call's);
  the requests' encoding (`batch_messages`); the main thread's round (`run_round`, without the
  time it waits);
- client process, per `train` call: the process's CPU; the request's decoding (`_take`), the
  handler (`_handle`) and in it `local_update` and the algorithm's `client_update` (the
  training); the reply (`_reply`: its encoding and the two ledger records); under
  [algorithm] vectorized, the batch's clients trained together before its requests are
  handled (`ClientHost.prepare_batch`, and in it `client_updates`).

Nested stages are included in their parents' figures.  Each timed call adds about 2.5 us (two
`thread_time` readings and a lock; measured on a no-op method), which the figures include.  The
run must fork its processes (`run.torch_threads = 1` and CPU; deploy/launch/forkstart.py): a process started by exec has no
timers, and the script says so (exit 1).  Checked on every run: every client process served at
least one `train` call, the server's replies equal the clients' `train` calls, and no stage
exceeds its process's CPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

_OUT: Path | None = None   # the folder each forked process writes its sums to (set before the run)
_ACC: dict[str, float] = collections.defaultdict(float)
_COUNT: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()
_MARK: dict[str, Any] = {}   # the sums when the skipped rounds ended


def _timed(owner: Any, name: str, label: str) -> None:
    """Replace `owner.name` by a wrapper adding its thread CPU to `_ACC[label]`."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - start
            with _LOCK:
                _ACC[label] += spent
                _COUNT[label] += 1

    setattr(owner, name, wrapper)


def _snapshot() -> dict[str, Any]:
    with _LOCK:
        return {"cpu": time.process_time(), "acc": dict(_ACC), "count": dict(_COUNT)}


def _write(role: str, start: dict[str, Any] | None) -> None:
    """This process's sums since `start` (its whole life when there is none) to `_OUT`."""
    if _OUT is None:
        return
    end = _snapshot()
    start = start or {"cpu": 0.0, "acc": {}, "count": {}}
    body = {"role": role, "pid": os.getpid(), "cpu": end["cpu"] - start["cpu"],
            "acc": {k: v - start["acc"].get(k, 0.0) for k, v in end["acc"].items()},
            "count": {k: v - start["count"].get(k, 0) for k, v in end["count"].items()}}
    (_OUT / f"{role}-{os.getpid()}.json").write_text(json.dumps(body))


def install(skip: int) -> None:
    """The timers, in this process before the run forks its processes (grpcio's module in each
    child after the fork: importing it here would start threads, and the launcher would then
    start its processes by exec)."""
    from fedhop.client import host as client_host
    from fedhop.client.runtime import ClientProcess
    from fedhop.common.algorithms.fedavg import FedAvg
    from fedhop.common.transport import base, fabric
    from fedhop.common.wire import codec
    from fedhop.server.coordinator import Coordinator

    _timed(codec.FrameDecoder, "feed", "decode")
    _timed(codec.FrameDecoder, "finish", "decode.finish")
    _timed(base.Endpoint, "_settle", "checks")
    _timed(base.Endpoint, "_record", "records")
    _timed(base.Endpoint, "_take", "take")
    _timed(base.Endpoint, "_handle", "handle")
    _timed(base.Endpoint, "_reply", "reply")
    _timed(fabric, "_folded", "fold")
    _timed(client_host, "local_update", "local_update")
    _timed(FedAvg, "client_update", "client_update")
    _timed(client_host.ClientHost, "train", "train")
    _timed(client_host.ClientHost, "prepare_batch", "prepare_batch")   # [algorithm] vectorized
    _timed(FedAvg, "client_updates", "client_updates")
    _timed(Coordinator, "run_round", "run_round")

    def late() -> None:
        from fedhop.common.transport import grpc as grpc_transport
        _timed(grpc_transport.GrpcEndpoint, "call_many", "call_many")
        _timed(grpc_transport.GrpcEndpoint, "batch_messages", "encode_requests")
    os.register_at_fork(after_in_child=late)

    train = client_host.ClientHost.train

    def train_marked(self: Any, cid: int, round: int, *args: Any, **kwargs: Any) -> Any:
        if round > skip and "client" not in _MARK:
            _MARK["client"] = _snapshot()
        return train(self, cid, round, *args, **kwargs)
    client_host.ClientHost.train = train_marked   # type: ignore[method-assign]

    run_round = Coordinator.run_round

    def run_round_marked(self: Any, round: int) -> Any:
        out = run_round(self, round)
        if round == skip:
            _MARK["server"] = _snapshot()
        elif round == self.cfg.run.rounds:   # the last round
            _write("server", _MARK.get("server"))
        return out
    Coordinator.run_round = run_round_marked   # type: ignore[method-assign]

    wait = ClientProcess.wait

    def wait_then_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return wait(self, *args, **kwargs)
        finally:
            _write("client", _MARK.get("client"))
    ClientProcess.wait = wait_then_write   # type: ignore[method-assign]


def per(body: dict[str, Any], key: str, n: int) -> float:
    """CPU ms of stage `key` per unit (`n` of them)."""
    return 1000.0 * body["acc"].get(key, 0.0) / max(n, 1)


def summarise(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """The printed figures, checked (module docstring); ValueError names what does not hold."""
    servers = [b for b in bodies if b["role"] == "server"]
    clients = [b for b in bodies if b["role"] == "client"]
    if len(servers) != 1 or not clients:
        raise ValueError(f"expected one server and client processes with timers, found {len(servers)} and "
                         f"{len(clients)}: the run's processes were not forked (module docstring)")
    server = servers[0]
    replies = server["count"].get("checks", 0)
    calls = [b["count"].get("train", 0) for b in clients]
    if min(calls) < 1:
        raise ValueError(f"a client process served no train call after the skipped rounds: {calls}")
    if replies != sum(calls):
        raise ValueError(f"the server checked {replies} replies but the clients trained {sum(calls)} times")
    for body in bodies:
        worst = max(body["acc"].values(), default=0.0)
        if worst > body["cpu"] * 1.02 + 0.01:
            raise ValueError(f"{body['role']} {body['pid']}: a stage's {worst:.3f} s over the process's {body['cpu']:.3f} s")
    server_rows = {
        "process CPU": 1000.0 * server["cpu"] / replies,
        "call threads (call_many, inclusive)": per(server, "call_many", replies),
        "  replies decoded": per(server, "decode", replies) + per(server, "decode.finish", replies),
        "  replies checked (reply chain)": per(server, "checks", replies),
        "  replies folded": per(server, "fold", replies),
        "  ledger records (2 a call)": per(server, "records", replies),
        "requests encoded (batch_messages)": per(server, "encode_requests", replies),
        "main thread's rounds (run_round, not waiting)": per(server, "run_round", replies),
    }
    n = sum(calls)
    total = {k: sum(b["acc"].get(k, 0.0) for b in clients) for k in
             ("take", "handle", "local_update", "client_update", "reply", "prepare_batch", "client_updates")}
    client_rows = {
        "process CPU": 1000.0 * sum(b["cpu"] for b in clients) / n,
        "request decoded (_take)": 1000.0 * total["take"] / n,
        "handler (_handle)": 1000.0 * total["handle"] / n,
        "  local_update": 1000.0 * total["local_update"] / n,
        "    client_update (the training)": 1000.0 * total["client_update"] / n,
        "reply encoded and recorded (_reply)": 1000.0 * total["reply"] / n,
    }
    if total["prepare_batch"]:   # [algorithm] vectorized: a batch's clients trained before any is handled
        client_rows["batch trained together (prepare_batch)"] = 1000.0 * total["prepare_batch"] / n
        client_rows["  client_updates (the training, vectorized)"] = 1000.0 * total["client_updates"] / n
    return {"replies": replies, "client_processes": len(clients), "server_ms_per_reply": server_rows,
            "client_ms_per_train_call": client_rows}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a fedhop run config (TOML)")
    ap.add_argument("--skip", type=int, default=2, help="rounds left out at the start (default 2)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    from fedhop.deploy.bench.forked import forked_run
    from fedhop.deploy.cli.cli import main as fedhop_main

    def timers(folder: Path) -> None:
        global _OUT
        _OUT = folder
        install(args.skip)

    code, figures = forked_run(fedhop_main, args.config, timers, "stage_cpu", summarise)
    if code != 0:
        return code   # 2 for a config fedhop refused, as `fedhop run` says it; 1 for figures that do not hold
    print(f"{args.config}: {figures['replies']} replies after round {args.skip}, "
          f"{figures['client_processes']} client processes; CPU ms")
    print("  server, per reply:")
    for name, value in figures["server_ms_per_reply"].items():
        print(f"    {name:48s} {value:7.3f}")
    print("  client processes, per train call:")
    for name, value in figures["client_ms_per_train_call"].items():
        print(f"    {name:48s} {value:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
