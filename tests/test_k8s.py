"""deploy/k8s: every kustomization renders with `kubectl kustomize`, validates against the
Kubernetes schemas (kubernetes-validate, strict), and is a run that ends: the server a Job
(backoffLimit 0, restartPolicy Never, activeDeadlineSeconds: `fedhop k8s`'s default, so a pod that
never starts cannot keep its Job open), one Job per client process and per edge whose slots match
the config's process plan (the quick try's clients an Indexed Job); every object and pod carries
the common label and the built image; every pod meets the "restricted" Pod Security Standard.
Per-node credentials are the default: in the base and every overlay but the quick try, each pod
mounts one required Secret, named for its own node, and runs mutual TLS; node-secrets.sh puts only
that node's files in it (no CA key, no issuer key, no shared secret, no other node's key); the
shared-token mode is only in overlays/quick-try."""
from __future__ import annotations

import base64
import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.security.nodecred import SignedIdentity
from fedhop.common.topologies.plan import plan_processes
from fedhop.deploy.launch.k8s_render import DEFAULT_DEADLINE_S

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (it is in the dev extra)")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (kubectl kustomize renders)")
KUSTOMIZATIONS = ["base", "overlays/hierarchical", "overlays/tls", "overlays/gpu", "overlays/rwo", "overlays/quick-try"]
PER_NODE = [k for k in KUSTOMIZATIONS if k != "overlays/quick-try"]   # mutual TLS, a Secret per pod
K8S_VERSION = "1.31"
PART_OF = ("app.kubernetes.io/part-of", "fedhop")
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def render(path: str) -> list[dict]:
    res = subprocess.run([KUBECTL, "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def env_of(docs: list[dict]) -> dict[str, str]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("fedhop-env")]
    return cm["data"]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Job", "Deployment", "StatefulSet")]


def pod_specs(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in workloads(docs)]


def restricted_violations(spec: dict) -> list[str]:
    """What keeps a pod spec from the "restricted" Pod Security Standard (its checks that manifests decide)."""
    out = []
    pod = spec.get("securityContext", {})
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", pod.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities")
        seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        out.append("host namespaces")
    if any("hostPath" in v for v in spec.get("volumes", [])):
        out.append("hostPath volume")
    return out


def config_of(env: dict[str, str], processes: int):
    return load_config(str(ROOT / env["FEDHOP_CONFIG"].removeprefix("/app/")),
                       shlex.split(env["FEDHOP_SET"]) + [f"clients.processes={processes}"])


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_overlay_renders_validates_and_is_labelled_built_and_restricted(path):
    docs = render(path)
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)
    kinds = by_kind(docs)
    assert ("Job", "server") in kinds and ("Service", "server") in kinds
    assert ("PersistentVolumeClaim", "fedhop-runs") in kinds and ("Deployment", "results") in kinds
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"] == ["results"]
    tag = "fedhop:cuda" if path.endswith("gpu") else "fedhop:cpu"
    for d in docs:
        assert d["metadata"]["labels"][PART_OF[0]] == PART_OF[1], (d["kind"], d["metadata"]["name"])
    for w in workloads(docs):
        assert w["spec"]["template"]["metadata"]["labels"][PART_OF[0]] == PART_OF[1], w["metadata"]["name"]
        spec = w["spec"]["template"]["spec"]
        assert restricted_violations(spec) == [], (w["metadata"]["name"], restricted_violations(spec))
        assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["fsGroup"] == 10001
        for c in spec["containers"]:
            assert c["image"] == tag, (w["metadata"]["name"], c["image"])
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
            assert c["volumeMounts"][0]["name"] == "runs" and c["volumeMounts"][0]["mountPath"] == "/runs"
        if w["kind"] == "Job":
            assert w["spec"]["backoffLimit"] == 0 and spec["restartPolicy"] == "Never", w["metadata"]["name"]
            assert w["spec"]["activeDeadlineSeconds"] == DEFAULT_DEADLINE_S, w["metadata"]["name"]
            assert "FEDHOP_HOLD" not in str(spec)
    assert "FEDHOP_HOLD" not in env_of(docs)   # roles end with the run (deploy/launch/role.py)


@needs_kubectl
def test_the_restricted_check_finds_what_breaks_the_profile():
    docs = render("base")
    spec = by_kind(docs)[("Job", "server")]["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    for edit, needle in ((lambda s: s["securityContext"].pop("seccompProfile") and
                          s["containers"][0]["securityContext"].pop("seccompProfile"), "seccompProfile"),
                         (lambda s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
                          "allowPrivilegeEscalation"),
                         (lambda s: s["containers"][0]["securityContext"].update(capabilities={"drop": ["NET_RAW"]}),
                          "capabilities"),
                         (lambda s: s["securityContext"].update(runAsNonRoot=False) or
                          s["containers"][0]["securityContext"].pop("runAsNonRoot"), "runAsNonRoot")):
        broken = copy.deepcopy(spec)
        edit(broken)
        assert any(needle in v for v in restricted_violations(broken)), needle


@needs_kubectl
def test_the_validator_rejects_a_broken_manifest():
    docs = render("base")
    broken = copy.deepcopy(by_kind(docs)[("Job", "client-proc0")])
    broken["spec"]["backoffLimit"] = "none"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(by_kind(docs)[("Job", "server")])
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(unknown, K8S_VERSION, strict=True)
    deadline = copy.deepcopy(by_kind(docs)[("Job", "server")])
    deadline["spec"]["activeDeadlineSeconds"] = "24h"
    with pytest.raises(kv.ValidationError):
        kv.validate(deadline, K8S_VERSION, strict=True)


def slot_of(container: dict) -> str | dict:
    """A client container's FEDHOP_SLOT: a fixed value, or the Indexed Job's fieldRef."""
    slot = next(e for e in container["env"] if e["name"] == "FEDHOP_SLOT")
    return slot["value"] if "value" in slot else slot["valueFrom"]["fieldRef"]["fieldPath"]


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_client_and_edge_jobs_are_the_process_plan(path):
    """Client process K is Job client-procK with FEDHOP_SLOT=K (one Job each, so each mounts its own
    Secret), K over the plan's client processes = FEDHOP_CLIENT_PROCESSES; edge E is Job edge-E with
    host name edge-E in subdomain edge.  Only the quick try keeps the Indexed Job of the shared
    token (index K hosts block K)."""
    docs = render(path)
    kinds = by_kind(docs)
    env = env_of(docs)
    plan = plan_processes(config_of(env, int(env["FEDHOP_CLIENT_PROCESSES"])))
    n = len(plan.clients)
    assert n == int(env["FEDHOP_CLIENT_PROCESSES"])
    server = kinds[("Job", "server")]
    assert "completionMode" not in server["spec"] and server["spec"].get("completions", 1) == 1
    clients = [w for w in workloads(docs) if w["spec"]["template"]["metadata"]["labels"].get(
        "app.kubernetes.io/component") == "client"]
    indexed = {n_ for k, n_ in kinds if k == "Job" and kinds[(k, n_)]["spec"].get("completionMode") == "Indexed"}
    if path == "overlays/quick-try":
        assert indexed == {"client"}
        (client,) = clients
        (c,) = client["spec"]["template"]["spec"]["containers"]
        assert slot_of(c) == INDEX
        assert client["spec"]["completions"] == client["spec"]["parallelism"] == n
    else:
        assert indexed == set()
        assert sorted(w["metadata"]["name"] for w in clients) == sorted(p.node_id for p in plan.clients)
        for w in clients:
            (c,) = w["spec"]["template"]["spec"]["containers"]
            assert plan.clients[int(slot_of(c))].node_id == w["metadata"]["name"]
            assert w["spec"].get("completions", 1) == 1 and "completionMode" not in w["spec"]
    if path.endswith("hierarchical"):
        edges = sorted((w for w in workloads(docs) if w["metadata"]["name"].startswith("edge-")),
                       key=lambda w: w["metadata"]["name"])
        assert [w["metadata"]["name"] for w in edges] == [e.node_id for e in plan.edges] == ["edge-0", "edge-1"]
        for w in edges:
            spec = w["spec"]["template"]["spec"]
            node = w["metadata"]["name"]
            assert spec["hostname"] == node and spec["subdomain"] == "edge" == kinds[("Service", "edge")]["metadata"]["name"]
            args = spec["containers"][0]["args"]
            # pod hostname edge-E in subdomain edge: edge-E.edge is where the clients look for edge E
            assert args[args.index("--node-id") + 1] == node
            assert args[args.index("--listen") + 1] == f"{node}.edge:7100"
        assert kinds[("Service", "edge")]["spec"]["publishNotReadyAddresses"] is True
        for w in clients:
            assert "edge-{edge}.edge:7100" in w["spec"]["template"]["spec"]["containers"][0]["args"]
    if path.endswith("rwo") or path.endswith("quick-try"):
        assert kinds[("PersistentVolumeClaim", "fedhop-runs")]["spec"]["accessModes"] == ["ReadWriteOnce"]
        for w in workloads(docs):
            (term,) = w["spec"]["template"]["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            assert term["labelSelector"]["matchLabels"] == dict([PART_OF])
    else:
        assert kinds[("PersistentVolumeClaim", "fedhop-runs")]["spec"]["accessModes"] == ["ReadWriteMany"]


def node_of(workload: dict, plan) -> str:
    """The node id a pod of this workload runs as: the server, an edge (--node-id) or client
    process FEDHOP_SLOT of the plan."""
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    if "server" in c["args"]:
        return "server"
    if "edge" in c["args"]:
        return c["args"][c["args"].index("--node-id") + 1]
    return plan.clients[int(slot_of(c))].node_id


@needs_kubectl
@pytest.mark.parametrize("path", PER_NODE)
def test_every_pod_mounts_only_its_own_required_node_secret_and_runs_mutual_tls(path):
    """The default of every kustomization but the quick try: mutual TLS (FEDHOP_MTLS=1, the
    certificate folder /certs, never FEDHOP_INSECURE) and one required Secret per pod, named for
    that pod's node; every process of the plan once."""
    docs = render(path)
    env = env_of(docs)
    assert (env["FEDHOP_INSECURE"], env["FEDHOP_CERTS_DIR"], env["FEDHOP_MTLS"]) == ("0", "/certs", "1"), path
    assert env.get("FEDHOP_SECURITY") == "mtls" and "FEDHOP_TOKEN" not in env
    plan = plan_processes(config_of(env, int(env["FEDHOP_CLIENT_PROCESSES"])))
    seen = []
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        secrets = [v["secret"] for v in spec["volumes"] if "secret" in v]
        if w["metadata"]["name"] == "results":   # runs nothing of the run's: no credentials at all
            assert secrets == [] and "envFrom" not in spec["containers"][0]
            continue
        node = node_of(w, plan)
        assert secrets == [{"secretName": f"fedhop-node-{node}", "optional": False, "defaultMode": 0o440}], node
        assert {"name": "certs", "mountPath": "/certs", "readOnly": True} in spec["containers"][0]["volumeMounts"]
        assert not [e for e in spec["containers"][0].get("env", []) if e["name"] in (
            "FEDHOP_INSECURE", "FEDHOP_MTLS", "FEDHOP_CERTS_DIR", "FEDHOP_TOKEN", "FEDHOP_SECURITY")], node
        seen.append(node)
    assert sorted(seen) == sorted(plan.node_ids)   # every process of the plan, once


@needs_kubectl
def test_the_shared_token_mode_is_only_the_named_quick_try():
    """overlays/quick-try is the one kustomization without per-node credentials: plaintext with
    the run's shared token, named FEDHOP_SECURITY=shared-token, no Secret, every pod on one node."""
    docs = render("overlays/quick-try")
    env = env_of(docs)
    assert (env["FEDHOP_INSECURE"], env["FEDHOP_CERTS_DIR"], env["FEDHOP_MTLS"]) == ("1", "", "0")
    assert env["FEDHOP_SECURITY"] == "shared-token"
    assert not [v for s in pod_specs(docs) for v in s["volumes"] if "secret" in v]
    text = (K8S / "overlays" / "quick-try" / "kustomization.yaml").read_text()
    assert "SHARED-TOKEN QUICK TRY" in text and "one node" in text
    for path in PER_NODE:
        other = env_of(render(path))
        assert other["FEDHOP_INSECURE"] == "0" and other.get("FEDHOP_SECURITY") != "shared-token", path


@needs_kubectl
def test_node_secrets_hold_only_the_nodes_own_files(tmp_path):
    """node-secrets.sh on a real `fedhop certs` folder: each Secret holds ca.pem, NODE.pem, NODE.key
    and NODE.cred, never ca.key, issuer.key or cluster.secret (the shared token), also for a folder
    without NODE.cred; a reserved name (whose files are the cluster's own) is refused."""
    docs = render("overlays/hierarchical")
    env = env_of(docs)
    plan = plan_processes(config_of(env, int(env["FEDHOP_CLIENT_PROCESSES"])))
    from fedhop.deploy.launch.certs import main as certs_main
    assert certs_main([str(tmp_path / "certs"), "--nodes", ",".join(plan.node_ids)]) == 0
    assert (tmp_path / "certs" / "cluster.secret").exists() and (tmp_path / "certs" / "issuer.key").exists()
    res = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), *plan.node_ids],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    made = {d["metadata"]["name"]: d["data"] for d in yaml.safe_load_all(res.stdout) if d}
    assert sorted(made) == sorted(f"fedhop-node-{n}" for n in plan.node_ids)
    for node in plan.node_ids:
        data = made[f"fedhop-node-{node}"]
        assert sorted(data) == sorted(["ca.pem", f"{node}.pem", f"{node}.key", f"{node}.cred"]), node
        assert base64.b64decode(data[f"{node}.key"]) == (tmp_path / "certs" / f"{node}.key").read_bytes()
        assert SignedIdentity.parse(base64.b64decode(data[f"{node}.cred"]).decode()).node_id == node
    # a folder without the node's credential: its certificate alone (mutual TLS), never the shared secret
    (tmp_path / "certs" / f"{plan.node_ids[0]}.cred").unlink()
    res = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), plan.node_ids[0]],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (bare,) = [d["data"] for d in yaml.safe_load_all(res.stdout) if d]
    assert sorted(bare) == sorted(["ca.pem", f"{plan.node_ids[0]}.pem", f"{plan.node_ids[0]}.key"])
    bad = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), "edge-7"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "edge-7.pem" in bad.stderr
    for reserved in ("ca", "issuer", "CA"):   # ca.pem and ca.key exist: "ca" would ship the CA's key
        res = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), reserved],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "reserved" in res.stderr and res.stdout == "", reserved


@needs_kubectl
def test_gpu_overlay_asks_one_gpu_per_server_and_client():
    kinds = by_kind(render("overlays/gpu"))
    for name in ("server", "client-proc0", "client-proc1"):
        (c,) = kinds[("Job", name)]["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "FEDHOP_DEVICE", "value": "cuda"} in c["env"]
    for spec in pod_specs(render("base")):
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"].get("limits", {})


@pytest.mark.parametrize("recorded, expected", [("0\n", 0), ("3\n", 3), (None, 0)])
def test_a_member_role_leaves_with_the_runs_status(tmp_path, recorded, expected):
    """What ends a client or edge Job: once its process ended normally, the role exits with the
    status the server's role recorded in RUN/server.exit (0 when none appeared in time)."""
    import signal

    from fedhop.deploy.launch.role import SERVER_EXIT, linger_until_server_exits
    if recorded is not None:
        (tmp_path / SERVER_EXIT).write_text(recorded)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert linger_until_server_exits(tmp_path, 0.3) == expected
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("security, needle", [
    ({"FEDHOP_INSECURE": "0"}, "FEDHOP_INSECURE=1"),                      # plaintext off loopback
    ({"FEDHOP_MTLS": "1"}, "FEDHOP_CERTS_DIR"),                           # mutual TLS without a folder
    ({"FEDHOP_MTLS": "1", "FEDHOP_CERTS_DIR": "{certs}"}, "server.pem"),  # a folder without the node's Secret
])
def test_a_role_that_could_not_start_is_refused_before_it_announces_a_run(tmp_path, security, needle):
    """deploy/launch/role.py server on 0.0.0.0 (what the Job runs): a security setting its process would
    refuse ends the role with one line and status 2 before it makes a run folder or writes
    RUNS/current, so no client joins a run that cannot happen."""
    import os
    import sys
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.pem").write_text("not used")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHOP_")}
    env.update(FEDHOP_RUNS=str(tmp_path / "runs"), FEDHOP_CONFIG=str(ROOT / "examples" / "fedavg_digits.toml"),
               FEDHOP_CLIENT_PROCESSES="2", PYTHONPATH=str(ROOT))
    env.update({k: v.format(certs=tmp_path / "certs") for k, v in security.items()})
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.launch.role", "server", "--listen", "0.0.0.0:7000"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and "refusing to start" in res.stderr, res.stderr
    assert needle in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []   # no run announced
