"""deploy/k8s: every kustomization renders with `kubectl kustomize`, validates against the
Kubernetes schemas (kubernetes-validate, strict), and is a run that ends: the server a Job
(backoffLimit 0, restartPolicy Never), the clients an Indexed Job whose completions and index
match the config's process plan, the edges an Indexed Job of topology.edges pods; every object
and pod carries the common label and the built image; every pod meets the "restricted" Pod
Security Standard; the tls overlay mounts one required Secret per node, named for the pod's own
node, and node-secrets.sh puts only that node's files in it (no CA key, no other node's key)."""
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

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (it is in the dev extra)")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (kubectl kustomize renders)")
KUSTOMIZATIONS = ["base", "overlays/hierarchical", "overlays/tls", "overlays/gpu", "overlays/rwo"]
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
            assert "FEDHOP_HOLD" not in str(spec)
    assert "FEDHOP_HOLD" not in env_of(docs)   # roles end with the run (deploy/role.py)


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
    broken = copy.deepcopy(by_kind(docs)[("Job", "client")])
    broken["spec"]["completions"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(by_kind(docs)[("Job", "server")])
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(unknown, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("path, indexed", [("base", {"client"}), ("overlays/hierarchical", {"client", "edge"}),
                                           ("overlays/rwo", {"client"}), ("overlays/gpu", {"client"})])
def test_job_indexes_are_the_process_plan(path, indexed):
    """Client index K hosts client-procK of the plan: completions = parallelism = the plan's client
    processes = FEDHOP_CLIENT_PROCESSES; each edge index is one edge of the topology."""
    docs = render(path)
    kinds = by_kind(docs)
    env = env_of(docs)
    assert {n for k, n in kinds if k == "Job" and kinds[(k, n)]["spec"].get("completionMode") == "Indexed"} == indexed
    client = kinds[("Job", "client")]
    (c,) = client["spec"]["template"]["spec"]["containers"]
    slot = next(e for e in c["env"] if e["name"] == "FEDHOP_SLOT")
    assert slot["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    plan = plan_processes(config_of(env, int(env["FEDHOP_CLIENT_PROCESSES"])))
    n = len(plan.clients)
    assert client["spec"]["completions"] == client["spec"]["parallelism"] == n == int(env["FEDHOP_CLIENT_PROCESSES"])
    server = kinds[("Job", "server")]
    assert "completionMode" not in server["spec"] and server["spec"].get("completions", 1) == 1
    if "edge" in indexed:
        edge = kinds[("Job", "edge")]
        assert edge["spec"]["completions"] == edge["spec"]["parallelism"] == len(plan.edges)
        spec = edge["spec"]["template"]["spec"]
        assert spec["subdomain"] == "edge" == kinds[("Service", "edge")]["metadata"]["name"]
        assert kinds[("Service", "edge")]["spec"]["publishNotReadyAddresses"] is True
        args = spec["containers"][0]["args"]
        # pod K of Job edge has host name edge-K: edge-K.edge is where the clients look for edge K
        assert args[args.index("--node-id") + 1] == "edge-$(EDGE_INDEX)"
        assert args[args.index("--listen") + 1] == "edge-$(EDGE_INDEX).edge:7100"
        assert "edge-{edge}.edge:7100" in c["args"]
    if path.endswith("rwo"):
        assert kinds[("PersistentVolumeClaim", "fedhop-runs")]["spec"]["accessModes"] == ["ReadWriteOnce"]
        for w in workloads(docs):
            (term,) = w["spec"]["template"]["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            assert term["labelSelector"]["matchLabels"] == dict([PART_OF])
    else:
        assert kinds[("PersistentVolumeClaim", "fedhop-runs")]["spec"]["accessModes"] == ["ReadWriteMany"]


def node_of(workload: dict, plan) -> str:
    """The node id a pod of this workload runs as (tls overlay: the server, or client FEDHOP_SLOT)."""
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    if "server" in c["args"]:
        return "server"
    slot = next(e for e in c.get("env", []) if e["name"] == "FEDHOP_SLOT")
    return plan.clients[int(slot["value"])].node_id


@needs_kubectl
def test_tls_pods_mount_only_their_own_required_node_secret(tmp_path):
    docs = render("overlays/tls")
    env = env_of(docs)
    assert (env["FEDHOP_INSECURE"], env["FEDHOP_CERTS_DIR"], env["FEDHOP_MTLS"]) == ("0", "/certs", "1")
    plan = plan_processes(config_of(env, int(env["FEDHOP_CLIENT_PROCESSES"])))
    seen = []
    for w in workloads(docs):
        if w["metadata"]["name"] == "results":
            continue
        spec = w["spec"]["template"]["spec"]
        secrets = [v["secret"] for v in spec["volumes"] if "secret" in v]
        node = node_of(w, plan)
        assert secrets == [{"secretName": f"fedhop-node-{node}", "optional": False, "defaultMode": 0o440}], node
        assert {"name": "certs", "mountPath": "/certs", "readOnly": True} in spec["containers"][0]["volumeMounts"]
        seen.append(node)
    assert sorted(seen) == sorted(plan.node_ids)   # every process of the plan, once
    for path in ("base", "overlays/hierarchical", "overlays/rwo"):
        assert not [v for s in pod_specs(render(path)) for v in s["volumes"] if "secret" in v], path

    # the Secrets themselves: node-secrets.sh on a real `fedhop certs` folder
    from fedhop.deploy.certs import main as certs_main
    assert certs_main([str(tmp_path / "certs"), "--nodes", ",".join(plan.node_ids)]) == 0
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
    # a folder made before credentials existed: the shared secret, as before
    (tmp_path / "certs" / f"{plan.node_ids[0]}.cred").unlink()
    res = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), plan.node_ids[0]],
                         capture_output=True, text=True, timeout=120)
    (old_style,) = [d["data"] for d in yaml.safe_load_all(res.stdout) if d]
    assert "cluster.secret" in old_style and not any(k.endswith(".cred") for k in old_style)
    bad = subprocess.run([str(K8S / "node-secrets.sh"), str(tmp_path / "certs"), "edge-7"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "edge-7.pem" in bad.stderr


@needs_kubectl
def test_gpu_overlay_asks_one_gpu_per_server_and_client():
    kinds = by_kind(render("overlays/gpu"))
    for name in ("server", "client"):
        (c,) = kinds[("Job", name)]["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for spec in pod_specs(render("base")):
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"].get("limits", {})


@pytest.mark.parametrize("recorded, expected", [("0\n", 0), ("3\n", 3), (None, 0)])
def test_a_member_role_leaves_with_the_runs_status(tmp_path, recorded, expected):
    """What ends a client or edge Job: once its process ended normally, the role exits with the
    status the server's role recorded in RUN/server.exit (0 when none appeared in time)."""
    import signal

    from fedhop.deploy.role import SERVER_EXIT, linger_until_server_exits
    if recorded is not None:
        (tmp_path / SERVER_EXIT).write_text(recorded)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert linger_until_server_exits(tmp_path, 0.3) == expected
    finally:
        signal.signal(signal.SIGTERM, before)
