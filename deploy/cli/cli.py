"""The `fedhop` command: run, sweep, report, bench, launch, netsim, data."""
from __future__ import annotations

import os
import sys
import warnings

from fedhop.common.util.cliparser import ArgumentParser, port_number


def version() -> str:
    """The installed distribution's version (pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("fedhop")
    except PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = ArgumentParser(prog="fedhop", description="federated learning with real processes and exact byte accounting")
    ap.add_argument("--version", action="version", version=f"fedhop {version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment: server and client processes on this machine")
    run.add_argument("config", nargs="?", help="experiment TOML file")
    run.add_argument("--out", help="run directory, relative to this folder (default runs/NAME-seedS-TIMESTAMP, a new "
                                   "folder for every run); one that holds an earlier run is refused unless --force")
    run.add_argument("--force", action="store_true", help="with --out: delete the earlier run in that folder first (only a folder a fedhop run took is ever emptied)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a config key (repeatable)")
    run.add_argument("--engine", choices=("processes", "inprocess"),
                     help="processes: every role its own OS process over gRPC; inprocess: every role in this process "
                          "over in-memory endpoints counting gRPC's bytes, the clients training in a forked worker "
                          "per core (run.workers), the same model bit for bit (sets run.engine, the config's key, "
                          "default processes)")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its newest checkpoint")
    run.add_argument("--dashboard", nargs="?", type=port_number, const=8050, metavar="PORT",
                     help="serve the live run page on 127.0.0.1:PORT (default 8050; 0: any free port)")

    sub.add_parser("sweep", help="tuned comparisons: a grid or random/TPE search over config keys and seeds",
                   add_help=False)
    sub.add_parser("report", help="compare runs: table and plots", add_help=False)
    sub.add_parser("certs", help="make a cluster CA, per-node certificates and the cluster secret", add_help=False)
    sub.add_parser("compose", help="per-node credential folders and a compose override (one service per client)",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks that print their figures", add_help=False)
    sub.add_parser("launch", help="start a run's roles on the machines of a hosts file (ssh)", add_help=False)
    sub.add_parser("dashboard", help="serve the live page of a run directory (finished or running)", add_help=False)
    sub.add_parser("merge-ledgers", help="merge an interrupted run's child ledgers into its run.db", add_help=False)
    sub.add_parser("config", help="the config reference: every key, its default and allowed values", add_help=False)
    sub.add_parser("netsim", help="run on emulated hosts (network namespaces): wire bytes, shaped links",
                   add_help=False)
    sub.add_parser("data", help="look at a config's data (data show: per-client counts, label histograms, a PNG); "
                                "data fetch NAME: download a known data set (needs network)",
                   add_help=False)
    sub.add_parser("slurm", help="submit a run as one Slurm batch job (its steps: server, edges, clients)",
                   add_help=False)
    sub.add_parser("k8s", help="Kubernetes manifests for an experiment (its config in a ConfigMap, a Job per process)",
                   add_help=False)
    sub.add_parser("examples", help="list the example configs, or copy some into this folder (examples copy NAME)",
                   add_help=False)

    if argv and argv[0] == "sweep":
        from fedhop.deploy.tools.sweep import main as sweep_main
        return sweep_main(argv[1:])
    if argv and argv[0] == "k8s":
        from fedhop.deploy.launch.k8s_render import main as k8s_main
        return k8s_main(argv[1:])
    if argv and argv[0] == "examples":
        from fedhop.deploy.cli.examples import main as examples_main
        return examples_main(argv[1:])
    if argv and argv[0] == "launch":
        from fedhop.deploy.launch.hosts import main as launch_main
        return launch_main(argv[1:])
    if argv and argv[0] == "slurm":
        from fedhop.deploy.launch.slurm import main as slurm_main
        return slurm_main(argv[1:])
    if argv and argv[0] == "config":
        from fedhop.deploy.cli.configref import main as config_main
        return config_main(argv[1:])
    if argv and argv[0] == "data" and argv[1:2] == ["fetch"]:
        from fedhop.deploy.tools.datafetch import main as fetch_main
        return fetch_main(argv[2:])
    if argv and argv[0] == "data":
        from fedhop.deploy.tools.datashow import main as data_main
        return data_main(argv[1:])
    if argv and argv[0] == "netsim":
        from fedhop.deploy.launch.netsim import main as netsim_main
        return netsim_main(argv[1:])
    if argv and argv[0] == "dashboard":
        from fedhop.deploy.tools.dashboard import main as dashboard_main
        return dashboard_main(argv[1:])
    if argv and argv[0] == "merge-ledgers":
        from fedhop.deploy.tools.ledgers import main as merge_main
        return merge_main(argv[1:])
    if argv and argv[0] == "compose":
        from fedhop.deploy.launch.compose import main as compose_main
        return compose_main(argv[1:])
    if argv and argv[0] == "certs":
        from fedhop.deploy.launch.certs import main as certs_main
        return certs_main(argv[1:])
    if argv and argv[0] in ("report", "bench"):
        if argv[0] == "report":
            from fedhop.deploy.tools.report import main as report_main
            return report_main(argv[1:])
        from fedhop.deploy.bench.bench import main as bench_main
        return bench_main(argv[1:])

    args = ap.parse_args(argv)
    if args.command == "run":
        if args.resume:
            if args.config or args.overrides or args.out or args.force or args.engine:
                ap.error("run --resume RUN_DIR takes no CONFIG, --set, --engine, --out or --force: the run continues in "
                         "RUN_DIR with its own config.toml (its run.engine too)")
            from fedhop.deploy.launch.forkstart import allow_fork
            allow_fork()
            from fedhop.deploy.launch.launcher import resume_local
            return resume_local(args.resume, quiet=args.quiet, dashboard=args.dashboard)
        if not args.config:
            ap.error("run: a CONFIG file is required")
        if args.force and not args.out:
            ap.error("run --force: only with --out DIR (the default run folder is always new)")
        if args.out:   # a taken folder is refused before torch loads (deploy/launch/runfolder.py)
            from fedhop.deploy.launch.runfolder import RunDirError, check_out
            try:
                check_out(args.out, args.force)
            except RunDirError as exc:
                print(f"fedhop run: {exc}", file=sys.stderr)
                return 2
        overrides = args.overrides + ([f"run.engine={args.engine}"] if args.engine else [])   # the flag wins
        from fedhop.deploy.launch.forkstart import allow_fork
        allow_fork()   # this process validates the config and forks its children (in-process: its workers)
        from fedhop.deploy.launch.launcher import run_local
        return run_local(args.config, overrides, args.out, quiet=args.quiet, dashboard=args.dashboard,
                         force=args.force)
    return 2


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has left (poll says POLLERR or POLLHUP on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):   # no stdout to ask (closed, not a file descriptor)
        return True


def entry() -> None:
    """The console script. After `run`, leave without the interpreter's teardown (common/util/procexit.py):
    the run's records are on disk, and finalizing torch costs a user 0.3 to 0.7 s per run."""
    argv = sys.argv[1:]
    command = f"fedhop{' ' + argv[0] if argv and not argv[0].startswith('-') else ''}"
    # a warning is one line for the user (a skipped ledger line, a library's notice), not a source excerpt
    warnings.formatwarning = lambda message, category, *_args, **_kw: f"{command}: warning: {message}\n"
    try:
        code = main(argv)
    except KeyboardInterrupt:   # Ctrl-C before a command took its signals over (while it imports): no traceback
        print(f"\nfedhop{' ' + argv[0] if argv else ''}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        code = 130
    except BrokenPipeError:   # stdout's reader left (`fedhop run ... | head`): what was done stands, no traceback
        if not _stdout_gone():   # another pipe broke (a child's): a defect to show, not a closed stdout
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush writes nowhere
        code = 141   # 128 + SIGPIPE, as a tool the signal ended
    if argv and argv[0] == "run":
        from fedhop.common.util.procexit import exit_now
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
