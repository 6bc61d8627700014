"""deploy/k8s: every kustomization renders with `kubectl kustomize`, validates against the
Kubernetes schemas (kubernetes-validate, strict), and wires what the roles need: the client
StatefulSet's ordinal picks the client block, replicas match the layout, certificates come from a
Secret readable by uid 10001, every container requests resources, the GPU overlay one GPU each."""
from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.deploy.hosts import process_layout

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (it is in the dev extra)")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (kubectl kustomize renders)")
KUSTOMIZATIONS = ["base", "overlays/hierarchical", "overlays/tls", "overlays/gpu"]
K8S_VERSION = "1.31"


def render(path: str) -> list[dict]:
    res = subprocess.run([KUBECTL, "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def env_of(docs: list[dict]) -> dict[str, str]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("fedhop-env")]
    return cm["data"]


def containers(docs: list[dict]) -> list[dict]:
    return [c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]]


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_manifests_render_and_validate_against_the_schemas(path):
    docs = render(path)
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)
    kinds = by_kind(docs)
    assert ("Deployment", "server") in kinds and ("Service", "server") in kinds
    assert ("StatefulSet", "client") in kinds and ("PersistentVolumeClaim", "fedhop-runs") in kinds
    for c in containers(docs):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
        assert {"name": "runs", "mountPath": "/runs"} in c["volumeMounts"]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["fsGroup"] == 10001
            certs = next(v for v in spec["volumes"] if v["name"] == "certs")
            assert certs["secret"]["secretName"] == "fedhop-certs" and certs["secret"]["defaultMode"] == 0o440


@needs_kubectl
def test_the_validator_rejects_a_broken_manifest():
    docs = render("base")
    broken = copy.deepcopy(by_kind(docs)[("StatefulSet", "client")])
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(by_kind(docs)[("Deployment", "server")])
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(unknown, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("path, statefulsets", [("base", {"client"}), ("overlays/hierarchical", {"client", "edge"})])
def test_ordinals_pick_the_blocks_of_the_layout(path, statefulsets):
    """Pod client-K hosts block K: the StatefulSet has one pod per block of the layout the config
    gives, and each edge pod is one edge of the topology."""
    docs = render(path)
    kinds = by_kind(docs)
    env = env_of(docs)
    assert {n for k, n in kinds if k == "StatefulSet"} == statefulsets
    client = kinds[("StatefulSet", "client")]
    (c,) = client["spec"]["template"]["spec"]["containers"]
    slot = next(e for e in c["env"] if e["name"] == "FEDHOP_SLOT")
    assert slot["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    cfg = load_config(str(ROOT / env["FEDHOP_CONFIG"].removeprefix("/app/")),
                      shlex.split(env["FEDHOP_SET"]) + [f"clients.processes={env['FEDHOP_CLIENT_PROCESSES']}"])
    assert client["spec"]["replicas"] == len(process_layout(cfg)) == int(env["FEDHOP_CLIENT_PROCESSES"])
    if "edge" in statefulsets:
        edge = kinds[("StatefulSet", "edge")]
        assert edge["spec"]["replicas"] == cfg.topology.edges
        assert kinds[("Service", "edge")]["spec"]["publishNotReadyAddresses"] is True
        assert "edge-{edge}.edge:7100" in c["args"]
    assert env["FEDHOP_HOLD"] == "1"


@needs_kubectl
def test_tls_overlay_turns_on_mutual_tls_and_gpu_overlay_asks_one_gpu_each():
    tls = env_of(render("overlays/tls"))
    assert (tls["FEDHOP_INSECURE"], tls["FEDHOP_CERTS_DIR"], tls["FEDHOP_MTLS"]) == ("0", "/certs", "1")
    assert env_of(render("base"))["FEDHOP_INSECURE"] == "1"
    gpu = render("overlays/gpu")
    for c in containers(gpu):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "fedhop:cuda"
    for c in containers(render("base")):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {}) and c["image"] == "fedhop:cpu"
