"""`fedhop k8s CONFIG --out DIR`: Kubernetes manifests for the user's own experiment, rendered from
its config, with no clone needed (issue 45, item 5).

    fedhop k8s my.toml --out k8s-run                 # k8s-run/fedhop.yaml: kubectl apply -f k8s-run/fedhop.yaml
    fedhop k8s my.toml --out k8s-run --certs certs   # ... and each node's Secret from a `fedhop certs` folder
    fedhop k8s my.toml --out k8s-run --file mymodels.py   # a plug-in module beside the config, shipped too

What it writes is what deploy/k8s/base holds, sized to the config: the config file (and the plug-in
files named with --file) in a ConfigMap, `fedhop-config`, that every pod mounts read-only at
/config; the server Job and its Service; one Job per planned edge (hostname edge-E, subdomain edge,
and the headless Service `edge`) and per planned client process (client-procK, FEDHOP_SLOT=K),
from the same process plan `fedhop run` starts (common/topologies/plan.py); the run volume; a
`results` Deployment to copy the run from.  Every pod runs mutual TLS with per-node credentials:
it mounts only its own Secret fedhop-node-NODE (ca.pem, NODE.pem, NODE.key), which `--certs DIR`
renders from a `fedhop certs` folder (never the CA or issuer key, never another node's files), or
which the user makes as docs/kubernetes.md says.  A fedhop.yaml holding Secrets is created mode
0600 in a folder of mode 0700, as the other generators keep keys.  Every Job fails once open for
activeDeadlineSeconds (`--deadline`, default 24 h), so a pod that never starts cannot keep its
Job open.  Every pod meets the "restricted" Pod Security Standard.  The file is JSON documents
separated by `---` (valid YAML, so kubectl reads it, and no YAML library is needed);
tests/test_k8s_render.py validates it against the Kubernetes schemas.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from fedhop.common.util.cliparser import ArgumentParser
from fedhop.common.util.plugins import config_plugins

LABEL = {"app.kubernetes.io/part-of": "fedhop"}
UID = 10001
CONFIG_MOUNT = "/config"
PORTS = {"server": 7000, "edge": 7100, "client": 7200}
RESERVED = ("ca", "issuer", "cluster", "fedhop-node", "register")
CONFIGMAP_LIMIT = 900 * 1024      # a ConfigMap holds at most 1 MiB
# Every Job's activeDeadlineSeconds (deploy/k8s/base uses the same): a Pending pod (missing Secret,
# image pull failure, unbound volume) does not count against backoffLimit, so without a deadline
# its Job would stay open for ever.  A run longer than this needs --deadline.
DEFAULT_DEADLINE_S = 24 * 3600

# A Kubernetes resource quantity with a positive value (apimachinery's resource.Quantity grammar:
# a decimal number, then a binary-SI, decimal-SI or exponent suffix)
QUANTITY = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)(?:[KMGTPE]i|[mkMGTPE]|[eE][+-]?\d+)?", re.ASCII)
# An image reference ([registry[:port]/]path[:tag][@digest]), the grammar of distribution/reference
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::[\w][\w.-]{{0,127}})?"
                   rf"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}})?", re.ASCII)


class RenderError(ValueError):
    """Something the manifests cannot be made from: one line, exit status 2."""


def _labels(name: str, component: str) -> dict[str, str]:
    return {**LABEL, "app.kubernetes.io/name": name, "app.kubernetes.io/component": component}


def _restricted_container(name: str, image: str, args: list[str], port: int, slot: int | None,
                          requests: dict[str, str], limit: str) -> dict[str, Any]:
    env = [{"name": "FEDHOP_SLOT", "value": str(slot)}] if slot is not None else []
    return {
        "name": name, "image": image, "args": args,
        "envFrom": [{"configMapRef": {"name": "fedhop-env"}}], "env": env,
        "ports": [{"name": "grpc", "containerPort": port}],
        "resources": {"requests": requests, "limits": {"memory": limit}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "runs", "mountPath": "/runs"},
                         {"name": "certs", "mountPath": "/certs", "readOnly": True},
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }


def _pod_security() -> dict[str, Any]:
    return {"runAsUser": UID, "runAsGroup": UID, "runAsNonRoot": True, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _volumes(node: str) -> list[dict[str, Any]]:
    return [{"name": "runs", "persistentVolumeClaim": {"claimName": "fedhop-runs"}},
            {"name": "certs", "secret": {"secretName": f"fedhop-node-{node}", "optional": False,
                                         "defaultMode": 0o440}},
            {"name": "config", "configMap": {"name": "fedhop-config"}}]


def role_job(node: str, kind: str, image: str, args: list[str], slot: int | None = None,
             edge_host: bool = False, deadline: int = DEFAULT_DEADLINE_S) -> dict[str, Any]:
    """One process of the plan as a Job that ends with the run (backoffLimit 0, restartPolicy Never),
    or after `deadline` seconds whatever its pod does (activeDeadlineSeconds)."""
    labels = _labels(f"fedhop-{kind}", kind)
    requests = {"cpu": "250m", "memory": "512Mi"} if kind == "edge" else {"cpu": "500m", "memory": "768Mi"}
    pod: dict[str, Any] = {
        "restartPolicy": "Never", "securityContext": _pod_security(),
        "containers": [_restricted_container(kind, image, args, PORTS[kind], slot, requests,
                                             "1Gi" if kind == "edge" else "2Gi")],
        "volumes": _volumes(node)}
    if kind == "server":
        pod["terminationGracePeriodSeconds"] = 30
        pod["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": PORTS[kind]}, "periodSeconds": 2}
    if edge_host:
        pod.update(hostname=node, subdomain="edge")
        pod["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": PORTS[kind]}, "periodSeconds": 2}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": node, "labels": labels},
            "spec": {"backoffLimit": 0, "activeDeadlineSeconds": deadline,
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def service(name: str, selector: str, port: int, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"app.kubernetes.io/name": selector}, "publishNotReadyAddresses": True,
                            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc"}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": dict(LABEL)}, "spec": spec}


def results_deployment(image: str) -> dict[str, Any]:
    labels = _labels("fedhop-results", "results")
    container = {"name": "results", "image": image, "args": ["sleep", "infinity"],
                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                     "runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "volumeMounts": [{"name": "runs", "mountPath": "/runs", "readOnly": True}]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "results", "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "fedhop-results"}},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"securityContext": _pod_security(), "terminationGracePeriodSeconds": 1,
                                           "containers": [container],
                                           "volumes": [{"name": "runs", "persistentVolumeClaim":
                                                        {"claimName": "fedhop-runs"}}]}}}}


def node_secret(certs: Path, node: str) -> dict[str, Any]:
    """The Secret fedhop-node-NODE from a `fedhop certs` folder: ca.pem and the node's own files."""
    names = ["ca.pem", f"{node}.pem", f"{node}.key"] + ([f"{node}.cred"] if (certs / f"{node}.cred").is_file() else [])
    data = {}
    for name in names:
        path = certs / name
        if not path.is_file():
            raise RenderError(f"--certs {certs}: {path} is missing (make it with `fedhop certs {certs} --nodes ...`)")
        content = path.read_bytes()
        problem = pem_problem(name, content)
        if problem:   # the pod would only fail when it starts, on the cluster
            raise RenderError(f"--certs {certs}: {path} {problem} (make it with `fedhop certs {certs} --nodes ...`)")
        data[name] = base64.b64encode(content).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"fedhop-node-{node}", "labels": dict(LABEL)}, "data": data}


def pem_problem(name: str, content: bytes) -> str | None:
    """Why a `fedhop certs` file is not what its name says: a .pem a PEM certificate, a .key an
    unencrypted PEM private key (a .cred is fedhop's own line, checked by the node that reads it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    try:
        if name.endswith(".pem"):
            x509.load_pem_x509_certificate(content)
        elif name.endswith(".key"):
            serialization.load_pem_private_key(content, password=None)
    except (ValueError, TypeError):
        return "is not a PEM certificate" if name.endswith(".pem") else "is not an unencrypted PEM private key"
    return None


def check_options(image: str, storage: str, deadline: str) -> int:
    """--image, --storage and --deadline as Kubernetes takes them; the deadline in seconds."""
    if not IMAGE.fullmatch(image):
        raise RenderError(f"--image {image!r}: not an image reference ([REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], "
                          f"NAME lower case)")
    quantity = QUANTITY.fullmatch(storage)
    if quantity is None or float(quantity["number"]) <= 0:
        raise RenderError(f"--storage {storage!r}: not a positive Kubernetes quantity (e.g. 2Gi, 500Mi, 10G)")
    if not re.fullmatch(r"[0-9]+", deadline) or not 1 <= int(deadline) < 2**63:
        raise RenderError(f"--deadline {deadline!r}: a whole number of seconds, at least 1")
    return int(deadline)


def render(config: Path, image: str = "fedhop:cpu", certs: Path | None = None, files: tuple[Path, ...] = (),
           overrides: tuple[str, ...] = (), storage: str = "2Gi",
           deadline: int = DEFAULT_DEADLINE_S) -> list[dict[str, Any]]:
    """Every object of the run, in the order `kubectl apply` should create them."""
    from fedhop.common.config import ConfigError, load_config
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.deploy.launch.engine import process_launch_problem
    try:
        cfg = load_config(config, list(overrides))
        plan = plan_processes(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        raise RenderError(str(exc)) from None
    engine_problem = process_launch_problem(cfg, "fedhop k8s")
    if engine_problem:
        raise RenderError(engine_problem)
    if cfg.security.insecure:
        raise RenderError(f"{config}: security.insecure = true: the Kubernetes manifests run mutual TLS with "
                          f"per-node credentials only (the one-node shared-token try is deploy/k8s/overlays/quick-try)")
    shipped = {config.name: config.read_text()}
    for f in files:
        if not f.is_file():
            raise RenderError(f"--file {f}: no such file")
        if f.name in shipped:
            raise RenderError(f"--file {f}: a second file named {f.name}")
        try:
            shipped[f.name] = f.read_text()
        except UnicodeDecodeError as exc:
            raise RenderError(f"--file {f}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                              f"a ConfigMap holds text: bake other files into the image") from None
    if sum(len(t.encode()) for t in shipped.values()) > CONFIGMAP_LIMIT:
        raise RenderError(f"the config and --file files hold more than {CONFIGMAP_LIMIT} bytes: a ConfigMap holds "
                          f"at most 1 MiB; bake larger files into the image")
    nodes = plan.node_ids
    bad = [n for n in nodes if n.lower() in RESERVED]
    if bad:
        raise RenderError(f"node id {bad[0]!r} is reserved")
    # deploy/launch/role.py reads FEDHOP_SET with shlex.split: quoted, each override comes back whole
    env = {"FEDHOP_CONFIG": f"{CONFIG_MOUNT}/{config.name}", "FEDHOP_SET": shlex.join(overrides),
           "FEDHOP_RUNS": "/runs", "FEDHOP_CLIENT_PROCESSES": str(len(plan.clients)),
           "FEDHOP_INSECURE": "0", "FEDHOP_CERTS_DIR": "/certs", "FEDHOP_MTLS": "1", "FEDHOP_SECURITY": "mtls",
           "FEDHOP_PLUGIN_PATH": CONFIG_MOUNT}
    plugins = config_plugins(cfg)
    if plugins:
        env["FEDHOP_ALLOW_PLUGINS"] = ",".join(plugins)
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fedhop-config", "labels": dict(LABEL)},
         "data": shipped},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fedhop-env", "labels": dict(LABEL)},
         "data": env},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "fedhop-runs", "labels": dict(LABEL)},
         "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}}},
    ]
    if certs is not None:
        docs += [node_secret(certs, n) for n in nodes]
    docs += [role_job("server", "server", image, ["python", "-m", "fedhop.deploy.launch.role", "server", "--listen",
                                                  f"0.0.0.0:{PORTS['server']}"], deadline=deadline),
             service("server", "fedhop-server", PORTS["server"])]
    for edge in plan.edges:
        docs.append(role_job(edge.node_id, "edge", image, [
            "python", "-m", "fedhop.deploy.launch.role", "edge", "--node-id", edge.node_id, "--parent",
            f"server:{PORTS['server']}", "--listen", f"{edge.node_id}.edge:{PORTS['edge']}"], edge_host=True,
            deadline=deadline))
    if plan.edges:
        docs.append(service("edge", "fedhop-edge", PORTS["edge"], headless=True))
    for k, proc in enumerate(plan.clients):
        docs.append(role_job(proc.node_id, "client", image, [
            "python", "-m", "fedhop.deploy.launch.role", "client", "--server", f"server:{PORTS['server']}",
            "--edge", f"edge-{{edge}}.edge:{PORTS['edge']}", "--port", str(PORTS["client"])], slot=k,
            deadline=deadline))
    docs.append(results_deployment(image))
    return docs


def holds_secrets(docs: list[dict[str, Any]]) -> bool:
    """Whether the objects carry node keys and credentials (--certs): the file is then private."""
    return any(d["kind"] == "Secret" for d in docs)


def write(docs: list[dict[str, Any]], out: Path) -> Path:
    """OUT/fedhop.yaml.  With Secrets (every node's private key and credential) the folder is made,
    or set, 0700 and the file is created 0600 before anything is written to it; without, both
    follow the umask.  The text lands in a new file under a temporary name that replaces
    fedhop.yaml, so an earlier file's mode never carries over and no reader sees half a file."""
    private = holds_secrets(docs)
    out.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    if private:
        out.chmod(0o700)          # mkdir's mode is masked by the umask, and the folder may exist
    path = out / "fedhop.yaml"
    tmp = out / f".fedhop.yaml.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(f"---\n{json.dumps(d, indent=1)}\n" for d in docs))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop k8s", description="Kubernetes manifests for an experiment: the "
                                                               "config in a ConfigMap, a Job per planned process, "
                                                               "mutual TLS with per-node Secrets")
    ap.add_argument("config", help="the experiment's TOML file")
    ap.add_argument("--out", required=True, help="folder for fedhop.yaml (created)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override, passed to every role (repeatable)")
    ap.add_argument("--certs", help="a `fedhop certs` folder: also render each node's Secret from it")
    ap.add_argument("--file", dest="files", action="append", default=[], metavar="FILE",
                    help="a file the config needs (a plug-in module), shipped in the ConfigMap beside it")
    ap.add_argument("--image", default="fedhop:cpu", help="the image every pod runs (default fedhop:cpu)")
    ap.add_argument("--storage", default="2Gi", help="the run volume's size, a Kubernetes quantity (default 2Gi)")
    ap.add_argument("--deadline", default=str(DEFAULT_DEADLINE_S), metavar="SECONDS",
                    help=f"every Job's activeDeadlineSeconds: the Job fails after this long, a pod that never "
                         f"started included (default {DEFAULT_DEADLINE_S}, 24 h)")
    args = ap.parse_args(argv)
    if not args.out.strip():   # "" would be the folder the command runs in
        ap.error(f"--out {args.out!r}: name a folder for fedhop.yaml")
    try:
        deadline = check_options(args.image, args.storage, args.deadline)
        docs = render(Path(args.config), args.image, Path(args.certs) if args.certs else None,
                      tuple(Path(f) for f in args.files), tuple(args.overrides), args.storage, deadline)
        path = write(docs, Path(args.out))
    except RenderError as exc:
        print(f"fedhop k8s: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fedhop k8s: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    nodes = [d["metadata"]["name"] for d in docs if d["kind"] == "Job"]
    kept = " (mode 0600 in a 0700 folder: it holds every node's private key as a Secret)" if holds_secrets(docs) else ""
    print(f"wrote {path}{kept}: {len(docs)} objects, Jobs {', '.join(nodes)} (each fails if still open "
          f"after {deadline} s: --deadline)")
    if not args.certs:
        print(f"next: fedhop certs certs --nodes {','.join(nodes)} and render again with --certs certs "
              f"(or make each Secret fedhop-node-NODE as docs/kubernetes.md says); then kubectl apply -f {path}",
              file=sys.stderr)
    else:
        print(f"next: kubectl apply -f {path}", file=sys.stderr)
    return 0
