"""`fedhop launch HOSTS.toml CONFIG`: start a run's roles on the machines a hosts file lists.

Every role is one process started through a *remote command template* (ssh by default): the
launcher writes the role's own credentials and, for the server, the resolved config to the
process's standard input, streams its output back into `OUT/logs/<node>.log` (and the terminal),
waits for the server to finish, gathers the remote run directories into `OUT`, merges every
process's ledger into `OUT/run.db` and stops everything on failure or Ctrl-C.

Credentials are per node, and the channels mutual TLS, unless the user opts out by name:

- no `security.certs_dir` and no `security.insecure` (the default): the launcher makes a CA for
  this run, in memory only, and one certificate per role (CN = node id); each role's shell
  receives only the CA certificate and its own key and certificate, writes them to
  `RUN/creds/NODE/` (mode 0600, removed when the run's files are gathered, never gathered) and the
  process runs mutual TLS from there;
- `security.certs_dir = DIR` (a `fedhop certs` folder present on every host): TLS from it, mutual
  with `security.mtls`;
- `security.insecure = true`: plaintext gRPC, the opt-out by name, said in one line at start.

Either way each role also gets its own per-node credential (`FEDHOP_NODE_CRED`, issued by a key
only the launcher holds), so no role can sign for another; no shared run token exists.

Ports: a port of 0 in the hosts file (server_port, edge_port, client_port) lets each process bind
any free port when it starts and report it ("serving at HOST:PORT"); the launcher gives a parent's
reported address to its children, so no port is chosen by one process and bound by another.

The template is split like a shell command line, `{host}` is replaced by the host's `target`
(default: its name) and the role's shell command is either put where the token `{command}`
stands (one argument: what ssh wants, since it hands a single string to the remote shell) or,
without `{command}`, appended as `sh -c COMMAND` (what `ip netns exec {host}` wants).

Hosts file (see examples/hosts.toml)::

    [launch]
    remote = "ssh -o BatchMode=yes {host} {command}"
    workdir = "~/fedhop"            # the repository checkout on every host
    python = ".venv/bin/python"     # relative to workdir, or absolute
    run_root = "runs"               # remote run directories: <run_root>/<run name>

    # optional: ship fedhop instead of needing a checkout and venv on every host
    ship = "wheel"                  # this checkout's wheel, or a .whl, or a wheelhouse folder
    venv = ".fedhop-venv"           # made in workdir with ship_python; the roles run its python
    ship_python = "python3"
    ship_deps = true                # false: --no-deps in a --system-site-packages venv

    [[host]]
    name = "alpha"
    address = "192.168.1.10"        # where the other hosts reach it; its processes bind here
    target = "alice@192.168.1.10"   # what {host} becomes (default: name)
    server = true
    clients = 20                    # logical clients hosted here: a count, "0-19" or a list
    client_processes = 1            # client processes per parent (server or edge) on this host
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedhop.common.config import Config, ConfigError, config_to_toml, load_config
from fedhop.common.config.validate import host_problem
from fedhop.common.security.addresses import plaintext_refusal
from fedhop.common.security.nodecred import CRED_ENV, TokenAuthority
from fedhop.common.topologies.plan import Placement, plan_processes
from fedhop.common.util.cliparser import ArgumentParser, new_folder_problem
from fedhop.common.util.nodeids import id_spec
from fedhop.common.util.procexit import sigint_ignored
from fedhop.common.util.rolelog import RoleRefused, refusal_of
from fedhop.deploy.launch.engine import process_launch_problem
from fedhop.deploy.launch.malloc import TUNED_MALLOC_ENV
from fedhop.deploy.launch.runfolder import record_server_lost

DEFAULT_REMOTE = "ssh -o BatchMode=yes {host} {command}"


class HostsError(ValueError):
    """The hosts file is invalid, or does not fit the experiment config."""


# ----------------------------------------------------------------------------- hosts file
@dataclass
class HostSpec:
    """One machine of the hosts file."""

    name: str
    address: str
    target: str = ""
    server: bool = False
    server_listen: str = ""                      # bind address of the server (default: address)
    server_port: int = 7000                       # 0: any free port, bound by the server and reported
    edges: list[int] = field(default_factory=list)
    edge_port: int = 7100                         # edge i on this host listens on edge_port + i (0: any)
    clients: Any = 0                              # count, "0-9,12" or [ids]
    client_processes: int = 1
    client_port: int = 7200                       # client process j on this host: client_port + j (0: any)
    workdir: str = ""                             # per-host override of [launch] workdir
    python: str = ""                              # per-host override of [launch] python
    env: dict = field(default_factory=dict)       # extra environment of this host's processes
    bandwidth: str = ""                           # fedhop netsim only: rate of this host's link

    @property
    def remote_name(self) -> str:
        return self.target or self.name


@dataclass
class HostsFile:
    hosts: list[HostSpec]
    remote: str = DEFAULT_REMOTE
    workdir: str = "."
    python: str = ".venv/bin/python"
    run_root: str = "runs"
    stop_grace: float = 10.0
    start_timeout: float = 180.0
    ship: str = ""                  # "", "wheel", a .whl or a wheelhouse folder (ship())
    venv: str = ".fedhop-venv"
    ship_python: str = "python3"
    ship_deps: bool = True

    def workdir_of(self, host: HostSpec) -> str:
        return host.workdir or self.workdir

    def python_of(self, host: HostSpec) -> str:
        return host.python or self.python


_LAUNCH_KEYS: dict[str, type | tuple[type, ...]] = {"remote": str, "workdir": str, "python": str, "run_root": str, "stop_grace": (int, float),
                "start_timeout": (int, float), "ship": str, "venv": str, "ship_python": str, "ship_deps": bool}
_HOST_TYPES: dict[str, Any] = {"name": str, "address": str, "target": str, "server": bool, "server_listen": str,
                               "server_port": int, "edges": list, "edge_port": int, "clients": (int, str, list),
                               "client_processes": int, "client_port": int, "workdir": str, "python": str,
                               "env": dict, "bandwidth": str}


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def target_problem(target: str) -> str | None:
    """Why `target` cannot be what `{host}` becomes, or None: one that starts with '-' would be read
    by ssh as an option (`-oProxyCommand=...`), whitespace or a control character would split or
    end it."""
    if target.startswith("-"):
        return "starts with '-' (ssh would read it as an option)"
    bad = next((c for c in target if c.isspace() or ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        return f"holds whitespace or a control character ({bad!r})"
    return None


def _check_host_strings(host: HostSpec, i: int, where: str) -> None:
    """The strings of a host that reach a command line: the ssh target and the env names and values
    (role_command quotes every value; a name cannot be quoted, so it must be a shell name)."""
    problem = target_problem(host.remote_name)
    if problem:
        key = "target" if host.target else "name"
        raise HostsError(f"{where}: host[{i}].{key} = {host.remote_name!r} {problem}")
    for key, value in host.env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise HostsError(f"{where}: host[{i}].env key {key!r} is not an environment variable name "
                             f"(letters, digits and '_', not starting with a digit)")
        if not isinstance(value, (str, int, float, bool)):
            raise HostsError(f"{where}: host[{i}].env.{key} = {value!r} must be a string or a number")


def hosts_from_dict(data: dict, where: str = "hosts file", addresses: bool = True) -> HostsFile:
    """Validate a parsed hosts file; errors name the key, the value and what is allowed.  Without
    `addresses` (fedhop netsim, which assigns each host its own) a host may leave `address` out."""
    unknown = sorted(set(data) - {"launch", "host"})
    if unknown:
        raise HostsError(f"{where}: unknown section '{unknown[0]}' (allowed: [launch], [[host]])")
    launch = data.get("launch", {})
    kwargs: dict[str, Any] = {}
    for key, value in launch.items():
        if key not in _LAUNCH_KEYS:
            raise HostsError(f"{where}: unknown key 'launch.{key}' (allowed: {', '.join(_LAUNCH_KEYS)})")
        if not isinstance(value, _LAUNCH_KEYS[key]) or (isinstance(value, bool) and _LAUNCH_KEYS[key] is not bool):
            raise HostsError(f"{where}: launch.{key} = {value!r} has the wrong type")
        kwargs[key] = value
    for key in ("workdir", "python", "run_root", "venv", "ship_python"):
        if key in kwargs and not kwargs[key].strip():
            raise HostsError(f"{where}: launch.{key} = {kwargs[key]!r}: give a path (or leave the key out: "
                             f"{getattr(HostsFile, key)!r})")
    ship = kwargs.get("ship", "")
    if ship and ship != "wheel":
        path = Path(ship).expanduser()
        wheels = [path] if path.is_file() else sorted(path.glob("*.whl")) if path.is_dir() else []
        if not any(w.name.startswith("fedhop-") and w.suffix == ".whl" for w in wheels):
            raise HostsError(f"{where}: launch.ship = {ship!r}: no fedhop wheel there (give 'wheel', a .whl or a "
                             f"wheelhouse folder)")
    grace = kwargs.get("stop_grace", 0.0)
    if not (math.isfinite(grace) and grace >= 0):
        raise HostsError(f"{where}: launch.stop_grace = {grace!r} must be a number of seconds >= 0")
    raw_hosts = data.get("host", [])
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise HostsError(f"{where}: no [[host]] entries")
    hosts = []
    for i, raw in enumerate(raw_hosts):
        for key, value in raw.items():
            if key not in _HOST_TYPES:
                raise HostsError(f"{where}: unknown key 'host[{i}].{key}' (allowed: {', '.join(_HOST_TYPES)})")
            want = _HOST_TYPES[key]
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise HostsError(f"{where}: host[{i}].{key} = {value!r} has the wrong type")
        if not addresses and "address" not in raw:
            raw = {**raw, "address": "127.0.0.1"}   # a stand-in: the caller assigns the host's address
        for key in ("name", "address"):
            if not raw.get(key):
                raise HostsError(f"{where}: host[{i}] needs '{key}'")
        host = HostSpec(**raw)
        _check_host_strings(host, i, where)
        problem = host_problem(host.address)
        if problem:   # what the other hosts connect to: a name or an IP address
            raise HostsError(f"{where}: host[{i}].address = {host.address!r}: {problem}")
        if host.client_processes < 1:
            raise HostsError(f"{where}: host '{host.name}': client_processes = {host.client_processes}, must be >= 1")
        for key in ("server_port", "edge_port", "client_port"):
            if not 0 <= getattr(host, key) < 65536:
                raise HostsError(f"{where}: host '{host.name}': {key} = {getattr(host, key)} is not a TCP port "
                                 f"(0: any free port, bound by the process and reported)")
        hosts.append(host)
    names = [h.name for h in hosts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HostsError(f"{where}: host name '{dup[0]}' appears more than once")
    problem = remote_problem(kwargs.get("remote", DEFAULT_REMOTE))
    if problem:
        raise HostsError(f"{where}: launch.remote = {kwargs['remote']!r}: {problem}")
    return HostsFile(hosts=hosts, **kwargs)


def remote_problem(template: str) -> str | None:
    """Why a remote command template cannot start a role (module docstring), or None: it must name
    the host with `{host}`, split like a shell command line, and hold no other `{...}` field."""
    try:
        tokens = shlex.split(template)
    except ValueError as exc:   # an unclosed quote
        return f"not a command line ({exc})"
    if not any("{host}" in t for t in tokens):
        return "must contain {host}"
    other = sorted(set(re.findall(r"\{[^{}]*\}?", template)) - {"{host}", "{command}"})
    if other:
        return f"{other[0]} is not a field (the fields: {{host}}, {{command}})"
    if "{command}" in template and "{command}" not in tokens:
        return "{command} must be a word of its own"
    return None


def load_hosts(path: str | os.PathLike, addresses: bool = True) -> HostsFile:
    try:
        data = tomllib.loads(Path(path).read_text().removeprefix("\ufeff"))   # a byte order mark is not TOML
    except OSError as exc:
        raise HostsError(f"cannot read hosts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise HostsError(f"{path}: not a hosts file (TOML text): not UTF-8 at byte {exc.start}") from None
    except tomllib.TOMLDecodeError as exc:
        raise HostsError(f"{path}: not valid TOML: {exc}") from None
    return hosts_from_dict(data, str(path), addresses)


# ----------------------------------------------------------------------------- the plan
@dataclass
class Role:
    """One process of the run, on one host."""

    node_id: str          # "server", "edge-<e>", "client-proc<k>"
    kind: str             # server | edge | client
    host: HostSpec
    port: int             # 0 until the process reports the port it bound (a hosts file's port 0)
    parent: str = ""      # address of the server or edge it registers with
    clients: list[int] = field(default_factory=list)
    edge: int | None = None
    parent_node: str = ""   # the node id of that parent (its address is final once it serves)

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"


def parse_id_list(value: Any, count: int, where: str) -> list[int]:
    """'0-9,12' or [0, 1, 2] -> sorted ids, each checked against clients.count."""
    if isinstance(value, list):
        ids = value
    else:
        ids = []
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            try:
                ids.extend(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise HostsError(f"{where}: bad client id range '{part}' (use e.g. \"0-9,12\")") from None
    out = sorted(set(int(i) for i in ids))
    bad = [i for i in out if not 0 <= i < count]
    if bad:
        raise HostsError(f"{where}: client ids {bad[:5]} outside 0..{count - 1} (clients.count = {count})")
    return out


def process_layout(cfg: Config) -> list[tuple[int | None, list[int]]]:
    """(edge or None, logical client ids) per client process of the config's process plan
    (common/topologies/plan.py), as `fedhop run` starts them."""
    return [(p.edge, list(p.clients)) for p in plan_processes(cfg).clients]


def plan_roles(hf: HostsFile, cfg: Config) -> list[Role]:
    """The processes of the run: which role on which host, its port and its parent.  The process
    plan (common/topologies/plan.py) decides the processes; the hosts file places the logical clients on
    hosts and says how many client processes each parent gets there."""
    servers = [h for h in hf.hosts if h.server]
    if len(servers) != 1:
        raise HostsError(f"hosts file: exactly one host must have server = true, found {len(servers)}")
    server = servers[0]
    roles = [Role("server", "server", server, server.server_port)]
    server_addr = roles[0].address
    base = plan_processes(cfg)
    planned_edges = {p.edge: p for p in base.edges if p.edge is not None}   # every edge has its index
    edge_roles: dict[int, Role] = {}
    for h in hf.hosts:
        for i, e in enumerate(h.edges):
            if not planned_edges:
                raise HostsError(f"hosts file: host '{h.name}' lists edges {h.edges} but topology.kind = "
                                 f"'{cfg.topology.kind}' has no edge servers")
            if not isinstance(e, int) or isinstance(e, bool) or e not in planned_edges:
                raise HostsError(f"hosts file: host '{h.name}': edge {e!r} is not in 0..{len(planned_edges) - 1} "
                                 f"(topology.edges = {cfg.topology.edges})")
            if e in edge_roles:
                raise HostsError(f"hosts file: edge {e} is on both '{edge_roles[e].host.name}' and '{h.name}'")
            edge_roles[e] = Role(planned_edges[e].node_id, "edge", h, _nth_port(h.edge_port, i), parent=server_addr,
                                 edge=e, parent_node="server")
    missing = sorted(set(planned_edges) - set(edge_roles))
    if missing:
        raise HostsError(f"hosts file: edges {missing} are on no host (topology.edges = {cfg.topology.edges})")
    roles.extend(edge_roles[e] for e in sorted(edge_roles))

    count = cfg.clients.count
    edge_of = base.edge_of()
    # the order in which counted hosts take clients: cluster by cluster, so a host tends to hold whole clusters
    pool = sorted(range(count), key=lambda c: (edge_of.get(c, 0), c))
    explicit = {h.name: parse_id_list(h.clients, count, f"hosts file: host '{h.name}'.clients")
                for h in hf.hosts if isinstance(h.clients, (str, list))}
    taken = [c for ids in explicit.values() for c in ids]
    if len(taken) != len(set(taken)):
        dup = sorted({c for c in taken if taken.count(c) > 1})
        raise HostsError(f"hosts file: client ids {dup[:5]} are listed on more than one host")
    pool = [c for c in pool if c not in set(taken)]
    per_host: dict[str, list[int]] = {}
    for h in hf.hosts:
        if h.name in explicit:
            per_host[h.name] = explicit[h.name]
        else:
            n = int(h.clients)
            if n < 0:
                raise HostsError(f"hosts file: host '{h.name}': clients = {n} must be >= 0")
            if n > len(pool):
                raise HostsError(f"hosts file: host '{h.name}': clients = {n}, but only {len(pool)} logical clients "
                                 f"are left for it (clients.count = {count})")
            per_host[h.name], pool = sorted(pool[:n]), pool[n:]
    placed = sum(len(v) for v in per_host.values())
    if placed != count or pool:
        raise HostsError(f"hosts file: the hosts hold {placed} logical clients in all but clients.count = {count}; "
                         f"every client must be on exactly one host")
    plan = plan_processes(cfg, [Placement(tuple(per_host[h.name]), h.client_processes) for h in hf.hosts])
    address = {"server": server_addr, **{r.node_id: r.address for r in roles}}
    on_host: dict[int, int] = {}   # placement group (host) -> client processes placed there so far
    for p in plan.clients:
        h = hf.hosts[p.group]
        assert p.parent is not None   # only the server has none
        j = on_host[p.group] = on_host.get(p.group, -1) + 1
        roles.append(Role(p.node_id, "client", h, _nth_port(h.client_port, j), parent=address[p.parent],
                          clients=list(p.clients), edge=p.edge, parent_node=p.parent))
    ports: dict[tuple[str, int], str] = {}
    for r in roles:
        key = (r.host.name, r.port)
        if r.port == 0:   # bound by the process itself: never shared
            continue
        if key in ports:
            raise HostsError(f"hosts file: {r.node_id} and {ports[key]} both use port {r.port} on '{r.host.name}'")
        ports[key] = r.node_id
    return roles


def _nth_port(base: int, n: int) -> int:
    """The port of the n-th process of a kind on a host: base + n, or 0 (each binds its own) for 0."""
    return base + n if base else 0


# ----------------------------------------------------------------------------- remote commands
def shell_path(path: str) -> str:
    """Quote a path for sh, keeping a leading ~/ expandable."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def remote_argv(template: str, host: str, command: str) -> list[str]:
    """The local argv that runs the shell `command` on `host` through the template."""
    argv = []
    placed = False
    for token in shlex.split(template):
        if token == "{command}":
            argv.append(command)
            placed = True
        else:
            argv.append(token.replace("{host}", host))
    if not placed:
        argv += ["sh", "-c", command]
    return argv


def run_path(hf: HostsFile, run_name: str) -> str:
    """The run directory on every host (absolute, or relative to the host's workdir)."""
    return f"{hf.run_root.rstrip('/')}/{run_name}"


def bind_address(role: Role) -> str:
    """The address a role's process binds (the server's server_listen where set)."""
    if role.kind == "server":
        return f"{role.host.server_listen or role.host.address}:{role.port}"
    return role.address


CREDS_DIR = "creds"   # RUN/creds/NODE: a role's own TLS files, when the launcher made them


def makes_tls(cfg: Config) -> bool:
    """The launcher makes this run's CA and per-node certificates: neither a certificate folder
    nor the plaintext opt-out (security.insecure) was given (module docstring)."""
    return not cfg.security.certs_dir and not cfg.security.insecure


def creds_path(run: str, node_id: str) -> str:
    return f"{run}/{CREDS_DIR}/{node_id}"


def server_config(cfg: Config, run: str) -> Config:
    """The config the server reads: with the launcher's credentials, its own folder and mutual TLS."""
    if not makes_tls(cfg):
        return cfg
    import copy
    out = copy.deepcopy(cfg)
    out.security.certs_dir = creds_path(run, "server")
    out.security.mtls = True
    return out


def role_argv(role: Role, cfg: Config, run: str) -> list[str]:
    """`python -m <role> ...` arguments (paths relative to the workdir unless absolute)."""
    mm = str(cfg.transport.max_message_bytes)
    window = ["--window-bytes", str(cfg.transport.window_bytes)]
    sec = cfg.security   # children check their channels before the config reaches them
    if makes_tls(cfg):
        security = ["--certs-dir", creds_path(run, role.node_id), "--mtls"]
    else:
        security = (["--certs-dir", sec.certs_dir] if sec.certs_dir else []) + (["--mtls"] if sec.mtls else []) \
            + (["--insecure"] if sec.insecure else [])
    if role.kind == "server":
        return ["server", "--config", f"{run}/config.toml", "--run-dir", run, "--listen", bind_address(role)]
    if role.kind == "edge":
        return ["edge", "--parent", role.parent, "--node-id", role.node_id, "--listen", role.address,
                "--ledger-dir", f"{run}/ledger", "--max-message-bytes", mm] + window + security
    return ["client", "--parent", role.parent, "--clients", id_spec(role.clients), "--node-id", role.node_id,
            "--listen", role.address, "--ledger-dir", f"{run}/ledger", "--max-message-bytes", mm,
            "--threads", str(cfg.run.torch_threads)] + window + security


TLS_FILES = ("ca.pem", "{node}.pem", "{node}.key")   # what a role receives of the run's TLS material
END_OF_FILE = "."                                    # the line after each file on standard input (no PEM line is ".")


def role_command(hf: HostsFile, role: Role, cfg: Config, run: str) -> str:
    """The remote shell command of a role.  Its own per-node credential arrives on the first line
    of standard input (never on a command line, where `ps` would show it); then, when the
    launcher made the run's TLS files, the CA certificate and the role's own certificate and key,
    each followed by a line ".", which the shell writes to RUN/creds/NODE with umask 077; the
    server's config follows them."""
    host = role.host
    q = shell_path
    env = {"PYTHONUNBUFFERED": "1", **TUNED_MALLOC_ENV, **{str(k): str(v) for k, v in host.env.items()}}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    steps = [f"cd {q(hf.workdir_of(host))}",
             f"mkdir -p {q(run)}/ledger {q(run)}/pids",
             f"echo $$ > {q(run)}/pids/{role.node_id}.pid",
             f"IFS= read -r {CRED_ENV}",
             f"export {CRED_ENV} {exports}"]
    if makes_tls(cfg):
        d = q(creds_path(run, role.node_id))
        names = " ".join(shlex.quote(f.format(node=role.node_id)) for f in TLS_FILES)
        # a subshell: the umask holds for the key files only, not for the run's results
        steps.append(f"(umask 077 && rm -rf {d} && mkdir -p {d} && for f in {names}; do : > {d}/$f && "
                     f"while IFS= read -r l && [ \"$l\" != {shlex.quote(END_OF_FILE)} ]; do "
                     f"printf '%s\\n' \"$l\" >> {d}/$f; done; done)")
    if role.kind == "server":
        steps.append(f"cat > {q(run)}/config.toml")
    argv = " ".join(shlex.quote(a) for a in role_argv(role, cfg, run))
    steps.append(f"exec {q(hf.python_of(host))} -m fedhop.{argv}")
    return " && ".join(steps)


# ----------------------------------------------------------------------------- shipping and versions
SHIP_DIR = ".fedhop-ship"
VERSION_CODE = "import importlib.metadata as m; print(m.version('fedhop'))"


def launcher_version() -> str:
    from importlib.metadata import version
    return version("fedhop")


def ship_wheels(spec: str, build_dir: Path) -> list[Path]:
    """The wheels `launch.ship` names: "wheel" builds this checkout's (pip wheel --no-deps), a .whl
    file is itself, a folder is every wheel in it (a wheelhouse: fedhop and its dependencies)."""
    if spec == "wheel":
        root = Path(__file__).resolve().parents[2]
        build_dir.mkdir(parents=True, exist_ok=True)
        # built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds
        src = build_dir / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(root, src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "runs", "sweeps", "wheelhouse", "__pycache__", ".*_cache"))
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(build_dir),
                              str(src)], capture_output=True, text=True)
        shutil.rmtree(src, ignore_errors=True)
        if res.returncode != 0:
            raise HostsError(f"launch.ship = 'wheel': building the wheel of {root} failed: {res.stderr.strip()[-400:]}")
        return sorted(build_dir.glob("fedhop-*.whl"))
    path = Path(spec).expanduser()
    wheels = [path] if path.is_file() else sorted(path.glob("*.whl")) if path.is_dir() else []
    if not any(w.name.startswith("fedhop-") for w in wheels):
        raise HostsError(f"launch.ship = {spec!r}: no fedhop wheel there (give 'wheel', a .whl or a wheelhouse folder)")
    return wheels


def ship_command(hf: HostsFile, host: HostSpec) -> str:
    """Unpack the wheels (a tar on standard input) into WORKDIR/.fedhop-ship and install this
    launcher's fedhop from them into the venv, replacing whatever build of it was there."""
    q = shell_path
    venv, pip = q(hf.venv), f"{q(hf.venv)}/bin/python -m pip install --quiet --no-index --find-links {SHIP_DIR}"
    want = shlex.quote(f"fedhop=={launcher_version()}")
    system = " --system-site-packages" if not hf.ship_deps else ""
    steps = [f"mkdir -p {q(hf.workdir_of(host))}", f"cd {q(hf.workdir_of(host))}",
             f"rm -rf {SHIP_DIR}", f"mkdir {SHIP_DIR}", f"tar -C {SHIP_DIR} -xf -",
             f"{{ [ -x {venv}/bin/python ] || {q(hf.ship_python)} -m venv{system} {venv}; }}",
             f"{pip} --force-reinstall --no-deps {want}"]
    if hf.ship_deps:
        steps.append(f"{pip} {want}")
    return " && ".join(steps)


def ship(hf: HostsFile, out: Path) -> None:
    """Copy `launch.ship`'s wheels to every host and install them (see ship_command); from then on
    the roles run the venv's python."""
    wheels = ship_wheels(hf.ship, out / "ship")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as tar:
        for w in wheels:
            tar.add(w, arcname=w.name)
    for host in _distinct_hosts(hf):
        res = _remote(hf, host, ship_command(hf, host), buf.getvalue(), timeout=1800)
        if res.returncode != 0:
            raise HostsError(f"host '{host.name}': installing the shipped fedhop failed (exit {res.returncode}): "
                             f"{res.stderr.decode(errors='replace').strip()[-400:]}")
    hf.python = f"{hf.venv.rstrip('/')}/bin/python"
    for host in hf.hosts:
        host.python = ""


def check_versions(hf: HostsFile) -> list[str]:
    """Refuse to start when a host's fedhop is not this launcher's version, naming both.  A host
    whose version cannot be read is returned as a warning: its role then fails to start, and the
    launch stops everything as for any failed role."""
    mine = launcher_version()
    warnings = []
    for host in _distinct_hosts(hf):
        cmd = f"cd {shell_path(hf.workdir_of(host))} && {shell_path(hf.python_of(host))} -c {shlex.quote(VERSION_CODE)}"
        res = _remote(hf, host, cmd, b"", timeout=120)
        theirs = res.stdout.decode(errors="replace").strip()
        if res.returncode != 0 or not theirs:
            warnings.append(f"host '{host.name}': cannot read its fedhop version with {hf.python_of(host)} "
                            f"(exit {res.returncode}): {res.stderr.decode(errors='replace').strip()[-300:]}")
            continue
        if theirs != mine:
            raise HostsError(f"host '{host.name}' has fedhop {theirs} but this launcher is fedhop {mine}: install "
                             f"{mine} there, or let the launcher ship it (launch.ship = \"wheel\")")
    return warnings


def _distinct_hosts(hf: HostsFile) -> list[HostSpec]:
    seen: dict[tuple[str, str, str], HostSpec] = {}
    for h in hf.hosts:
        seen.setdefault((h.remote_name, hf.workdir_of(h), hf.python_of(h)), h)
    return list(seen.values())


def _remote(hf: HostsFile, host: HostSpec, command: str, stdin: bytes, timeout: float) -> subprocess.CompletedProcess:
    argv = remote_argv(hf.remote, host.remote_name, command)
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostsError(f"host '{host.name}': {argv[0]} did not finish within {timeout:.0f} s") from None


def kill_command(hf: HostsFile, role: Role, run: str) -> str:
    """SIGTERM the role's process if the pid file still names it, checked against its command line:
    a client's or edge's names its node id; the server's reads `--run-dir ...` until the process
    titles itself `fedhop server <run>` (common/util/proctitle.py), then that."""
    pidfile = f"{shell_path(run)}/pids/{role.node_id}.pid"
    markers = [role.node_id] if role.kind != "server" else ["--run-dir", "fedhop server "]
    named = " || ".join(f"grep -qaF -- {shlex.quote(m)} /proc/$p/cmdline 2>/dev/null" for m in markers)
    return (f"cd {shell_path(hf.workdir_of(role.host))} && p=$(cat {pidfile} 2>/dev/null) && "
            f"{{ {named}; }} && kill -TERM $p; true")


# ----------------------------------------------------------------------------- the launch
@dataclass
class Started:
    role: Role
    proc: subprocess.Popen
    log: Path
    serving: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None
    reported: str = ""    # the address in its "serving at HOST:PORT" line (the port it bound)


_SERVING = re.compile(r"serving at (\S+?)(?:,|\s|$)")


def reported_port(line: str) -> int | None:
    """The port of a process's "serving at HOST:PORT" line (server, edge and client say it once
    they serve, with the port they bound), or None."""
    m = _SERVING.search(line)
    if m is None:
        return None
    port = m.group(1).rsplit(":", 1)[-1]
    return int(port) if port.isdigit() else None


class RunTls:
    """The TLS material the launcher makes for one run (module docstring): a CA that exists only in
    this process's memory and one certificate per node, CN = node id (peers are verified by node
    id, so the hosts' addresses need not be in them).  `files(node)` is all one role receives."""

    def __init__(self, node_ids: list[str], days: int = 7) -> None:
        from fedhop.common.security.auth import make_ca, make_node_cert  # imports grpc: only when used
        ca_key, self.ca = make_ca(days, name="fedhop launch run CA")
        self._nodes = {n: make_node_cert(ca_key, self.ca, n, (), days) for n in node_ids}

    def files(self, node_id: str) -> list[bytes]:
        """ca.pem, NODE.pem, NODE.key (TLS_FILES' order)."""
        key, cert = self._nodes[node_id]
        return [self.ca, cert, key]


class Launch:
    """The processes of one run across hosts (also what `fedhop netsim` drives)."""

    def __init__(self, hf: HostsFile, cfg: Config, out: Path, roles: list[Role] | None = None,
                 echo: Callable[[str], None] | None = None, remote_run: str | None = None,
                 keep_going: bool = False, shared_fs: bool = False) -> None:
        self.hf = hf
        self.cfg = cfg
        self.out = Path(out)
        self.roles = roles if roles is not None else plan_roles(hf, cfg)
        self.echo = echo
        self.run = remote_run if remote_run is not None else run_path(hf, self.out.name)
        self.keep_going = keep_going
        self.shared_fs = shared_fs   # every host writes straight into OUT (emulated hosts): nothing to gather
        self.authority = TokenAuthority()     # issues each role its own credential (common/security/auth.py)
        self.tls = RunTls([r.node_id for r in self.roles]) if makes_tls(cfg) else None
        self.started: list[Started] = []
        self._echo_lock = threading.Lock()

    # -- processes ------------------------------------------------------------------
    def stdin_of(self, role: Role) -> str:
        """What a role's shell reads first (role_command): its own credential (the launcher keeps
        the issuer's key, so no role can sign for another), its own TLS files when the launcher
        made them (never another node's key, never the CA's), the server's config."""
        text = f"{self.authority.issue(role.node_id)}\n"
        if self.tls is not None:
            for pem in self.tls.files(role.node_id):
                text += pem.decode().rstrip("\n") + f"\n{END_OF_FILE}\n"
        return text + (config_to_toml(server_config(self.cfg, self.run)) if role.kind == "server" else "")

    def _parent_of(self, role: Role) -> str:
        """The address of the role's parent: as planned, with the port its process reported when
        the hosts file left that port to the process (0)."""
        for st in self.started:
            if st.role.node_id == role.parent_node and st.role.port == 0 and st.reported:
                return f"{st.role.host.address}:{st.reported.rsplit(':', 1)[-1]}"
        return role.parent

    def _spawn(self, role: Role) -> Started:
        if role.parent_node:
            role.parent = self._parent_of(role)
        cmd = role_command(self.hf, role, self.cfg, self.run)
        argv = remote_argv(self.hf.remote, role.host.remote_name, cmd)
        log = self.out / "logs" / f"{role.node_id}.log"
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            assert proc.stdin is not None
            proc.stdin.write(self.stdin_of(role).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        st = Started(role, proc, log)
        st.reader = threading.Thread(target=self._pump, args=(st,), daemon=True, name=f"log-{role.node_id}")
        st.reader.start()
        self.started.append(st)
        return st

    def _pump(self, st: Started) -> None:
        prefix = f"[{st.role.host.name} {st.role.node_id}] "
        assert st.proc.stdout is not None
        with open(st.log, "ab") as fh:
            for raw in iter(st.proc.stdout.readline, b""):
                fh.write(raw)
                fh.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                if "serving at" in line and not st.serving.is_set():
                    m = _SERVING.search(line)
                    st.reported = m.group(1) if m else ""
                    st.serving.set()
                if self.echo is not None:
                    with self._echo_lock:
                        self.echo(prefix + line)

    def _wait_serving(self, group: list[Started]) -> None:
        deadline = time.monotonic() + self.hf.start_timeout
        for st in group:
            while not st.serving.wait(0.1):
                if st.proc.poll() is not None:
                    said = refusal_of(st.proc.returncode, st.log, st.role.node_id)
                    raise (RoleRefused if said else RuntimeError)(
                        f"{st.role.node_id} on {st.role.host.name} exited with status {st.proc.returncode} before "
                        f"serving" + (f": {said}" if said else "") + f"; see {st.log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{st.role.node_id} on {st.role.host.name} did not start serving within "
                                       f"{self.hf.start_timeout:.0f}s; see {st.log}")

    def start(self) -> Started:
        """Server first, then the edges once it serves (at the port it reported), then the client
        processes."""
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "config.toml").write_text(config_to_toml(self.cfg))
        server = self._spawn(self.roles[0])
        self._wait_serving([server])
        edges = [self._spawn(r) for r in self.roles if r.kind == "edge"]
        self._wait_serving(edges)
        for r in self.roles:
            if r.kind == "client":
                self._spawn(r)
        return server

    def wait(self, server: Started) -> int:
        """Wait for the server; a child failing first stops the run (unless keep_going)."""
        while server.proc.poll() is None:
            for st in self.started[1:]:
                rc = st.proc.poll()
                if rc not in (None, 0) and not self.keep_going:
                    raise RuntimeError(f"{st.role.node_id} on {st.role.host.name} exited with status {rc}; "
                                       f"last log lines:\n{_tail(st.log)}")
            time.sleep(0.2)
        deadline = time.monotonic() + self.hf.stop_grace
        for st in self.started[1:]:
            try:
                st.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return server.proc.returncode

    def stop(self) -> None:
        """SIGTERM every role still running on its host, then end the local template processes."""
        alive = [st for st in self.started if st.proc.poll() is None]
        kills = []
        for st in alive:
            argv = remote_argv(self.hf.remote, st.role.host.remote_name, kill_command(self.hf, st.role, self.run))
            kills.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        for k in kills:
            try:
                k.wait(15)
            except subprocess.TimeoutExpired:
                k.kill()
        deadline = time.monotonic() + 5.0
        for st in alive:
            try:
                st.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                st.proc.terminate()
                try:
                    st.proc.wait(3)
                except subprocess.TimeoutExpired:
                    st.proc.kill()
                    st.proc.wait()
        for st in self.started:
            if st.reader is not None:
                st.reader.join(2)

    # -- results --------------------------------------------------------------------
    def gather(self) -> list[str]:
        """Copy every host's run directory into OUT (tar through the template); returns problems."""
        problems: list[str] = []
        if self.shared_fs:
            return problems
        seen = set()
        for st in sorted(self.started, key=lambda s: s.role.kind == "server"):  # the server's copy last
            host = st.role.host
            key = (host.remote_name, self.hf.workdir_of(host))
            if key in seen:
                continue
            seen.add(key)
            cmd = gather_command(self.hf, host, self.run)
            argv = remote_argv(self.hf.remote, host.remote_name, cmd)
            try:
                res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
            except subprocess.TimeoutExpired:
                problems.append(f"{host.name}: gathering timed out")
                continue
            problem = unpack_gathered(res.returncode, res.stdout, res.stderr.decode(errors="replace"), self.out)
            if problem:
                problems.append(f"{host.name}: {problem}")
        return problems


SNAPSHOT = ".gathered"   # the consistent copy of run.db that gathering makes beside it
SNAPSHOT_CODE = ("import os, sqlite3, sys\n"
                 "src = os.path.join(sys.argv[1], 'run.db')\n"
                 "if os.path.exists(src):\n"
                 "    a = sqlite3.connect(src, timeout=60); b = sqlite3.connect(src + '" + SNAPSHOT + "')\n"
                 "    a.backup(b); b.close(); a.close()\n")


def gather_command(hf: HostsFile, host: HostSpec, run: str) -> str:
    """The shell command that writes a host's run directory to standard output as a tar.  It first
    waits (up to `stop_grace` seconds) for the roles whose pid files are there to exit, then copies
    run.db with SQLite's backup API (a consistent snapshot even while a stopping server still
    writes: the -wal and -shm files never travel; where the host's python cannot, run.db goes as
    it is) and tars the rest; tar's exit 1, "file changed as we read it" (a ledger a stopping
    process still appends to), still yields an archive.  The roles' TLS files (RUN/creds) are
    removed once the roles ended and never copied."""
    q = shell_path
    wait = max(1, int(hf.stop_grace * 5))
    snap = f"{q(run)}/run.db{SNAPSHOT}"
    tar = f"tar -C {q(run)} --exclude=./{CREDS_DIR} -cf -"   # the roles' keys stay (and end) on the host
    return (f"cd {q(hf.workdir_of(host))} || exit 2; "
            f"for f in {q(run)}/pids/*.pid; do p=$(cat \"$f\" 2>/dev/null) || continue; i=0; "
            f"while [ -n \"$p\" ] && kill -0 \"$p\" 2>/dev/null && [ $i -lt {wait} ]; do "
            f"sleep 0.2 2>/dev/null || sleep 1; i=$((i+1)); done; done; "
            f"rm -rf {q(run)}/{CREDS_DIR}; rm -f {snap}; {q(hf.python_of(host))} -c {shlex.quote(SNAPSHOT_CODE)} {q(run)} >&2; "
            f"if [ -f {snap} ]; then {tar} --exclude=run.db --exclude=run.db-wal --exclude=run.db-shm "
            f"--exclude=run.db-journal .; else {tar} --exclude=run.db-shm .; fi; "   # no snapshot: as it is
            f"rc=$?; rm -f {snap}; exit $rc")


def unpack_gathered(returncode: int, archive: bytes, stderr: str, out: Path) -> str | None:
    """Extract a host's gathered tar into OUT (not its logs: those were streamed), its run.db snapshot
    as OUT/run.db; the problem, or None.  Exit 1 with an archive is tar's "file changed as we
    read it": the archive holds every file, some as they were a moment earlier."""
    if returncode not in (0, 1) or not archive:
        return f"copying back exited {returncode}: {stderr.strip()[-300:]}"
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            members = [m for m in tar.getmembers() if not m.name.lstrip("./").startswith("logs")]
            tar.extractall(out, members=members, filter="data")
    except tarfile.TarError as exc:
        return f"copying back exited {returncode}, unreadable archive ({exc}): {stderr.strip()[-300:]}"
    snapshot = out / f"run.db{SNAPSHOT}"
    if snapshot.exists():
        for stale in ("run.db-wal", "run.db-shm", "run.db-journal"):
            (out / stale).unlink(missing_ok=True)
        snapshot.replace(out / "run.db")
    if returncode == 1:
        return f"tar: {stderr.strip()[-300:]} (copied; those files as they were while being read)"
    return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def refresh_summary(run_dir: Path) -> dict | None:
    """Merge every ledger file in RUN_DIR/ledger into run.db and rewrite summary.json's byte totals and
    sender/receiver agreement: on several machines the server sees only its own ledger at the end."""
    from fedhop.common.records.runstore import RunStore
    from fedhop.server.agreement import ledger_verdict
    summary_path = run_dir / "summary.json"
    db = run_dir / "run.db"
    if not summary_path.exists() or not db.exists():
        return None
    store = RunStore(db, create=False)
    try:
        store.merge_ledger_dir(run_dir / "ledger")   # batch by batch: files that grow with the run
        by_link = store.bytes_by_link()
        agreement = ledger_verdict(store).as_dict()   # explained losses agree (server/agreement.py)
    finally:
        store.close()
    summary = json.loads(summary_path.read_text())
    summary["bytes"] = {"total": by_link.pop("total", None), "by_link": by_link}
    summary["ledger_agreement"] = agreement
    summary_path.write_text(json.dumps(summary, indent=2, default=float))
    return summary


def run_launch(hf: HostsFile, cfg: Config, out: Path, *, quiet: bool = False, keep_going: bool = False,
               remote_run: str | None = None, roles: list[Role] | None = None, show_table: bool = True,
               shared_fs: bool = False) -> int:
    """Start, wait, gather, stop: the exit status (0 completed, 1 failed, 2 a role refused the run as
    it started, 130 interrupted)."""
    echo = None if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    launch = Launch(hf, cfg, out, roles=roles, echo=echo, remote_run=remote_run, keep_going=keep_going,
                    shared_fs=shared_fs)
    status = 1
    problems: list[str] = []
    try:
        server = launch.start()
        status = 0 if launch.wait(server) == 0 else 1
    except KeyboardInterrupt:
        status = 130
    except RuntimeError as exc:
        print(f"fedhop launch: {exc}", file=sys.stderr)
        status = 2 if isinstance(exc, RoleRefused) else 1
    finally:
        # Ctrl-C changes nothing from here: no role is left running on its host, and the run is gathered
        with sigint_ignored():
            if status == 130:
                print("\nfedhop launch: interrupted; stopping every process and gathering the run (Ctrl-C again "
                      "changes nothing)", file=sys.stderr, flush=True)
            launch.stop()
            problems = launch.gather()
    for problem in problems:
        print(f"fedhop launch: gathering: {problem}", file=sys.stderr)
    if status and not (out / "summary.json").exists():   # a server that died recorded no end: the gathered copy says so
        record_server_lost(out, "stopped" if status == 130 else "failed",
                           "the server ended without recording the run's end (see logs/server.log)")
    if refresh_summary(out) is None:
        print(f"fedhop launch: no summary.json in {out}; see {out / 'logs'}", file=sys.stderr)
        return status or 1
    if show_table:
        from fedhop.deploy.launch.launcher import final_table
        print(final_table(out))
    return status


def security_line(cfg: Config) -> str:
    """The one line `fedhop launch` says about the run's channels and credentials at start."""
    sec = cfg.security
    if makes_tls(cfg):
        return ("mutual TLS with per-node credentials made for this run (a CA in this process's memory only; each "
                "host receives its own roles' keys, never another's)")
    if sec.certs_dir:
        return (f"TLS{' (mutual)' if sec.mtls else ''} from security.certs_dir = {sec.certs_dir} on every host, "
                f"with per-node credentials")
    return ("PLAINTEXT gRPC between the hosts (security.insecure = true), per-node credentials: calls travel "
            "unencrypted; drop security.insecure for mutual TLS")


def launch_out_problem(out: str | None) -> str | None:
    """Why `--out` cannot be this launch's run folder: a file there or on the way, a folder that is
    not empty, or a name that cannot name the hosts' run folder (RUN_ROOT/<its last part>: '.', '..'
    or a root would put the run in RUN_ROOT itself or above it)."""
    if out is None:
        return None
    name = Path(out).name
    if name in ("", ".", ".."):
        return (f"--out {out!r}: its last part names the run on the hosts (launch.run_root/<name>); give a folder "
                f"name, e.g. --out runs/my-run")
    return new_folder_problem(out, "--out")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop launch", description="start a run's roles on the hosts of a hosts file")
    ap.add_argument("hosts", help="hosts TOML file (see examples/hosts.toml)")
    ap.add_argument("config", help="experiment TOML file")
    ap.add_argument("--out", help="local run directory, new or empty (default runs/NAME-seedS-TIMESTAMP); its "
                                  "name is the run's folder on the hosts too")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--remote", help="remote command template (overrides launch.remote), e.g. 'ip netns exec {host}'")
    ap.add_argument("--quiet", action="store_true", help="do not echo the processes' output")
    ap.add_argument("--keep-going", action="store_true", help="do not stop the run when a client or edge exits with an error")
    ap.add_argument("--dry-run", action="store_true", help="print the command of every process and exit")
    args = ap.parse_args(argv)
    try:
        hf = load_hosts(args.hosts)
        if args.remote is not None:
            problem = remote_problem(args.remote)
            if problem:
                raise HostsError(f"--remote {args.remote!r}: {problem}")
            hf.remote = args.remote
        cfg = load_config(args.config, args.overrides)
        roles = plan_roles(hf, cfg)
    except (HostsError, ConfigError, OSError) as exc:
        print(f"fedhop launch: {exc}", file=sys.stderr)
        return 2
    engine_problem = process_launch_problem(cfg, "fedhop launch")
    if engine_problem:
        print(engine_problem, file=sys.stderr)
        return 2
    refusal = plaintext_refusal([bind_address(r) for r in roles], cfg.security.insecure,
                                tls=bool(cfg.security.certs_dir) or makes_tls(cfg), who="launch")
    if refusal:   # every role would refuse on its host: say so before starting any
        print(f"fedhop launch: {refusal}", file=sys.stderr)
        return 2
    problem = launch_out_problem(args.out)
    if problem:
        print(f"fedhop launch: {problem}", file=sys.stderr)
        return 2
    print(f"fedhop launch: {security_line(cfg)}", file=sys.stderr)
    from fedhop.deploy.launch.launcher import default_run_dir
    if args.out or not args.dry_run:
        out = Path(args.out) if args.out else default_run_dir(cfg)
    else:   # a dry run makes nothing: the name a run folder would have
        out = Path("runs") / f"{cfg.run.name}-seed{cfg.run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    made = not out.exists()   # removed again, when left empty, by a refusal below
    if hf.ship and not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    try:
        if hf.ship and not args.dry_run:
            ship(hf, out)
        elif hf.ship:
            hf.python = f"{hf.venv.rstrip('/')}/bin/python"
        for warning in [] if args.dry_run else check_versions(hf):
            print(f"fedhop launch: warning: {warning}", file=sys.stderr)
    except HostsError as exc:
        print(f"fedhop launch: {exc}", file=sys.stderr)
        if made:
            with contextlib.suppress(OSError):   # not empty: what ship() wrote before it failed stays
                out.rmdir()
        return 2
    if args.dry_run:
        run = run_path(hf, out.name)
        for r in roles:
            where = r.address if r.port else f"{r.host.address}, a port it binds and reports"
            parent = f"; its parent's port: the one {r.parent_node} reports" if r.parent.endswith(":0") else ""
            print(f"# {r.node_id} on {r.host.name} ({where})" + (f" clients {r.clients}" if r.clients else "") + parent)
            print(shlex.join(remote_argv(hf.remote, r.host.remote_name, role_command(hf, r, cfg, run))))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    return run_launch(hf, cfg, out, quiet=args.quiet, keep_going=args.keep_going, roles=roles)


if __name__ == "__main__":
    sys.exit(main())
