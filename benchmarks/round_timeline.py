"""Where a round's wall time goes (issue 49): when each phase of a round begins and ends, in the
server and in every client process, on one clock.

    python benchmarks/round_timeline.py CONFIG [--engine processes|inprocess] [--skip 3] [--json FILE]
    python -m fedhop.benchmarks.round_timeline CONFIG ...        (from an installed wheel)

Runs `fedhop run CONFIG --engine ENGINE` as the command does (real processes by default, forked
from this process, as benchmarks/stage_cpu.py), each process noting the monotonic clock
(CLOCK_MONOTONIC: one clock for every process of a machine) at the boundaries of a round's stages:

- server: the round begins (`run_round`); its requests are built (`Fabric.send_and_receive`
  entered); each call goes out (`GrpcEndpoint._exchange`; in the in-process engine, a batch or
  a call written to a worker's pipe, `Worker.send`); each reply is folded (`_folded`); the
  round's end work begins (`complete_round`: the settlement, the server step, the metrics); its
  records are written (`record_round`, begin and end); the round ends;
- each client process, for its `train` requests: a request is decoded (`Endpoint._take`
  begins), a handler runs (`_handle` begins: the training, or with `[algorithm] vectorized` the
  answer of a batch trained together before it), a reply is encoded and recorded (`_reply`
  ends).  With `--engine inprocess` each worker counts as one client process (it serves the
  batches of the client processes it hosts, deploy/launch/workers.py); its workers must be
  forked (`worker_count` and `can_fork` there: more than one worker, a CPU run with
  `run.torch_threads = 1`).  The run's process holds the server and any edges, so a call going
  out is any batch or call written to a worker's pipe and a fold any fold made there: with
  edges (hierarchical) the figures time the calls to client processes and the edges' folds with
  the server's, where in real processes they time the server's calls to its edges and its folds
  of their partials.

An event belongs to the round whose span (its start to its end) holds it.
For the rounds after the first `--skip`, the script prints the median over rounds of each event's
time from the round's start, and the phases they bound:

- the server alone at the start: the round's start to the first request a client process decodes
  (sampling, the requests, their encoding, the calls' way to the processes);
- decoding: a client process's first decode to its first handler (a batch's requests are all
  decoded before the first is handled, common/transport/base.py `serve_batch`);
- training: a client process's first handler to its last reply;
- the server alone at the end: the last reply made to the round's end, split into the folds
  still to do, `complete_round` before its records, and `record_round`.

In the phases "the server alone" the client processes wait, so on a machine with more cores
than busy processes a core is idle: they are what a faster round start and end can win.  Each
noted event adds about a microsecond.  Checked on every round used (exit 1 with the first that
fails otherwise): the server's events in their order, each client process's decode before its
handler before its last reply, no request decoded before the server's first call went out and
no reply folded before a client process handled a request, and none made after the last fold.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

_OUT: Path | None = None   # the folder each forked process writes its events to (set before the run)
_EVENTS: list[tuple[float, str]] = []   # (monotonic seconds, event): list.append is atomic under the GIL

#: the server's events that must come in this order within a round (`check_round`)
SERVER_ORDER = ("round>", "requests<", "sent first", "folded last", "complete>", "records>", "records<", "round<")


def _note(event: str) -> None:
    _EVENTS.append((time.monotonic(), event))


def _noted(owner: Any, name: str, before: str | None, after: str | None) -> None:
    """Replace `owner.name` by a wrapper noting `before` as it is called and `after` as it returns."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            _note(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after is not None:
                _note(after)

    setattr(owner, name, wrapper)


def _is_train(taken: Any) -> bool:
    decoded = getattr(taken, "decoded", None)
    return decoded is not None and decoded.envelope.method == "train"


def _noted_train(endpoint: Any) -> None:
    """Note a served `train` request's decoding (`_take` begins), handler (`_handle` begins) and
    reply (`_reply` ends); other requests (a checkpoint's state pull, the shut-down) are not noted."""
    take, handle, reply = endpoint._take, endpoint._handle, endpoint._reply

    def timed_take(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        taken = take(self, *args, **kwargs)
        if _is_train(taken):
            _EVENTS.append((started, "take>"))
        return taken

    def timed_handle(self: Any, taken: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_train(taken):
            _note("handle>")
        return handle(self, taken, *args, **kwargs)

    def timed_reply(self: Any, taken: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return reply(self, taken, *args, **kwargs)
        finally:
            if _is_train(taken):
                _note("reply<")

    endpoint._take, endpoint._handle, endpoint._reply = timed_take, timed_handle, timed_reply


def _write(role: str) -> None:
    if _OUT is not None:
        (_OUT / f"{role}-{os.getpid()}.json").write_text(json.dumps({"role": role, "events": _EVENTS}))


def _noted_worker_calls() -> None:
    """The in-process engine: note "sent" as a batch or a call is written to a worker's pipe,
    and have each forked worker write its notes when it stops serving (deploy/launch/workers.py:
    a worker leaves by `os._exit`, so nothing runs after its loop)."""
    from fedhop.deploy.launch import workers

    send = workers.Worker.send

    def timed_send(self: Any, head: dict[str, Any], frames: Any) -> None:
        if head.get("kind") in ("many", "call"):
            _note("sent")
        send(self, head, frames)

    serve = workers._serve

    def serve_then_write(*args: Any, **kwargs: Any) -> None:
        try:
            serve(*args, **kwargs)
        finally:
            _write("client")

    workers.Worker.send = timed_send   # type: ignore[method-assign]
    workers._serve = serve_then_write


def install(engine: str = "processes") -> None:
    """The notes, in this process before the run forks its processes (grpcio's module in each
    child after the fork, as benchmarks/stage_cpu.py says why).  A forked process starts with no
    notes of its own (its parent's, if any, stay the parent's)."""
    from fedhop.client.runtime import ClientProcess
    from fedhop.common.transport import base, fabric
    from fedhop.server.coordinator import Coordinator

    os.register_at_fork(after_in_child=_EVENTS.clear)
    if engine == "inprocess":
        _noted_worker_calls()

    _noted(Coordinator, "run_round", "round>", "round<")
    _noted(Coordinator, "complete_round", "complete>", None)
    _noted(Coordinator, "record_round", "records>", "records<")
    _noted(fabric.Fabric, "send_and_receive", "requests<", None)
    _noted(fabric, "_folded", None, "folded")
    _noted_train(base.Endpoint)

    def late() -> None:
        from fedhop.common.transport import grpc as grpc_transport
        _noted(grpc_transport.GrpcEndpoint, "_exchange", "sent", None)
    os.register_at_fork(after_in_child=late)

    run_round = Coordinator.run_round

    def run_round_then_write(self: Any, round: int) -> Any:
        out = run_round(self, round)
        if round == self.cfg.run.rounds:   # the last round
            _write("server")
        return out
    Coordinator.run_round = run_round_then_write   # type: ignore[method-assign]

    wait = ClientProcess.wait

    def wait_then_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return wait(self, *args, **kwargs)
        finally:
            _write("client")
    ClientProcess.wait = wait_then_write   # type: ignore[method-assign]


def round_events(server: list[tuple[float, str]], clients: list[list[tuple[float, str]]],
                 start: float, end: float) -> dict[str, Any]:
    """One round's events in ms from its start: the server's and each client process's between
    `start` and the round's end `end` (the server waits for every reply it folds)."""
    def ms(t: float) -> float:
        return 1000.0 * (t - start)

    def times(events: list[tuple[float, str]], name: str) -> list[float]:
        return [ms(t) for t, e in events if e == name and start <= t <= end]

    out: dict[str, Any] = {}
    for name in ("round>", "requests<", "complete>", "records>", "records<"):
        found = times(server, name)
        out[name] = found[0] if found else None
    out["round<"] = ms(end)
    sent, folded = times(server, "sent"), times(server, "folded")
    out["sent first"], out["sent last"] = (min(sent), max(sent)) if sent else (None, None)
    out["folded first"], out["folded last"] = (min(folded), max(folded)) if folded else (None, None)
    out["clients"] = []
    for events in clients:
        takes, handles, replies = (times(events, e) for e in ("take>", "handle>", "reply<"))
        if handles and replies:   # a process with no sampled client this round serves nothing
            out["clients"].append({"take first": min(takes), "handle first": min(handles), "reply last": max(replies)})
    return out


def check_round(r: dict[str, Any]) -> str | None:
    """What does not hold in a round's events (module docstring), or None."""
    order = [(name, r[name]) for name in SERVER_ORDER]
    missing = [name for name, t in order if t is None]
    if missing:
        return f"server events missing: {', '.join(missing)}"
    for (a, ta), (b, tb) in zip(order, order[1:]):
        if ta > tb:
            return f"server: {a} at {ta:.3f} ms after {b} at {tb:.3f} ms"
    if not r["clients"]:
        return "no client process handled a request"
    for i, c in enumerate(r["clients"]):
        if not c["take first"] <= c["handle first"] <= c["reply last"]:
            return f"client process {i}: decode {c['take first']:.3f}, handler {c['handle first']:.3f}, " \
                   f"last reply {c['reply last']:.3f} ms are out of order"
        if c["take first"] < r["sent first"]:
            return f"client process {i} decoded a request at {c['take first']:.3f} ms, before the server's " \
                   f"first call at {r['sent first']:.3f} ms"
    if r["folded first"] < min(c["handle first"] for c in r["clients"]):   # present: "folded last" is
        return f"a reply was folded at {r['folded first']:.3f} ms, before any client process handled a request"
    last = max(c["reply last"] for c in r["clients"])
    if r["folded last"] < last:
        return f"the last reply was made at {last:.3f} ms, after the server's last fold at {r['folded last']:.3f} ms"
    return None


def summarise(bodies: list[dict[str, Any]], skip: int, engine: str = "processes") -> dict[str, Any]:
    """The medians and phases over the rounds after `skip` (module docstring); ValueError names
    what does not hold."""
    servers = [b["events"] for b in bodies if b["role"] == "server"]
    clients = [b["events"] for b in bodies if b["role"] == "client"]
    if len(servers) != 1 or not clients:
        why = ("the in-process engine forked no worker (run.workers, run.torch_threads = 1 and a CPU run: "
               "deploy/launch/workers.py)" if engine == "inprocess" else
               "the run's processes were not forked (benchmarks/stage_cpu.py)")
        raise ValueError(f"expected one server and client processes with notes, found {len(servers)} and "
                         f"{len(clients)}: {why}")
    server = servers[0]
    starts = [t for t, e in server if e == "round>"]
    ends = [t for t, e in server if e == "round<"]
    rounds = []
    for i in range(skip, len(starts)):
        r = round_events(server, clients, starts[i], ends[i])
        problem = check_round(r)
        if problem is not None:
            raise ValueError(f"round {i + 1}: {problem}")
        rounds.append(r)
    if not rounds:
        raise ValueError(f"no round after the first {skip}")

    def median(values: list[float]) -> float:
        return statistics.median(values)

    first_take = [min(c["take first"] for c in r["clients"]) for r in rounds]
    last_reply = [max(c["reply last"] for c in r["clients"]) for r in rounds]
    events = {name: median([r[name] for r in rounds]) for name in
              ("requests<", "sent first", "sent last", "folded first", "folded last", "complete>", "records>",
               "records<", "round<")}
    events["a client process's first decode"] = median(first_take)
    events["the last reply made"] = median(last_reply)
    phases = {
        "server alone at the start (to the first decode)": median(first_take),
        "  of it: sampling and the requests built": median([r["requests<"] for r in rounds]),
        "  of it: the requests encoded, the first call sent": median([r["sent first"] - r["requests<"] for r in rounds]),
        "  of it: the first call's way to a process": median([t - r["sent first"] for t, r in zip(first_take, rounds)]),
        "decoding, a client process (first decode to first handler)":
            median([c["handle first"] - c["take first"] for r in rounds for c in r["clients"]]),
        "training, a client process (first handler to last reply)":
            median([c["reply last"] - c["handle first"] for r in rounds for c in r["clients"]]),
        "server alone at the end (last reply to the round's end)": median([r["round<"] - t for t, r in zip(last_reply, rounds)]),
        "  of it: folds still to do": median([r["folded last"] - t for t, r in zip(last_reply, rounds)]),
        "  of it: complete_round before its records": median([r["records>"] - r["complete>"] for r in rounds]),
        "  of it: record_round": median([r["records<"] - r["records>"] for r in rounds]),
    }
    return {"engine": engine, "rounds": len(rounds), "client_processes": len(clients), "round_ms": events["round<"],
            "events_ms": events, "phases_ms": phases}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a fedhop run config (TOML)")
    ap.add_argument("--engine", choices=("processes", "inprocess"), default="processes",
                    help="the run's engine (default processes); inprocess: its forked workers are the client processes")
    ap.add_argument("--skip", type=int, default=3, help="rounds left out at the start (default 3)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    from fedhop.deploy.bench.forked import forked_run
    from fedhop.deploy.cli.cli import main as fedhop_main

    def notes(folder: Path) -> None:
        global _OUT
        _OUT = folder
        install(args.engine)

    code, figures = forked_run(fedhop_main, args.config, notes, "round_timeline",
                               lambda bodies: summarise(bodies, args.skip, args.engine), engine=args.engine)
    if code != 0:
        return code   # 2 for a config fedhop refused, as `fedhop run` says it; 1 for figures that do not hold
    serving = "workers" if args.engine == "inprocess" else "client processes"
    print(f"{args.config} ({args.engine}): {figures['rounds']} rounds after round {args.skip}, "
          f"{figures['client_processes']} {serving}; a round {figures['round_ms']:.2f} ms (medians over rounds)")
    print("  events, ms from the round's start:")
    for name, value in figures["events_ms"].items():
        print(f"    {name:58s} {value:8.2f}")
    print("  phases, ms:")
    for name, value in figures["phases_ms"].items():
        print(f"    {name:58s} {value:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
