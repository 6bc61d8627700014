"""`fedhop k8s CONFIG --out DIR` (deploy/launch/k8s_render.py): the user's own experiment on Kubernetes
without a clone (issue 45, item 5).  Run as a user runs it, from a folder outside the checkout with
relative paths; every object is validated against the Kubernetes schemas (kubernetes-validate,
strict), the Jobs are the config's process plan, the config and plug-in files travel in a ConfigMap
every pod mounts, and each pod mounts only its own node's Secret (rendered from a `fedhop certs`
folder with --certs: ca.pem and that node's files, never a CA or issuer key).  A file holding
Secrets is 0600 in a 0700 folder; overrides reach the pods as the user gave them; every Job has a
deadline; bad --image, --storage and --deadline values are one line, exit 2."""
from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.topologies.plan import plan_processes
from fedhop.deploy.launch.k8s_render import DEFAULT_DEADLINE_S, RenderError, check_options

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (it is in the dev extra)")

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = [sys.executable, "-m", "fedhop.deploy.cli.cli"]


def fedhop(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # a user's usual umask, whatever this process's: what the modes below are checked against
    return subprocess.run([*FEDHOP, *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                          preexec_fn=lambda: os.umask(0o022))


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
        assert job["spec"]["activeDeadlineSeconds"] == DEFAULT_DEADLINE_S == 24 * 3600
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


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_file_holding_secrets_is_0600_in_a_0700_folder(user):
    """fedhop.yaml with --certs holds every node's private key and credential: like every other
    generator's keys it is 0600 in a 0700 folder under a 0022 umask, also when it replaces a 0644
    file rendered earlier without --certs; the printed line says so.  Without Secrets the umask rules."""
    nodes = plan_processes(load_config(user / "star.toml")).node_ids
    assert fedhop("certs", "certs", "--nodes", ",".join(nodes), cwd=user).returncode == 0
    plain = fedhop("k8s", "star.toml", "--out", "k8s-run", cwd=user)
    assert plain.returncode == 0, plain.stderr
    assert (mode(user / "k8s-run"), mode(user / "k8s-run" / "fedhop.yaml")) == (0o755, 0o644)
    assert "0600" not in plain.stdout
    res = fedhop("k8s", "star.toml", "--out", "k8s-run", "--certs", "certs", cwd=user)
    assert res.returncode == 0, res.stderr
    assert (mode(user / "k8s-run"), mode(user / "k8s-run" / "fedhop.yaml")) == (0o700, 0o600)
    assert [d["kind"] for d in documents(user / "k8s-run" / "fedhop.yaml")].count("Secret") == len(nodes)
    assert sorted(p.name for p in (user / "k8s-run").iterdir()) == ["fedhop.yaml"]   # no temporary file left
    assert "k8s-run/fedhop.yaml (mode 0600 in a 0700 folder" in res.stdout
    fresh = fedhop("k8s", "star.toml", "--out", "new/k8s", "--certs", "certs", cwd=user)
    assert fresh.returncode == 0, fresh.stderr
    assert (mode(user / "new" / "k8s"), mode(user / "new" / "k8s" / "fedhop.yaml")) == (0o700, 0o600)


def test_overrides_reach_every_pod_as_the_user_gave_them(user, monkeypatch):
    """FEDHOP_SET is read by deploy/launch/role.py with shlex.split: values with spaces and quotes
    come back as the --set arguments given, and the pods load the config the user asked for."""
    from fedhop.deploy.launch.role import overrides as role_overrides
    given = ["model.hidden=[64, 32]", 'run.name="my run"', "clients.processes=3", "algorithm.lr=0.05"]
    res = fedhop("k8s", "star.toml", "--out", "k8s-run", *[a for o in given for a in ("--set", o)], cwd=user)
    assert res.returncode == 0, res.stderr
    docs = documents(user / "k8s-run" / "fedhop.yaml")
    (env,) = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedhop-env"]
    monkeypatch.setenv("FEDHOP_SET", env["FEDHOP_SET"])
    assert role_overrides() == given
    cfg = load_config(user / "star.toml", role_overrides())
    assert (cfg.model.hidden, cfg.run.name) == ([64, 32], "my run")
    assert len([d for d in docs if d["kind"] == "Job"]) == 1 + len(plan_processes(cfg).clients)


def test_the_deadline_is_every_jobs_and_can_be_changed(user):
    res = fedhop("k8s", "hier.toml", "--out", "k8s-run", "--deadline", "3600", cwd=user)
    assert res.returncode == 0, res.stderr
    docs = documents(user / "k8s-run" / "fedhop.yaml")
    for doc in docs:
        kv.validate(doc, "1.31", strict=True)
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) > 2 and {j["spec"]["activeDeadlineSeconds"] for j in jobs} == {3600}
    assert "after 3600 s" in res.stdout


@pytest.mark.parametrize("image", ["fedhop:cpu", "fedhop", "registry.example.com:5000/team/fedhop:cpu-1.2_x",
                                   "localhost/fedhop", "ghcr.io/o/fed_hop__x.y-z:v1",
                                   "fedhop:cpu@sha256:" + "a" * 64, "[::1]:5000/fedhop:cpu"])
@pytest.mark.parametrize("storage", ["2Gi", "500Mi", "10G", "1.5Gi", "1e9", "100"])
def test_image_references_and_quantities_that_kubernetes_takes_are_taken(image, storage):
    assert check_options(image, storage, "60") == 60


@pytest.mark.parametrize("image, storage, deadline, flag", [
    ("bad image!", "2Gi", "60", "--image"), ("Fedhop:cpu", "2Gi", "60", "--image"), ("fedhop:", "2Gi", "60", "--image"),
    ("fedhop:cpu@sha256:abc", "2Gi", "60", "--image"), ("/fedhop", "2Gi", "60", "--image"),
    ("fedhop", "lots", "60", "--storage"), ("fedhop", "0", "60", "--storage"), ("fedhop", "-1Gi", "60", "--storage"),
    ("fedhop", "2GB", "60", "--storage"), ("fedhop", "2 Gi", "60", "--storage"), ("fedhop", "", "60", "--storage"),
    ("fedhop", "2Gi", "0", "--deadline"), ("fedhop", "2Gi", "-5", "--deadline"), ("fedhop", "2Gi", "1.5", "--deadline"),
    ("fedhop", "2Gi", "1d", "--deadline"), ("fedhop", "2Gi", "\u00b2", "--deadline"),
])
def test_values_kubernetes_would_refuse_are_refused_naming_the_flag(image, storage, deadline, flag):
    with pytest.raises(RenderError, match=f"^{flag} "):
        check_options(image, storage, deadline)


@pytest.mark.parametrize("args, message", [
    (["star.toml", "--storage", "lots"], "--storage 'lots': not a positive Kubernetes quantity"),
    (["star.toml", "--image", "bad image!"], "--image 'bad image!': not an image reference"),
    (["star.toml", "--deadline=-1"], "--deadline '-1': a whole number of seconds"),
    (["star.toml", "--deadline", "soon"], "--deadline 'soon': a whole number of seconds"),
    (["star.toml", "--set", "security.insecure=true"], "security.insecure = true"),
    (["star.toml", "--certs", "nowhere"], "nowhere/ca.pem is missing"),
    (["star.toml", "--file", "absent.py"], "--file absent.py: no such file"),
    (["star.toml", "--set", "clients.count=abc"], "clients.count"),
    (["star.toml", "--file", "blob.bin"], "--file blob.bin: not UTF-8 text (byte 0xff at offset 0)"),
    (["star.toml", "--certs", "spoilt"], "spoilt/server.pem is not a PEM certificate"),
    (["star.toml", "--certs", "spoiltkey"], "spoiltkey/client-proc0.key is not an unencrypted PEM private key"),
])
def test_what_cannot_be_rendered_is_one_line_exit_2(user, args, message):
    (user / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    if "--certs" in args and args[-1].startswith("spoilt"):   # a certs folder with one file that is no PEM
        folder = user / args[-1]
        assert fedhop("certs", args[-1], "--config", "star.toml", cwd=user).returncode == 0
        spoilt = "server.pem" if args[-1] == "spoilt" else "client-proc0.key"
        (folder / spoilt).write_bytes(b"-----BEGIN NOTHING-----\nabc\n")
    res = fedhop("k8s", *args, "--out", "out", cwd=user)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert not (user / "out").exists()
