"""`fedhop k8s CONFIG --out DIR` (deploy/launch/k8s_render.py): the user's own experiment on Kubernetes
without a clone (issue 45, item 5).  Run as a user runs it, from a folder outside the checkout with
relative paths; every object is validated against the Kubernetes schemas (kubernetes-validate,
strict), the Jobs are the config's process plan, the config and plug-in files travel in a ConfigMap
every pod mounts, and each pod mounts only its own node's Secret (rendered from a `fedhop certs`
folder with --certs: ca.pem and that node's files, never a CA or issuer key)."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.topologies.plan import plan_processes

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (it is in the dev extra)")

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = [sys.executable, "-m", "fedhop.deploy.cli.cli"]


def fedhop(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*FEDHOP, *args], cwd=cwd, capture_output=True, text=True, timeout=180)


def documents(path: Path) -> list[dict]:
    return [json.loads(d) for d in path.read_text().split("---\n") if d.strip()]


@pytest.fixture()
def user(tmp_path: Path) -> Path:
    (tmp_path / "hier.toml").write_text((ROOT / "examples" / "hierfavg_digits.toml").read_text())
    (tmp_path / "star.toml").write_text((ROOT / "examples" / "fedavg_digits.toml").read_text())
    (tmp_path / "mymodels.py").write_text("import torch\n\n\ndef make_net(input_shape, n_outputs):\n"
                                          "    return torch.nn.Linear(64, n_outputs)\n")
    return tmp_path


@pytest.mark.parametrize("config", ["hier.toml", "star.toml"])
def test_the_manifests_are_the_plan_valid_and_each_pod_mounts_its_own_secret(user, config):
    res = fedhop("k8s", config, "--out", "k8s-run", "--set", "clients.processes=3", cwd=user)
    assert res.returncode == 0, res.stderr
    docs = documents(user / "k8s-run" / "fedhop.yaml")
    for doc in docs:
        kv.validate(doc, "1.31", strict=True)
    plan = plan_processes(load_config(user / config, ["clients.processes=3"]))
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}
    assert list(jobs) == plan.node_ids
    for name, job in jobs.items():
        pod = job["spec"]["template"]["spec"]
        assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secrets == [f"fedhop-node-{name}"]
        assert {"name": "config", "configMap": {"name": "fedhop-config"}} in pod["volumes"]
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
    slots = [int(e["value"]) for j in jobs.values() for e in j["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert slots == list(range(len(plan.clients)))
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedhop-config"]
    assert config_map["data"] == {config: (user / config).read_text()}
    (env,) = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedhop-env"]
    assert env["FEDHOP_CONFIG"] == f"/config/{config}" and env["FEDHOP_SET"] == "clients.processes=3"
    assert env["FEDHOP_CLIENT_PROCESSES"] == str(len(plan.clients)) and env["FEDHOP_MTLS"] == "1"
    assert env["FEDHOP_SECURITY"] == "mtls" and env["FEDHOP_INSECURE"] == "0"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert services == ({"server", "edge"} if plan.edges else {"server"})


def test_certs_render_each_nodes_secret_with_only_its_own_files_and_plugins_travel(user):
    cfg = load_config(user / "star.toml")
    nodes = plan_processes(cfg).node_ids
    assert fedhop("certs", "certs", "--nodes", ",".join(nodes), cwd=user).returncode == 0
    res = fedhop("k8s", "star.toml", "--out", "out", "--certs", "certs", "--file", "mymodels.py",
                 "--set", "model.factory=mymodels:make_net", cwd=user)
    assert res.returncode == 0, res.stderr
    docs = documents(user / "out" / "fedhop.yaml")
    for doc in docs:
        kv.validate(doc, "1.31", strict=True)
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {f"fedhop-node-{n}" for n in nodes}
    for node in nodes:
        data = secrets[f"fedhop-node-{node}"]
        assert set(data) <= {"ca.pem", f"{node}.pem", f"{node}.key", f"{node}.cred"}
        assert {"ca.pem", f"{node}.pem", f"{node}.key"} <= set(data)
        for name, b64 in data.items():
            assert base64.b64decode(b64) == (user / "certs" / name).read_bytes()
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedhop-config"]
    assert config_map["data"]["mymodels.py"] == (user / "mymodels.py").read_text()
    (env,) = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedhop-env"]
    assert env["FEDHOP_PLUGIN_PATH"] == "/config"
    assert "mymodels" in env.get("FEDHOP_ALLOW_PLUGINS", "")


@pytest.mark.parametrize("args, message", [
    (["star.toml", "--set", "security.insecure=true"], "security.insecure = true"),
    (["star.toml", "--certs", "nowhere"], "nowhere/ca.pem is missing"),
    (["star.toml", "--file", "absent.py"], "--file absent.py: no such file"),
    (["star.toml", "--set", "clients.count=abc"], "clients.count"),
])
def test_what_cannot_be_rendered_is_one_line_exit_2(user, args, message):
    res = fedhop("k8s", *args, "--out", "out", cwd=user)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert not (user / "out").exists()
